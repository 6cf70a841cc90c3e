-- Drops the failure reports of prompts that were retried. One script, because workers append
-- reports all the while. Returns how many reports are kept.
--
-- KEYS[1]   reports  the job's failure reports
-- ARGV[1..] rq_ids   the RQ ids whose reports go

local going = {}
for _, rq_id in ipairs(rq_ids) do going[rq_id] = true end
local kept = {}
for _, raw in ipairs(redis.call('LRANGE', reports, 0, -1)) do
  local ok, report = pcall(cjson.decode, raw)
  if not (ok and type(report) == 'table' and going[report['rq_id']]) then kept[#kept + 1] = raw end
end
redis.call('DEL', reports)
for i = 1, #kept, 1000 do redis.call('RPUSH', reports, unpack(kept, i, math.min(i + 999, #kept))) end
return #kept
