--! uses lib
-- Resumes a paused job: each class it has prompts of rejoins its dispatch set, and the job's
-- `resumed_at_ms` is now, where its recent share's window starts (`Dispatch.page_shares`: the
-- share reports what the job got while it could run, not the pause before). Returns 1.
--
-- KEYS[1]   paused   the paused jobs
-- KEYS[2]   job_key  the job's hash
-- KEYS[3..] classes  2 per class: the job's backlog of the class, the dispatch set of the class at
--                    the job's priority
-- ARGV[1]   job_id   the job id
-- ARGV[2]   now_ms   now (ms)

redis.call('SREM', paused, job_id)
if redis.call('EXISTS', job_key) == 1 then redis.call('HSET', job_key, 'resumed_at_ms', now_ms) end
for i = 1, #classes, 2 do
  local backlog, set = classes[i], classes[i + 1]
  if redis.call('LLEN', backlog) > 0 then rejoin(set, paused, job_id, job_key) end
end
return 1
