--! uses lib
-- Pauses a job: it leaves every dispatch set (and their weight sums) with its pause, so claims
-- never look at it again until it is resumed. Returns 1.
--
-- KEYS[1]   paused   the paused jobs
-- KEYS[2]   job_key  the job's hash (its weight)
-- KEYS[3..] sets     every dispatch set (each class and priority)
-- ARGV[1]   job_id   the job id

redis.call('SADD', paused, job_id)
for _, set in ipairs(sets) do leave(set, job_id, job_key) end
return 1
