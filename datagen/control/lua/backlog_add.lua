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

local n = math.floor(#prompts / 3)
if n <= 0 then return 0 end
local rq_ids = save_queued(rq_job_prefix, prompts, 1, n, cjson.decode(rq_fields))
local job = redis.call('HMGET', job_key, 'state', 'weight')
if not job[1] then return 0 end
if job[1] == cancelled_state then
  count_cancelled_queued(job_key, breakdown, cls, n)
  return 0
end
backlog_push({
  backlog = backlog, set = dispatch_set, paused = paused, job_id = job_id, job_key = job_key, weight = job[2],
  wake = wake, cls = cls,
}, rq_ids, slice)
return n
