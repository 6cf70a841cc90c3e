--! uses lib
-- Resumes a paused job: each class it has prompts of rejoins its dispatch set. Returns 1.
--
-- KEYS[1]   paused   the paused jobs
-- KEYS[2..] classes  2 per class: the job's backlog of the class, the dispatch set of the class at
--                    the job's priority
-- ARGV[1]   job_id   the job id

redis.call('SREM', paused, job_id)
for i = 1, #classes, 2 do
  local backlog, set = classes[i], classes[i + 1]
  if redis.call('LLEN', backlog) > 0 then rejoin(set, paused, job_id) end
end
return 1
