-- Claims a started-registry member whose heartbeat lapsed: removes it only if its heartbeat is
-- still lapsed at the cutoff. Returns its score (the expiry) if removed, else false (renewed,
-- finished, or taken by another reaper).
--
-- KEYS[1]  started  an RQ started registry
-- ARGV[1]  member   the member (`<rq id>:<execution id>`)
-- ARGV[2]  cutoff: number  the cutoff (epoch s)

local score = redis.call('ZSCORE', started, member)
if not score or tonumber(score) > cutoff then return false end
redis.call('ZREM', started, member)
return score
