"""The Lua behind `datagen.control.jobs.JobStore.ack_done`: the prompts of a committed shard finish in RQ
and count in their jobs in one script call, instead of one RQ transaction and one count script per
prompt. The counting rules are COUNT_AND_MAYBE_COMPLETE's (`datagen.control._job_scripts`), per job."""

from __future__ import annotations

__all__ = ["ACK_DONE"]

# KEYS: 1 the class's RQ started registry, 2 its finished registry.
# ARGV: 1 RQ job key prefix, 2 job key prefix, 3 running-set suffix, 4 breakdown suffix, 5 partitions
# suffix, 6 now (ms), 7 now in RQ's time format, 8 now (epoch s), 9 the execution id, 10 and 11
# the running and completed states; from 12, per prompt: RQ id, job id, the prompt's job
# incarnation ("" for none), output tokens, partition label, class, finish type, result TTL (s).
#
# Per prompt, as RQ's handle_job_success: the started-registry member goes, the RQ job is
# ``finished`` with its ``ended_at`` and expires after its result TTL, and it joins the finished
# registry scored by that expiry; only for a prompt this call counts: a prompt no longer running
# (counted already, or back in its backlog in a job rebuilt from storage, `service.rebuild`) keeps
# its RQ job as it is, so a stale ack never finishes or expires a copy that waits to run.
# Not written: RQ's Result stream entries and the worker's success counters (nothing reads them,
# and each would cost a command per prompt).
# Per job, as COUNT_AND_MAYBE_COMPLETE: only prompts still in the job's running set count (a prompt
# finished twice, by a stalled worker and its rescuer, counts once), prompts of another incarnation
# of the job (deleted meanwhile, its id reused) neither count nor touch RQ's hashes, counters and
# the breakdown move together, ``first_record_at_ms`` is set by the count that moves ``done`` from 0, and
# ``tail_from_ms`` once a running job has ended 95 % of its prompts; the job completes when all
# have ended. Returns how many prompts were counted.
ACK_DONE = """
local groups, order, members = {}, {}, {}
for i = 12, #ARGV, 8 do
  members[#members + 1] = ARGV[i] .. ':' .. ARGV[9]
  local job = ARGV[i + 1]
  if not groups[job] then
    groups[job] = {}
    order[#order + 1] = job
  end
  table.insert(groups[job], i)
end
if #members == 0 then return 0 end
redis.call('ZREM', KEYS[1], unpack(members))
local finished = {}
local counted = 0
for _, job in ipairs(order) do
  local key = ARGV[2] .. job
  local incarnation = redis.call('HGET', key, 'incarnation')
  if not incarnation and redis.call('EXISTS', key) == 1 then incarnation = '' end
  local mine = {}
  if incarnation then
    for _, i in ipairs(groups[job]) do
      if ARGV[i + 2] == '' or ARGV[i + 2] == incarnation then mine[#mine + 1] = i end
    end
  end
  if #mine > 0 then
    local ids = {}
    for n, i in ipairs(mine) do ids[n] = ARGV[i] end
    local running = key .. ARGV[3]
    local was_running = redis.call('SMISMEMBER', running, unpack(ids))
    redis.call('SREM', running, unpack(ids))
    local done, tokens, fields, labelled = 0, 0, {}, {}
    for n, i in ipairs(mine) do
      if was_running[n] == 1 then
        local rqkey = ARGV[1] .. ARGV[i]
        local ttl = tonumber(ARGV[i + 7])
        if ttl == 0 then
          redis.call('UNLINK', rqkey)
        else
          redis.call('HSET', rqkey, 'status', 'finished', 'ended_at', ARGV[7])
          if ttl > 0 then
            redis.call('EXPIRE', rqkey, ttl)
            finished[#finished + 1] = tonumber(ARGV[8]) + ttl
          else
            redis.call('PERSIST', rqkey)
            finished[#finished + 1] = '+inf'
          end
          finished[#finished + 1] = ARGV[i]
        end
        done = done + 1
        local out = tonumber(ARGV[i + 3])
        tokens = tokens + out
        local label = ARGV[i + 4]
        if labelled[label] == nil then
          labelled[label] = redis.call('SISMEMBER', key .. ARGV[5], label) == 1
        end
        if not labelled[label] then label = 'other' end
        local suffix = '|' .. label .. '|' .. ARGV[i + 5]
        fields['done' .. suffix] = (fields['done' .. suffix] or 0) + 1
        if out ~= 0 then
          fields['output_tokens' .. suffix] = (fields['output_tokens' .. suffix] or 0) + out
        end
        if ARGV[i + 6] ~= '' then
          local f = 'finish:' .. ARGV[i + 6] .. suffix
          fields[f] = (fields[f] or 0) + 1
        end
      end
    end
    if done > 0 then
      counted = counted + done
      if redis.call('HINCRBY', key, 'done', done) == done then
        redis.call('HSETNX', key, 'first_record_at_ms', ARGV[6])
      end
      if tokens ~= 0 then redis.call('HINCRBY', key, 'output_tokens', tokens) end
      for field, n in pairs(fields) do redis.call('HINCRBY', key .. ARGV[4], field, n) end
      local v = redis.call('HMGET', key, 'state', 'done', 'failed', 'cancelled', 'accepted')
      if v[1] == ARGV[10] then
        local ended = tonumber(v[2] or '0') + tonumber(v[3] or '0') + tonumber(v[4] or '0')
        local accepted = tonumber(v[5] or '0')
        if 20 * ended >= 19 * accepted then redis.call('HSETNX', key, 'tail_from_ms', ARGV[6]) end
        if ended >= accepted then
          redis.call('HSET', key, 'state', ARGV[11], 'finished_at_ms', ARGV[6])
          redis.call('DEL', running)
        end
      end
    end
  end
end
if #finished > 0 then redis.call('ZADD', KEYS[2], unpack(finished)) end
return counted
"""
