"""The Lua behind `datagen.control.dispatch.Dispatch.claim_many`: one call hands a worker up to N prompts of
one class and starts them in RQ's own terms, so the per-prompt control-plane cost is two commands
(read the RQ job, mark it started) plus a few per call (see docs/architecture.md, "Control plane")."""

from __future__ import annotations

__all__ = ["CLAIM_MANY", "PAUSE", "REJOIN", "RESUME"]

# The one rule for a job with prompts to dispatch joining a dispatch set (enqueued, retried, handed
# back, resumed): at the set's lowest virtual time, so it gets its share from then on without a
# catch-up burst (and a resumed job none below the jobs beside it), unless it is in the set
# already. A paused job is in no set, so that no claim ever scans it: it joins on resume.
REJOIN = """
local function rejoin(set, paused, job)
  if redis.call('SISMEMBER', paused, job) == 1 or redis.call('ZSCORE', set, job) then return end
  local first = redis.call('ZRANGE', set, 0, 0, 'WITHSCORES')
  redis.call('ZADD', set, first[2] or 0, job)
end
"""

# KEYS: 1 the paused jobs, then every dispatch set (each class and priority). ARGV: 1 job id.
# The job leaves the sets with its pause, so claims never look at it again until it is resumed.
PAUSE = """
redis.call('SADD', KEYS[1], ARGV[1])
for i = 2, #KEYS do redis.call('ZREM', KEYS[i], ARGV[1]) end
return 1
"""

# KEYS: 1 the paused jobs, then per class its backlog of the job and the dispatch set of the class
# at the job's priority. ARGV: 1 job id. Each class with prompts left rejoins its set.
RESUME = (
    REJOIN
    + """
redis.call('SREM', KEYS[1], ARGV[1])
for i = 2, #KEYS, 2 do
  if redis.call('LLEN', KEYS[i]) > 0 then rejoin(KEYS[i + 1], KEYS[1], ARGV[1]) end
end
return 1
"""
)

# KEYS: 1 RQ's queue list of the class, 2 paused jobs, 3-5 the class's dispatch sets by priority
# (high, normal, low), 6 the current window bucket, 7 the class's RQ started registry, 8 the epoch.
# ARGV: 1 job key prefix, 2 backlog suffix, 3 window bucket TTL, 4 how many of RQ's list a claim
# looks at, at most, 5 RQ id prefix (``{ns}-``; the job id follows it up to the next ``-``), 6 RQ
# job key prefix (``rq:job:``), 7 how many prompts at most, 8 started-registry score (the
# heartbeat's expiry), 9 now in RQ's time format, 10 the worker's RQ name, 11 the execution id,
# 12 the running set suffix, 13 the worker's epoch floor (`datagen.control.epoch`): an epoch ``seq`` below
# it is a Redis restored from an older snapshot, whose backlogs hold prompts already done; nothing
# is handed out until the coordinator has rebuilt the jobs from storage and stamped a new ``seq``;
# from 14, job ids this worker passes over (too many of their records wait for a commit here).
#
# Order: RQ's own list first (prompts handed back by a stopping worker or requeued by the reaper;
# a paused or passed-over job's go to the front of its backlog instead), then the backlogs by
# priority and, within a priority, by stride scheduling: each prompt goes to the job with the
# lowest virtual time (dispatches / weight; ties to the lexically first id, as ZRANGE orders them),
# which then advances by 1 / weight. Paused jobs are in no set (`PAUSE`), so the jobs looked at are
# the first N with work in score order (N: prompts wanted, plus those passed over), read a page at
# a time: a claim costs O(log jobs + N), however many jobs wait or are paused. The N single claims
# are simulated with a heap over those jobs, then applied with one LPOP and one ZINCRBY per job:
# the same order as N single claims, at a fraction of the commands.
#
# Each prompt is started as RQ's ``prepare_job_execution`` would (status, worker, started_at,
# heartbeat; a started-registry member ``<id>:<execution>`` scored by the heartbeat's expiry) and
# added to its job's running set, in this one atomic step: a worker killed after the script is
# reaped like one killed mid-generation. A prompt whose RQ job is gone (its job was cancelled or
# deleted meanwhile) is dropped. Returns {id, HGETALL of its RQ job as it was queued} per prompt.
CLAIM_MANY = (
    REJOIN
    + """
if tonumber(redis.call('HGET', KEYS[8], 'seq') or '0') < tonumber(ARGV[13]) then return {} end
local want = tonumber(ARGV[7])
local skip = {}
local nskip = 0
for i = 14, #ARGV do
  skip[ARGV[i]] = true
  nskip = nskip + 1
end
local sets = {high = 3, normal = 4, low = 5}
local function job_of(id)
  local rest = string.sub(id, #ARGV[5] + 1)
  local dash = string.find(rest, '-', 1, true)
  return dash and string.sub(rest, 1, dash - 1) or ''
end
local ids = {}
for _ = 1, tonumber(ARGV[4]) do
  if #ids >= want then break end
  local id = redis.call('LPOP', KEYS[1])
  if not id then break end
  local job = job_of(id)
  if job ~= '' and (skip[job] or redis.call('SISMEMBER', KEYS[2], job) == 1) then
    redis.call('LPUSH', ARGV[1] .. job .. ARGV[2], id)
    rejoin(KEYS[sets[redis.call('HGET', ARGV[1] .. job, 'priority') or 'normal'] or 4], KEYS[2], job)
  else
    ids[#ids + 1] = id
  end
end
local function before(a, b)
  return a.vt < b.vt or (a.vt == b.vt and a.job < b.job)
end
local function push(heap, item)
  heap[#heap + 1] = item
  local i = #heap
  while i > 1 do
    local parent = math.floor(i / 2)
    if not before(heap[i], heap[parent]) then break end
    heap[i], heap[parent] = heap[parent], heap[i]
    i = parent
  end
end
local function pop(heap)
  local top = heap[1]
  heap[1] = heap[#heap]
  heap[#heap] = nil
  local i = 1
  while true do
    local l, r, m = 2 * i, 2 * i + 1, i
    if l <= #heap and before(heap[l], heap[m]) then m = l end
    if r <= #heap and before(heap[r], heap[m]) then m = r end
    if m == i then break end
    heap[i], heap[m] = heap[m], heap[i]
    i = m
  end
  return top
end
local dispatched = {}
for z = 3, 5 do
  while #ids < want do
    local need = want - #ids
    local jobs = {}
    local page = need + nskip
    local offset = 0
    while #jobs < need do
      local entries = redis.call('ZRANGE', KEYS[z], offset, offset + page - 1, 'WITHSCORES')
      local removed = 0
      for i = 1, #entries, 2 do
        if #jobs >= need then break end
        local job = entries[i]
        if not skip[job] then
          local jobkey = ARGV[1] .. job
          local left = redis.call('LLEN', jobkey .. ARGV[2])
          if left == 0 then
            redis.call('ZREM', KEYS[z], job)
            removed = removed + 1
          else
            local weight = tonumber(redis.call('HGET', jobkey, 'weight') or '1') or 1
            if weight <= 0 then weight = 1 end
            jobs[#jobs + 1] = {job = job, vt = tonumber(entries[i + 1]), w = weight, left = left, take = 0}
          end
        end
      end
      if #entries < 2 * page then break end
      offset = offset + page - removed
    end
    if #jobs == 0 then break end
    local heap = {}
    for _, j in ipairs(jobs) do push(heap, j) end
    for _ = 1, need do
      if #heap == 0 then break end
      local best = pop(heap)
      best.take = best.take + 1
      best.vt = best.vt + 1 / best.w
      if best.left > best.take then push(heap, best) end
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
)
