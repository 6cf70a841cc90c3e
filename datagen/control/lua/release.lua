-- Releases a lock only if this holder still has it. Returns 1 if it did.
--
-- KEYS[1]  lock   the lock
-- ARGV[1]  token  the holder's token

if redis.call('GET', lock) == token then return redis.call('DEL', lock) end
return 0
