--! uses lib
-- Puts failed prompts of one class back in their job's backlog. Only a prompt this script removes
-- from the failed registry is requeued and counted, so concurrent retries can never run a prompt
-- twice or count it twice; a cancelled (or deleted) job takes none. A completed job runs again.
-- Returns the ids that moved, -1 if the job refused.
--
-- KEYS[1]   job_key          the job's hash
-- KEYS[2]   breakdown        its breakdown hash
-- KEYS[3]   registry         the class's RQ failed registry
-- KEYS[4]   backlog          the job's backlog of the class
-- KEYS[5]   dispatch_set     the dispatch set of the class at the job's priority
-- KEYS[6]   paused           the paused jobs
-- ARGV[1]   rq_job_prefix    RQ job key prefix (`rq:job:`)
-- ARGV[2]   job_id           the job id
-- ARGV[3]   completed_state  the state of a job whose prompts all ended
-- ARGV[4]   cancelled_state  the state of a cancelled job
-- ARGV[5]   running_state    the state a completed job moves back to
-- ARGV[6..] prompts          4 per prompt: RQ id, its new RQ meta (serialized), retries left ('' to
--                            keep), the breakdown field it counted failed in

local state = redis.call('HGET', job_key, 'state')
if not state or state == cancelled_state then return -1 end
local moved = {}
for i = 1, #prompts, 4 do
  local prompt = {
    rq_id = prompts[i], meta = prompts[i + 1], retries_left = prompts[i + 2], failed_field = prompts[i + 3],
  }
  if redis.call('ZREM', registry, prompt.rq_id) == 1 then
    local rqkey = rq_job_prefix .. prompt.rq_id
    redis.call('HSET', rqkey, 'status', 'queued', 'meta', prompt.meta)
    if prompt.retries_left ~= '' then redis.call('HSET', rqkey, 'retries_left', prompt.retries_left) end
    redis.call('PERSIST', rqkey)
    redis.call('RPUSH', backlog, prompt.rq_id)
    redis.call('HINCRBY', breakdown, prompt.failed_field, -1)
    moved[#moved + 1] = prompt.rq_id
  end
end
if #moved > 0 then
  redis.call('HINCRBY', job_key, 'failed', -#moved)
  redis.call('HINCRBY', job_key, 'retried', #moved)
  rejoin(dispatch_set, paused, job_id, job_key)
  if state == completed_state then
    redis.call('HSET', job_key, 'state', running_state, 'finished_at_ms', 0)
  end
end
return moved
