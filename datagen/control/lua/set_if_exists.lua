-- Sets a field of a hash only if the hash exists (never creates it). Returns HSET's answer, or 0.
--
-- KEYS[1]  hash_key    the hash
-- ARGV[1]  field_name  the field
-- ARGV[2]  value       its value

if redis.call('EXISTS', hash_key) == 0 then return 0 end
return redis.call('HSET', hash_key, field_name, value)
