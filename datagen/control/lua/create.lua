-- Creates a whole job at once. Returns {1, incarnation, created_at_ms} if the job now has this
-- incarnation (made by this call, or by the same call sent again after its reply was lost), {0,
-- its incarnation ('' for a job made before incarnations), its created_at_ms} if another job of
-- the id exists (a resubmission appends to it, and its caller needs to read neither again). A
-- hash without a state (half made by an older version, whose create was two commands) is made
-- whole, never left as an id that refuses every submit. Mode "replace" (a job rebuilt from
-- storage) makes it anew whatever is there, in one step, so that readers never see the job
-- missing meanwhile; given a lease token (the rebuild's), it writes nothing and returns {-1}
-- unless the job's rebuild lease still holds that token (a rebuilder that lost its lease is fenced
-- off). The ingest fence is a field of the hash (`ingest_fence`), written with it; a rebuild also
-- drops the fence key of a job an older version made, so that an ingestion that version still runs
-- lands nothing more in the job made anew.
--
-- KEYS[1]   job_key        the job's hash
-- KEYS[2]   index          the jobs index (job ids scored by creation time)
-- KEYS[3]   legacy_fence   the job's ingest fence key of older versions
-- KEYS[4]   lease          the job's rebuild lease
-- ARGV[1]   job_id         the job id
-- ARGV[2]   created_at_ms  when it was created (ms)
-- ARGV[3]   incarnation    its new incarnation
-- ARGV[4]   fence_value    the fence's value ('' for none)
-- ARGV[5]   mode           'replace', or '' to create only if no job of the id exists
-- ARGV[6]   lease_token    the rebuild's lease token ('' for none: no lease is checked)
-- ARGV[7..] fields         field, value, field, value, ... of the job's hash

if lease_token ~= '' and redis.call('GET', lease) ~= lease_token then return {-1} end
-- A new id (most creates) costs one read here and nothing to clear.
if redis.call('EXISTS', job_key) == 1 then
  local found = redis.call('HMGET', job_key, 'state', 'incarnation', 'created_at_ms')
  if found[1] and mode ~= 'replace' then
    local made = 0
    if found[2] == incarnation then made = 1 end
    return {made, found[2] or '', found[3] or '0'}
  end
  redis.call('DEL', job_key)
end
if mode == 'replace' then redis.call('DEL', legacy_fence) end
-- One HSET for the whole hash, its fence included (a small job's creation is a few commands, not
-- one per field).
local values = {'created_at_ms', created_at_ms, 'incarnation', incarnation}
if fence_value ~= '' then values[5], values[6] = 'ingest_fence', fence_value end
for _, value in ipairs(fields) do values[#values + 1] = value end
redis.call('HSET', job_key, unpack(values))
redis.call('ZADD', index, created_at_ms, job_id)
return {1, incarnation, created_at_ms}
