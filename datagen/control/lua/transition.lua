-- Moves a job from one of the given states to another, setting fields with it. Returns 1 if it
-- moved. A job that does not exist never moves (and is never recreated). The token is kept in the
-- hash: the same call sent again (its reply was lost, and redis-py or the caller repeated it)
-- finds its own token and answers 1 again instead of "not moved".
--
-- KEYS[1]   job_key       the job's hash (its ingest fence is its `ingest_fence`, '' for none)
-- KEYS[2]   legacy_fence  its ingest fence key of older versions
-- ARGV[1]   sources       the states it may move from, space-separated
-- ARGV[2]   target        the state it moves to
-- ARGV[3]   fence_op      what happens to the fence: '' nothing, 'drop' (ingestion may enqueue no
--                         more), 'arm' (ingestion may enqueue for the job's incarnation)
-- ARGV[4]   token         this call's token
-- ARGV[5..] fields        field, value, field, value, ... to set with the move

local state = redis.call('HGET', job_key, 'state')
if not state then return 0 end
if state == target and redis.call('HGET', job_key, 'transition') == token then return 1 end
local allowed = false
for from in string.gmatch(sources, '%S+') do
  if from == state then allowed = true end
end
if not allowed then return 0 end
-- One HSET with the fields (a resubmission's ingest input and checkpoint among them).
local values = {'state', target, 'transition', token}
if fence_op == 'drop' then values[5], values[6] = 'ingest_fence', '' end
if fence_op == 'arm' then
  values[5], values[6] = 'ingest_fence', redis.call('HGET', job_key, 'incarnation') or ''
end
for _, value in ipairs(fields) do values[#values + 1] = value end
redis.call('HSET', job_key, unpack(values))
-- An ingestion an older version still runs checks the fence key it knows.
if fence_op == 'drop' then redis.call('DEL', legacy_fence) end
return 1
