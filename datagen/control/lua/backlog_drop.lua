--! uses lib
-- Drops up to `count` undispatched prompts of a cancelled job (their RQ job hashes too) and counts
-- them cancelled. Returns how many it dropped.
--
-- KEYS[1]  backlog        the job's backlog of the class
-- KEYS[2]  job_key        the job's hash
-- KEYS[3]  breakdown      its breakdown hash
-- ARGV[1]  rq_job_prefix  RQ job key prefix (`rq:job:`)
-- ARGV[2]  count          how many at most
-- ARGV[3]  cls            the class
local backlog = KEYS[1]
local job_key = KEYS[2]
local breakdown = KEYS[3]
local rq_job_prefix = ARGV[1]
local count = tonumber(ARGV[2])
local cls = ARGV[3]

local ids = redis.call('LPOP', backlog, count)
if not ids then return 0 end
for _, id in ipairs(ids) do redis.call('UNLINK', rq_job_prefix .. id) end
count_cancelled_queued(job_key, breakdown, cls, #ids)
return #ids
