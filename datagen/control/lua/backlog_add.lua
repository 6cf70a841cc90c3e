--! uses lib
-- Appends prompts to a job's backlog of one class, inside the caller's transaction, and tells idle
-- workers (`workers.claim.wake`). A cancelled job takes no more prompts: they are counted cancelled
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
-- ARGV[5..] rq_ids           the prompts' RQ ids

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
