--! uses lib
-- Saves prompts' RQ jobs (queued, the hash RQ's `Job.save` writes: `datagen.control.enqueue.queued_jobs`)
-- and appends them to a job's backlog of one class, inside the caller's transaction, and tells idle
-- workers (`workers.claim.wake`). The jobs are saved whatever the job's state, as RQ's own enqueue
-- would have saved them. A cancelled job takes no more prompts: they are counted cancelled
-- instead (a worker may enqueue a multi-turn conversation's next turn as the cancel lands); a
-- deleted job takes none and counts nothing (its keys must not come back). Returns how many were
-- appended.
--
-- KEYS[1]   job_key          the job's hash
-- KEYS[2]   backlog          its backlog of the class
-- KEYS[3]   dispatch_set     the dispatch set of the class at the job's priority
-- KEYS[4]   breakdown        the job's breakdown hash
-- KEYS[5]   wake             the wake channel
-- KEYS[6]   paused           the paused jobs
-- ARGV[1]   job_id           the job id
-- ARGV[2]   slice: number    RQ ids per RPUSH (Lua's unpack has a stack limit)
-- ARGV[3]   cls              the class
-- ARGV[4]   cancelled_state  the state of a cancelled job
-- ARGV[5]   rq_job_prefix    RQ's job key prefix
-- ARGV[6]   rq_fields        JSON list of the field/value pairs every one of the RQ jobs shares
-- ARGV[7..] prompts          per prompt: its RQ id, its description and its data (RQ's fields)

local shared = cjson.decode(rq_fields)
local rq_ids = {}
for i = 1, #prompts, 3 do
  local rq_id = prompts[i]
  rq_ids[#rq_ids + 1] = rq_id
  redis.call('HSET', rq_job_prefix .. rq_id, 'description', prompts[i + 1], 'data', prompts[i + 2],
    unpack(shared))
end
local n = #rq_ids
if n <= 0 then return 0 end
local state = redis.call('HGET', job_key, 'state')
if not state then return 0 end
if state == cancelled_state then
  count_cancelled_queued(job_key, breakdown, cls, n)
  return 0
end
for i = 1, n, slice do
  redis.call('RPUSH', backlog, unpack(rq_ids, i, math.min(i + slice - 1, n)))
end
rejoin(dispatch_set, paused, job_id, job_key)
redis.call('PUBLISH', wake, cls)
return n
