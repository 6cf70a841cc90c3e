--! uses lib
-- Counts prompts of a job cancelled before any worker ran them (taken off RQ's queue by a cancel),
-- by the library's rule, in the caller's transaction.
--
-- KEYS[1]  job_key    the job's hash
-- KEYS[2]  breakdown  its breakdown hash
-- ARGV[1]  cls        the prompts' class
-- ARGV[2]  n: number  how many

count_cancelled_queued(job_key, breakdown, cls, n)
return n
