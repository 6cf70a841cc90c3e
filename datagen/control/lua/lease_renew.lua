-- Renews a lease only if this holder still has it. Returns 1 if it did.
--
-- KEYS[1]  lease   the lease
-- ARGV[1]  token   the holder's token
-- ARGV[2]  ttl_ms  its new time to live (ms)

if redis.call('GET', lease) == token then return redis.call('PEXPIRE', lease, ttl_ms) end
return 0
