-- Drops the failure reports of prompts that were retried. One script, because workers append
-- reports all the while. Returns how many reports are kept.
--
-- KEYS[1]   reports  the job's failure reports
-- ARGV[1..] rq_ids   the RQ ids whose reports go
local reports = KEYS[1]
local rq_ids = {}
for i = 1, #ARGV do rq_ids[ARGV[i]] = true end

local kept = {}
for _, raw in ipairs(redis.call('LRANGE', reports, 0, -1)) do
  local ok, report = pcall(cjson.decode, raw)
  if not (ok and type(report) == 'table' and rq_ids[report['rq_id']]) then kept[#kept + 1] = raw end
end
redis.call('DEL', reports)
for i = 1, #kept, 1000 do redis.call('RPUSH', reports, unpack(kept, i, math.min(i + 999, #kept))) end
return #kept
