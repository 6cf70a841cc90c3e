--! uses lib
-- One ingestion chunk lands (`datagen.control.ingest_chunks`), whole or not at all, in one step:
-- its prompts' RQ jobs saved (queued) and appended to the job's backlogs (`backlog_add.lua` does
-- the same for one class), its rows added to the rows guard, its counters and checkpoint line, its
-- partition labels and breakdown, its kept rows' hygiene records and its checkpoint id. Atomic, so
-- the checks below hold for the writes (no WATCH, no second round trip). In order:
-- - A chunk whose id is the checkpoint already landed (its reply was lost, and it was sent again):
--   {'landed_before'}, nothing written. First, as a finishing chunk dropped the fence as it landed.
-- - The ingest fence must hold `fence_value` ('': not looked at): a cancel, failure or delete drops
--   it, another run of the ingestion takes it. Answers {'fence', what it holds or false}; the caller
--   tells a run that took over from a job that is gone (`fence_admits`).
-- - A job that is gone (no state) or cancelled takes nothing: {'fenced'} (never writes its hash back).
-- - `expect_rows` ('' for none): the job's `rows` counter the run started from (a run that found no
--   row landed reads neither the rows guard nor the seen records): {'stale'} if it moved, so the run
--   starts over from its checkpoint.
-- - Backpressure: the job's backlog of each class must have room for that class's `wanted` prompts
--   within `window`. Every prompt in a backlog was counted in `accepted` when it was enqueued (by
--   ingestion or a next turn, in the same step; a hand-back, reap or retry moves one counted
--   before), so a job whose `accepted` leaves room needs no LLEN. {'no_room', class, backlog}
--   otherwise: the caller waits for room and sends the chunk again.
-- Then the writes, and {'landed'}. The input's last chunk (`finish`) also ends the ingestion as
-- `finish_ingest.lua` does (an ingesting job runs, its fence dropped, and the tail and completion
-- rules apply at once), in the same step: a job's ingestion ends with its last chunk, and a chunk
-- sent again after a lost reply finds both done. Partitions get labels, their own, while the job
-- has fewer than `max_labels` and the partition is at most `max_label_chars` characters long, in
-- the order given (sorted); the rest count as 'other'. Every write of a job's rows guard, seen
-- records, labelled partitions and ingest checkpoint is a landing that counts at least one row (its
-- prompts and its rejected rows come from rows it counts; a row an earlier upload counted makes
-- `rows` positive already), so a job whose `rows` counter is 0 has none of them.
--
-- KEYS[1]   job_key          the job's hash: its ingest fence (`ingest_fence`, '' for none) and
--                            checkpoint (`ingest_at`, `<upload>:<last line>` of the last chunk
--                            landed) are two of its fields, read and written with the others
-- KEYS[2]   partitions       its labelled partitions
-- KEYS[3]   breakdown        its breakdown hash
-- KEYS[4]   rows_guard       its rows guard
-- KEYS[5]   seen             the segment of its seen records this chunk appends to
-- KEYS[6]   enqueued         its guard set of next turns enqueued
-- KEYS[7]   paused           the paused jobs
-- KEYS[8]   wake             the wake channel
-- KEYS[9]   running          its running set
-- KEYS[10..] backlogs        per class in `classes`: the job's backlog of it, the dispatch set of
--                            it at the job's priority
-- ARGV[1]   job_id           the job id
-- ARGV[2]   fence_value      what the fence must hold ('': not looked at)
-- ARGV[3]   chunk_id         the chunk's checkpoint id
-- ARGV[4]   last_line        its last line (the job's `ingest_line` once it lands)
-- ARGV[5]   expect_rows      the job's `rows` counter the run expects ('' for none)
-- ARGV[6]   window: number   prompts per class a job's backlog may hold
-- ARGV[7]   cancelled_state  the state of a cancelled job
-- ARGV[8]   rq_job_prefix    RQ's job key prefix
-- ARGV[9]   slice: number    values per RPUSH or HSET (Lua's unpack has a stack limit)
-- ARGV[10]  max_labels: number  partitions a job labels at most
-- ARGV[11]  max_label_chars: number  characters of a partition it labels at most
-- ARGV[12]  chunk_json       JSON: {counts = {counter: n}, partitions = [sorted], partitioned =
--                            [[counter, partition, class, n]] (breakdown by partition, labelled
--                            here), breakdown = {field: n} (labels fixed), rows = [field, value,
--                            ...], guard = [next turns' prompt keys], classes = [[class,
--                            wanted, prompts, RQ fields every one shares (JSON)]]}
-- ARGV[13]  seen_records     packed hygiene records of the kept rows ('' for none)
-- ARGV[14]  finish           '1': the input's last chunk, which ends the ingestion ('' for none)
-- ARGV[15]  now_ms           now (ms)
-- ARGV[16]  ingesting_state  the state of a job that ingests
-- ARGV[17]  running_state    the state of a job whose prompts run
-- ARGV[18]  completed_state  the state a job moves to when its last prompt ends
-- ARGV[19..] prompts         per prompt, class by class as in `classes`: its RQ id, its description
--                            and its data (RQ's fields)

local chunk = cjson.decode(chunk_json)
local names = {}
for name in pairs(chunk.counts) do names[#names + 1] = name end
-- The job read once (its fence and checkpoint, what the counting rules read, its `rows`, its
-- weight and the chunk's counters) and written once, at the end.
local job = {key = job_key, running = running, breakdown = breakdown, partitions = partitions}
local extra = {'ingest_fence', 'ingest_at', 'rows', 'weight'}
for _, name in ipairs(names) do extra[#extra + 1] = name end
local label_reads = label_fields(chunk.partitions)
for _, name in ipairs(label_reads) do extra[#extra + 1] = name end
local fields = job_read(job, extra)
if fields.ingest_at == chunk_id then return {'landed_before'} end
if fence_value ~= '' and fields.ingest_fence ~= fence_value then return {'fence', fields.ingest_fence} end
if not fields.state or fields.state == cancelled_state then return {'fenced'} end
local rows_before = counted(fields, 'rows')
if expect_rows ~= '' and rows_before ~= tonumber(expect_rows) then return {'stale'} end
local accepted = counted(fields, 'accepted')
for i, class in ipairs(chunk.classes) do
  local wanted = class[2]
  if accepted + wanted > window then
    local backlog = redis.call('LLEN', backlogs[2 * i - 1])
    if backlog + wanted > window then return {'no_room', class[1], backlog} end
  end
end

-- Its prompts, class by class.
local at = 0
for i, class in ipairs(chunk.classes) do
  local cls, n = class[1], class[3]
  local rq_ids = save_queued(rq_job_prefix, prompts, at + 1, n, cjson.decode(class[4]))
  at = at + 3 * n
  backlog_push({
    backlog = backlogs[2 * i - 1], set = backlogs[2 * i], paused = paused, job_id = job_id, job_key = job_key,
    weight = fields.weight, wake = wake, cls = cls,
  }, rq_ids, slice)
end
for s = 1, #chunk.guard, slice do
  redis.call('SADD', enqueued, unpack(chunk.guard, s, math.min(s + slice - 1, #chunk.guard)))
end

-- Its counters and checkpoint line (written with the job's other fields, at the end).
job_set(fields, 'ingest_line', last_line)
for _, name in ipairs(names) do job_set(fields, name, decimal(counted(fields, name) + chunk.counts[name])) end

-- Its partitions' labels, then its breakdown by label: looked up in the job's hash as read above
-- (`labels_read`), or in its labelled partitions for a job made before the hash kept them.
local known = labels_read(fields, chunk.partitions)
if #chunk.partitions > 0 then
  local count, new = tonumber(fields.labels or '0') or 0, {}
  if not (fields.labels and #label_reads > 0) and rows_before > 0 then
    -- Only a chunk that counted a row labelled partitions: none before the first.
    local labelled = redis.call('SMEMBERS', partitions)
    for _, partition in ipairs(labelled) do known[partition] = true end
    count = #labelled
  end
  for _, partition in ipairs(chunk.partitions) do
    if not known[partition] then
      -- Characters, not bytes (as Python counts them): in UTF-8, the bytes that are not
      -- continuation bytes; no more than its bytes, so a short one needs no count.
      local chars = #partition
      if chars > max_label_chars then chars = select(2, string.gsub(partition, '[^\128-\191]', '')) end
      known[partition] = count < max_labels and chars <= max_label_chars
      if known[partition] then
        count = count + 1
        new[#new + 1] = partition
        if fields.labels then job_set(fields, label_field(partition), '1') end
      end
    end
  end
  if #new > 0 then
    redis.call('SADD', partitions, unpack(new))
    if fields.labels then job_set(fields, 'labels', decimal(count)) end
  end
end
local counts = chunk.breakdown
for _, entry in ipairs(chunk.partitioned) do
  local label = partition_label(job, entry[2], known)
  local field = breakdown_field(entry[1], label, entry[3])
  counts[field] = (counts[field] or 0) + entry[4]
end
add_counts(breakdown, counts)

-- Its rows, its kept rows' records, and its id as the checkpoint.
for s = 1, #chunk.rows, 2 * slice do
  redis.call('HSET', rows_guard, unpack(chunk.rows, s, math.min(s + 2 * slice - 1, #chunk.rows)))
end
if seen_records ~= '' then redis.call('APPEND', seen, seen_records) end
job_set(fields, 'ingest_at', chunk_id)
if finish == '' then
  job_write(job, fields)
  return {'landed'}
end
if fields.state == ingesting_state then
  job_set(fields, 'state', running_state)
  job_set(fields, 'ingest_fence', '')
end
count_and_complete(job, fields, 'done', 0, 0, {}, now_ms, running_state, completed_state)
return {'landed'}
