-- Settles Redis's epoch after a coordinator reconciled it with storage: an id if it has none (a
-- new one, never the old one back), the counter lifted by the jump over both its value and the
-- caller's floor (above every floor a process may hold, so that nobody takes the change for
-- another), and `rebuilt` set when the caller held every stored job to a Redis that lost or
-- rolled back its data. Returns {id, seq}.
--
-- KEYS[1]  epoch    the epoch hash
-- ARGV[1]  new_id   the id to write if the epoch has none
-- ARGV[2]  floor: number  the caller's floor
-- ARGV[3]  jump: number  how far past the higher of the two the counter goes
-- ARGV[4]  rebuilt  '1' when the caller rebuilt what Redis lost, else ''

local id = redis.call('HGET', epoch, 'id')
local seq = tonumber(redis.call('HGET', epoch, 'seq') or '0')
if not id then
  id = new_id
  redis.call('HSET', epoch, 'id', id, 'rebuilt', rebuilt)
elseif rebuilt ~= '' then
  redis.call('HSET', epoch, 'rebuilt', rebuilt)
end
return {id, redis.call('HINCRBY', epoch, 'seq', math.max(seq, floor) - seq + jump)}
