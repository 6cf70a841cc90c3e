--! uses lib
-- Ends a job's ingestion in one step: an ingesting job moves to `running_state` (its ingest fence
-- goes: ingestion enqueues nothing more), and the tail and completion rules apply at once, so a job
-- with nothing left to run is never seen running before it is seen completed. A job cancelled,
-- failed or deleted meanwhile is left as it is (never recreated); one already running still gets
-- the rules. As transition.lua, the move keeps its token in the hash: the same call sent again
-- (its reply was lost) finds its own token and answers as the first time. Returns 2 if the job
-- completed, 1 if it moved (or had moved by this token), else 0.
--
-- KEYS[1]  job_key          the job's hash
-- KEYS[2]  fence            its ingest fence
-- KEYS[3]  running          its running set
-- ARGV[1]  token            this call's token
-- ARGV[2]  now_ms           now (ms)
-- ARGV[3]  ingesting_state  the state it moves from
-- ARGV[4]  running_state    the state it moves to (a job whose prompts run)
-- ARGV[5]  completed_state  the state a job moves to when its last prompt ends

-- One read for both steps: what `complete_read` reads, then the last move's token.
local v = redis.call('HMGET', job_key, 'state', 'done', 'failed', 'cancelled', 'accepted',
  'output_tokens', 'completed_before', 'transition')
if not v[1] then return 0 end
local moved = v[1] == running_state and v[8] == token
if v[1] == ingesting_state then
  redis.call('HSET', job_key, 'state', running_state, 'transition', token)
  redis.call('DEL', fence)
  v[1] = running_state
  moved = true
end
if complete_read({key = job_key, running = running}, v, running_state, completed_state, now_ms) then
  return 2
end
if moved then return 1 end
return 0
