-- Creates a whole job at once. Returns 1 if the job now has this incarnation (made by this call,
-- or by the same call sent again after its reply was lost), 0 if another job of the id exists. A
-- hash without a state (half made by an older version, whose create was two commands) is made
-- whole, never left as an id that refuses every submit. Mode "replace" (a job rebuilt from
-- storage) makes it anew whatever is there, in one step, so that readers never see the job
-- missing meanwhile; given a lease token (the rebuild's), it writes nothing and returns -1 unless
-- the job's rebuild lease still holds that token (a rebuilder that lost its lease is fenced off).
--
-- KEYS[1]   job_key        the job's hash
-- KEYS[2]   index          the jobs index (job ids scored by creation time)
-- KEYS[3]   fence          the job's ingest fence
-- KEYS[4]   lease          the job's rebuild lease
-- ARGV[1]   job_id         the job id
-- ARGV[2]   created_at_ms  when it was created (ms)
-- ARGV[3]   incarnation    its new incarnation
-- ARGV[4]   fence_value    the fence's value ('' for none)
-- ARGV[5]   mode           'replace', or '' to create only if no job of the id exists
-- ARGV[6]   lease_token    the rebuild's lease token ('' for none: no lease is checked)
-- ARGV[7..] fields         field, value, field, value, ... of the job's hash

if lease_token ~= '' and redis.call('GET', lease) ~= lease_token then return -1 end
local state = redis.call('HGET', job_key, 'state')
if state and mode ~= 'replace' then
  if redis.call('HGET', job_key, 'incarnation') == incarnation then return 1 end
  return 0
end
redis.call('DEL', job_key)
-- One HSET for the whole hash (a small job's creation is a few commands, not one per field).
redis.call('HSET', job_key, 'created_at_ms', created_at_ms, 'incarnation', incarnation, unpack(fields))
redis.call('ZADD', index, created_at_ms, job_id)
if fence_value ~= '' then redis.call('SET', fence, fence_value) end
return 1
