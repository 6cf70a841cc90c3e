-- Hands a job's ingestion to a new run: if the ingest fence admits the incarnation (the job is
-- ingesting it, by whichever run), it admits only the new run's token from now on, so that an
-- ingestion still running elsewhere lands no chunk more. Returns the fence's new value, or false
-- when the job is not ingesting that incarnation (cancelled, failed, deleted, or another one).
--
-- KEYS[1]  fence        the job's ingest fence
-- ARGV[1]  incarnation  the incarnation the new run ingests
-- ARGV[2]  token        the new run's token

local held = redis.call('GET', fence)
if not held or incarnation == '' then return false end
if held ~= incarnation and string.sub(held, 1, #incarnation + 1) ~= incarnation .. '/' then return false end
local value = incarnation .. '/' .. token
redis.call('SET', fence, value)
return value
