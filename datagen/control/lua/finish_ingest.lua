--! uses lib
-- Ends a job's ingestion in one step: an ingesting job moves to `running_state` (its ingest fence
-- goes: ingestion enqueues nothing more), and the tail and completion rules apply at once, so a job
-- with nothing left to run is never seen running before it is seen completed. A job cancelled,
-- failed or deleted meanwhile is left as it is (never recreated); one already running still gets
-- the rules. As transition.lua, the move keeps its token in the hash: the same call sent again
-- (its reply was lost) finds its own token and answers as the first time. Returns 2 if the job
-- completed, 1 if it moved (or had moved by this token), else 0.
--
-- KEYS[1]  job_key          the job's hash (its ingest fence is its `ingest_fence`)
-- KEYS[2]  running          its running set
-- ARGV[1]  token            this call's token
-- ARGV[2]  now_ms           now (ms)
-- ARGV[3]  ingesting_state  the state it moves from
-- ARGV[4]  running_state    the state it moves to (a job whose prompts run)
-- ARGV[5]  completed_state  the state a job moves to when its last prompt ends

-- One read for both steps: what the counting rules read, and the last move's token.
local job = {key = job_key, running = running}
local fields = job_read(job, {'transition'})
if not fields.state then return 0 end
local moved = fields.state == running_state and fields.transition == token
if fields.state == ingesting_state then
  job_set(fields, 'state', running_state)
  job_set(fields, 'transition', token)
  job_set(fields, 'ingest_fence', '')
  moved = true
end
if count_and_complete(job, fields, 'done', 0, 0, {}, now_ms, running_state, completed_state) then
  return 2
end
if moved then return 1 end
return 0
