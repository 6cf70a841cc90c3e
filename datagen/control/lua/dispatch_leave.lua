--! uses lib
-- Takes a job out of every dispatch set, and its weight out of their sums (`Dispatch.withdraw`,
-- `JobStore.forget_keys`: a cancelled or deleted job). Returns 1.
--
-- KEYS[1]   job_key  the job's hash (its weight; read before the job's keys go)
-- KEYS[2..] sets     every dispatch set (each class and priority)
-- ARGV[1]   job_id   the job id

for _, set in ipairs(sets) do leave(set, job_id, job_key) end
return 1
