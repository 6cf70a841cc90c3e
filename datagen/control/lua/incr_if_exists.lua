-- Adds to an integer field of a hash only if the hash exists (never creates it), never below 0.
-- Returns the field's new value, or -1 when the hash does not exist.
--
-- KEYS[1]  hash_key    the hash
-- ARGV[1]  field_name  the field
-- ARGV[2]  delta       what to add (negative to subtract)

if redis.call('EXISTS', hash_key) == 0 then return -1 end
local value = redis.call('HINCRBY', hash_key, field_name, delta)
if value < 0 then
    redis.call('HSET', hash_key, field_name, 0)
    return 0
end
return value
