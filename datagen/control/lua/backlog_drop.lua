--! uses lib
-- Drops up to `count` undispatched prompts of a cancelled job (their RQ job hashes too) and counts
-- them cancelled. Returns how many it dropped.
--
-- KEYS[1]  backlog        the job's backlog of the class
-- KEYS[2]  job_key        the job's hash
-- KEYS[3]  breakdown      its breakdown hash
-- ARGV[1]  rq_job_prefix  RQ job key prefix (`rq:job:`)
-- ARGV[2]  count: number  how many at most
-- ARGV[3]  cls            the class

local ids = redis.call('LPOP', backlog, count)
if not ids then return 0 end
for _, id in ipairs(ids) do redis.call('UNLINK', rq_job_prefix .. id) end
count_cancelled_queued(job_key, breakdown, cls, #ids)
return #ids
