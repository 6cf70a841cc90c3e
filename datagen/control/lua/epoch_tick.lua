-- Moves Redis's epoch counter forward by one, only while the epoch is the caller's: the id it
-- knows, and a counter not below its floor (its own last tick). A Redis that lost its data or went
-- back to an older snapshot is left as it is, for the caller's next look to see. Returns
-- {id ('' for none), seq, 1 if it moved else 0}.
--
-- KEYS[1]  epoch        the epoch hash
-- ARGV[1]  expected_id  the id the caller knows
-- ARGV[2]  floor: number  the caller's floor

local id = redis.call('HGET', epoch, 'id')
local seq = tonumber(redis.call('HGET', epoch, 'seq') or '0')
if id ~= expected_id or seq < floor then return {id or '', seq, 0} end
return {id, redis.call('HINCRBY', epoch, 'seq', 1), 1}
