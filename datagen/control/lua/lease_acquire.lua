-- Takes a lease if it is free (or, asked to, if it holds a done marker: work just done, which
-- the caller looked at). Returns {1, token} if taken, else {0, what holds it now}.
--
-- KEYS[1]  lease      the lease
-- ARGV[1]  token      the new holder's token
-- ARGV[2]  ttl_ms     its time to live (ms)
-- ARGV[3]  over_done  1: a done marker counts as free

local held = redis.call('GET', lease)
if held and not (over_done == '1' and string.sub(held, 1, 5) == 'done:') then return {0, held} end
redis.call('SET', lease, token, 'PX', ttl_ms)
return {1, token}
