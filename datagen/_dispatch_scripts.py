"""The Lua behind `datagen.dispatch.Dispatch.claim_many`: one call hands a worker up to N prompts of
one class and starts them in RQ's own terms, so the per-prompt control-plane cost is two commands
(read the RQ job, mark it started) plus a few per call (see docs/architecture.md, "Control plane")."""

from __future__ import annotations

__all__ = ["CLAIM_MANY"]

# KEYS: 1 RQ's queue list of the class, 2 paused jobs, 3-5 the class's dispatch sets by priority
# (high, normal, low), 6 the current window bucket, 7 the class's RQ started registry, 8 the epoch.
# ARGV: 1 job key prefix, 2 backlog suffix, 3 window bucket TTL, 4 scan limit, 5 RQ id prefix
# (``{ns}-``; the job id follows it up to the next ``-``), 6 RQ job key prefix (``rq:job:``),
# 7 how many prompts at most, 8 started-registry score (the heartbeat's expiry), 9 now in RQ's
# time format, 10 the worker's RQ name, 11 the execution id, 12 the running set suffix, 13 the
# worker's epoch floor (`datagen.epoch`): an epoch ``seq`` below it is a Redis restored from an
# older snapshot, whose backlogs hold prompts already done; nothing is handed out until the
# coordinator has rebuilt the jobs from storage and stamped a new ``seq``; from 14, job ids this
# worker passes over as if paused (too many of their records wait for a commit here).
#
# Order: RQ's own list first (prompts handed back by a stopping worker or requeued by the reaper;
# a paused job's go to the front of its backlog instead), then the backlogs by priority and, within
# a priority, by stride scheduling: each prompt goes to the job with the lowest virtual time
# (dispatches / weight; ties to the lexically first id, as ZRANGE orders them), which then advances
# by 1 / weight. Simulated here over the first N unpaused jobs with work (a job further back can
# get a prompt only after each of those got one), then applied with one LPOP and one ZINCRBY per
# job: the same order as N single claims, at a fraction of the commands.
#
# Each prompt is started as RQ's ``prepare_job_execution`` would (status, worker, started_at,
# heartbeat; a started-registry member ``<id>:<execution>`` scored by the heartbeat's expiry) and
# added to its job's running set, in this one atomic step: a worker killed after the script is
# reaped like one killed mid-generation. A prompt whose RQ job is gone (its job was cancelled or
# deleted meanwhile) is dropped. Returns {id, HGETALL of its RQ job as it was queued} per prompt.
CLAIM_MANY = """
if tonumber(redis.call('HGET', KEYS[8], 'seq') or '0') < tonumber(ARGV[13]) then return {} end
local want = tonumber(ARGV[7])
local paused = {}
for _, job in ipairs(redis.call('SMEMBERS', KEYS[2])) do paused[job] = true end
for i = 14, #ARGV do paused[ARGV[i]] = true end
local sets = {high = 3, normal = 4, low = 5}
local function job_of(id)
  local rest = string.sub(id, #ARGV[5] + 1)
  local dash = string.find(rest, '-', 1, true)
  return dash and string.sub(rest, 1, dash - 1) or ''
end
local function rejoin(z, job)
  if not redis.call('ZSCORE', z, job) then
    local first = redis.call('ZRANGE', z, 0, 0, 'WITHSCORES')
    redis.call('ZADD', z, first[2] or 0, job)
  end
end
local ids = {}
for _ = 1, tonumber(ARGV[4]) do
  if #ids >= want then break end
  local id = redis.call('LPOP', KEYS[1])
  if not id then break end
  local job = job_of(id)
  if job ~= '' and paused[job] then
    redis.call('LPUSH', ARGV[1] .. job .. ARGV[2], id)
    rejoin(KEYS[sets[redis.call('HGET', ARGV[1] .. job, 'priority') or 'normal'] or 4], job)
  else
    ids[#ids + 1] = id
  end
end
local dispatched = {}
for z = 3, 5 do
  while #ids < want do
    local need = want - #ids
    local entries = redis.call('ZRANGE', KEYS[z], 0, tonumber(ARGV[4]) - 1, 'WITHSCORES')
    local jobs = {}
    for i = 1, #entries, 2 do
      if #jobs >= need then break end
      local job = entries[i]
      if not paused[job] then
        local jobkey = ARGV[1] .. job
        local left = redis.call('LLEN', jobkey .. ARGV[2])
        if left == 0 then
          redis.call('ZREM', KEYS[z], job)
        else
          local weight = tonumber(redis.call('HGET', jobkey, 'weight') or '1') or 1
          if weight <= 0 then weight = 1 end
          jobs[#jobs + 1] = {job = job, vt = tonumber(entries[i + 1]), w = weight, left = left, take = 0}
        end
      end
    end
    if #jobs == 0 then break end
    for _ = 1, need do
      local best = nil
      for _, j in ipairs(jobs) do
        if j.left > j.take and (best == nil or j.vt < best.vt or (j.vt == best.vt and j.job < best.job)) then
          best = j
        end
      end
      if best == nil then break end
      best.take = best.take + 1
      best.vt = best.vt + 1 / best.w
    end
    for _, j in ipairs(jobs) do
      if j.take > 0 then
        local jobkey = ARGV[1] .. j.job
        local popped = redis.call('LPOP', jobkey .. ARGV[2], j.take)
        if popped then
          for _, id in ipairs(popped) do ids[#ids + 1] = id end
          redis.call('ZINCRBY', KEYS[z], #popped / j.w, j.job)
          redis.call('HINCRBY', jobkey, 'dispatched', #popped)
          dispatched[j.job] = (dispatched[j.job] or 0) + #popped
        end
      end
    end
  end
end
local any = false
for job, n in pairs(dispatched) do
  redis.call('HINCRBY', KEYS[6], job, n)
  any = true
end
if any then redis.call('EXPIRE', KEYS[6], ARGV[3]) end
local out = {}
local members = {}
local running = {}
for _, id in ipairs(ids) do
  local jobkey = ARGV[6] .. id
  local fields = redis.call('HGETALL', jobkey)
  if #fields > 0 then
    redis.call('HSET', jobkey, 'status', 'started', 'started_at', ARGV[9], 'last_heartbeat', ARGV[9],
      'worker_name', ARGV[10])
    members[#members + 1] = ARGV[8]
    members[#members + 1] = id .. ':' .. ARGV[11]
    local job = job_of(id)
    if job ~= '' then
      running[job] = running[job] or {}
      table.insert(running[job], id)
    end
    out[#out + 1] = {id, fields}
  end
end
if #members > 0 then redis.call('ZADD', KEYS[7], unpack(members)) end
for job, started in pairs(running) do
  redis.call('SADD', ARGV[1] .. job .. ARGV[12], unpack(started))
end
return out
"""
