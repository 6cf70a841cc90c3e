--! uses lib
-- Counts one prompt that ended (done, failed or cancelled) in its job by the library's counting
-- rules, keeps its failure report, and completes the job if that was its last prompt. Called with
-- no prompt and a zero increment, it only applies the tail and completion rules (ingestion ended,
-- or a retry put nothing back). Returns 0 if the job is gone or of another incarnation, -1 if the
-- prompt was not running (counted already: nothing changes), 2 if the job completed, else 1.
--
-- KEYS[1]  job_key          the job's hash
-- KEYS[2]  running          its running set
-- KEYS[3]  reports          its failure reports (a capped list)
-- KEYS[4]  breakdown        its breakdown hash
-- KEYS[5]  partitions       its labelled partitions
-- ARGV[1]  counter          the counter the prompt moves: done, failed or cancelled
-- ARGV[2]  increment: number  how many prompts it adds (0: none)
-- ARGV[3]  output_tokens: number  their output tokens
-- ARGV[4]  now_ms           now (ms)
-- ARGV[5]  rq_id            the RQ id that leaves the running set ('' for none)
-- ARGV[6]  report           a failure report to keep, JSON ('' for none)
-- ARGV[7]  report_cap: number  how many failure reports the job keeps
-- ARGV[8]  partition        the prompt's partition
-- ARGV[9]  cls              its class
-- ARGV[10] finish           its finish reason ('' for none)
-- ARGV[11] incarnation      the job incarnation it belongs to ('' for none)
-- ARGV[12] running_state    the state of a job whose prompts run
-- ARGV[13] completed_state  the state a job moves to when its last prompt ends

local job = {key = job_key, running = running, breakdown = breakdown, partitions = partitions}
local fields = job_read(job, label_fields({partition}))
local current = job_incarnation(fields)
if current == nil or not counts_in(incarnation, current) then return 0 end
if rq_id ~= '' and leave_running(job, {rq_id}, fields)[1] == 0 then return -1 end
local counts = {}
if increment ~= 0 then
  tally(counts, counter, partition_label(job, partition, labels_read(fields, {partition})), cls, increment,
    output_tokens, finish)
end
if report ~= '' then
  redis.call('RPUSH', reports, report)
  redis.call('LTRIM', reports, 0, report_cap - 1)
end
if count_and_complete(job, fields, counter, increment, output_tokens, counts, now_ms, running_state,
  completed_state) then
  return 2
end
return 1
