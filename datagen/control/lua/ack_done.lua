--! uses lib
-- The prompts of a committed shard finish in RQ and count done in their jobs, in one call instead
-- of one RQ transaction and one count script per prompt. Returns how many prompts were counted.
--
-- Per prompt, as RQ's handle_job_success: the started-registry member goes, the RQ job is
-- `finished` with its `ended_at` and expires after its result TTL, and it joins the finished
-- registry scored by that expiry; only for a prompt this call counts (`ack_in_job` in lib.lua): a
-- prompt no longer running (counted already, or back in its backlog in a job rebuilt from storage,
-- `service.rebuild`) keeps its RQ job as it is, so a stale ack never finishes or expires a copy
-- that waits to run. Not written: RQ's Result stream entries and the worker's success counters
-- (nothing reads them, and each would cost a command per prompt).
-- Per job, by the library's counting rules: a prompt of another incarnation of its job neither
-- counts nor touches RQ's hashes.
--
-- KEYS[1]   started            the class's RQ started registry
-- KEYS[2]   finished           its finished registry
-- ARGV[1]   rq_job_prefix      RQ job key prefix (`rq:job:`)
-- ARGV[2]   job_prefix         job key prefix (the job id follows)
-- ARGV[3]   running_suffix     what follows a job's key in its running set's
-- ARGV[4]   breakdown_suffix   ... in its breakdown's
-- ARGV[5]   partitions_suffix  ... in its labelled partitions'
-- ARGV[6]   now_ms             now (ms)
-- ARGV[7]   now_rq             now in RQ's time format
-- ARGV[8]   now_s: number      now (epoch s)
-- ARGV[9]   execution_id       the execution id of the started-registry members
-- ARGV[10]  running_state      the state of a job whose prompts run
-- ARGV[11]  completed_state    the state a job moves to when its last prompt ends
-- ARGV[12..] prompts           9 per prompt: RQ id, job id, the job incarnation it belongs to ('' for
--                              none), output tokens, partition, class, finish reason, result TTL (s),
--                              recipe arm ('' for none)

local acked = {}
for i = 1, #prompts, 9 do
  acked[#acked + 1] = {
    rq_id = prompts[i], job_id = prompts[i + 1], incarnation = prompts[i + 2],
    output_tokens = tonumber(prompts[i + 3]), partition = prompts[i + 4], cls = prompts[i + 5],
    finish = prompts[i + 6], result_ttl_s = tonumber(prompts[i + 7]), arm = prompts[i + 8],
  }
end
if #acked == 0 then return 0 end
local groups, order, members = {}, {}, {}
for _, prompt in ipairs(acked) do
  members[#members + 1] = prompt.rq_id .. ':' .. execution_id
  if not groups[prompt.job_id] then
    groups[prompt.job_id] = {}
    order[#order + 1] = prompt.job_id
  end
  table.insert(groups[prompt.job_id], prompt)
end
redis.call('ZREM', started, unpack(members))

local rq = {prefix = rq_job_prefix, now = now_rq, now_s = now_s, expiring = {}}
local acked_n = 0
for _, job_id in ipairs(order) do
  local key = job_prefix .. job_id
  local job = {
    key = key, running = key .. running_suffix, breakdown = key .. breakdown_suffix,
    partitions = key .. partitions_suffix,
  }
  local done, tokens, breakdown, fields = ack_in_job(job, groups[job_id], rq)
  if done > 0 then
    acked_n = acked_n + done
    count_and_complete(job, fields, 'done', done, tokens, breakdown, now_ms, running_state, completed_state)
  end
end
if #rq.expiring > 0 then redis.call('ZADD', finished, unpack(rq.expiring)) end
return acked_n
