-- Gives a lease back, only if this holder still has it: deleted, or (done_ms > 0) left as a done
-- marker, 'done:' and the token, for done_ms (whoever comes for it meanwhile learns that this work
-- has just been done). Returns 1 if it was this holder's.
--
-- KEYS[1]  lease    the lease
-- ARGV[1]  token    the holder's token
-- ARGV[2]  done_ms: number  how long the done marker stays (0: none)

if redis.call('GET', lease) ~= token then return 0 end
if done_ms > 0 then
  redis.call('SET', lease, 'done:' .. token, 'PX', done_ms)
else
  redis.call('DEL', lease)
end
return 1
