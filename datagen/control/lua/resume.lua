--! uses lib
-- Resumes a paused job: each class it has prompts of rejoins its dispatch set. Returns 1.
--
-- KEYS[1]   paused   the paused jobs
-- KEYS[2..] classes  2 per class: the job's backlog of the class, the dispatch set of the class at
--                    the job's priority
-- ARGV[1]   job_id   the job id
local paused = KEYS[1]
local classes = {}
for i = 2, #KEYS, 2 do classes[#classes + 1] = {backlog = KEYS[i], set = KEYS[i + 1]} end
local job_id = ARGV[1]

redis.call('SREM', paused, job_id)
for _, class in ipairs(classes) do
  if redis.call('LLEN', class.backlog) > 0 then rejoin(class.set, paused, job_id) end
end
return 1
