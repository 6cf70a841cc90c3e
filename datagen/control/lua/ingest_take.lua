-- Hands a job's ingestion to a new run: if the ingest fence admits the incarnation (the job is
-- ingesting it, by whichever run), it admits only the new run's token from now on, so that an
-- ingestion still running elsewhere lands no chunk more. Returns the fence's new value, or false
-- when the job is not ingesting that incarnation (cancelled, failed, deleted, or another one).
-- The fence is the hash's `ingest_fence` ('' or absent: none); a job an older version made holds
-- it in a key of its own, which moves into the hash here (the run that takes it over is the one a
-- coordinator resumes), so that the older version's run still going is fenced off too.
--
-- KEYS[1]  job_key       the job's hash
-- KEYS[2]  legacy_fence  its ingest fence key of older versions
-- ARGV[1]  incarnation   the incarnation the new run ingests
-- ARGV[2]  token         the new run's token

local held = redis.call('HGET', job_key, 'ingest_fence')
local legacy = false
if not held or held == '' then
  held = redis.call('GET', legacy_fence)
  legacy = held and true
end
if not held or incarnation == '' then return false end
-- A fence key left of a job that is gone is no job to take (its hash is not made again).
if legacy and redis.call('HEXISTS', job_key, 'state') == 0 then return false end
if held ~= incarnation and string.sub(held, 1, #incarnation + 1) ~= incarnation .. '/' then return false end
local value = incarnation .. '/' .. token
redis.call('HSET', job_key, 'ingest_fence', value)
if legacy then redis.call('DEL', legacy_fence) end
return value
