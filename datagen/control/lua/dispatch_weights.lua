--! uses lib
-- Recomputes each dispatch set's weight sum (`<set>:weight`, see `weight_units` in lib.lua) from
-- its members, and marks the sums as kept: for a Redis whose sets were filled before the scripts
-- kept sums (O(jobs in the sets), once; `Dispatch.page_shares` calls it while the mark is absent).
-- Returns 1.
--
-- KEYS[1]   mark        the mark that the sums are kept
-- KEYS[2..] sets        every dispatch set (each class and priority)
-- ARGV[1]   job_prefix  job key prefix (the job id follows)

for _, set in ipairs(sets) do
  local sum = 0
  for _, job in ipairs(redis.call('ZRANGE', set, 0, -1)) do
    sum = sum + weight_units(redis.call('HGET', job_prefix .. job, 'weight'))
  end
  redis.call('SET', set .. ':weight', string.format('%d', sum))
end
redis.call('SET', mark, '1')
return 1
