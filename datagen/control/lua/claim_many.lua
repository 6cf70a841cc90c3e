--! uses lib
-- Hands a worker up to N prompts of one class and starts them in RQ's own terms
-- (`Dispatch.claim_many`), so the per-prompt control-plane cost is two commands (read the RQ job,
-- mark it started) plus a few per call (see docs/architecture.md, "Control plane").
--
-- Order: RQ's own list first (prompts handed back by a stopping worker or requeued by the reaper;
-- a paused or passed-over job's go to the front of its backlog instead), then the backlogs by
-- priority and, within a priority, by stride scheduling: each prompt goes to the job with the
-- lowest virtual time (dispatches / weight; ties to the lexically first id, as ZRANGE orders them),
-- which then advances by 1 / weight. Paused jobs are in no set (pause.lua), so the jobs looked at
-- are at most the first N with work in score order (N: prompts wanted, plus those passed over;
-- fewer where jobs with their tail left cover what is wanted, below), read a page at a time: a
-- claim costs O(log jobs + N), however many jobs wait or are paused. The N single
-- claims are simulated with a heap over those jobs, then applied with one LPOP and one ZINCRBY per
-- job (a job whose backlog it empties leaves the set instead, and the set's weight sum with it):
-- the same order as N single claims, at a fraction of the commands, but for a job's tail: a job
-- picked with `tail` prompts left or fewer gets them all at once (as many as are still wanted),
-- its virtual time moved by each, so that a small job's prompts share one claim, shard and ack.
--
-- Each prompt is started as RQ's `prepare_job_execution` would (status, worker, started_at,
-- heartbeat; a started-registry member `<id>:<execution>` scored by the heartbeat's expiry) and
-- added to its job's running set, in this one atomic step: a worker killed after the script is
-- reaped like one killed mid-generation. A prompt whose RQ job is gone (its job was cancelled or
-- deleted meanwhile) is dropped. Nothing is handed out while Redis's epoch is below the worker's
-- floor (`datagen.control.epoch`): that is a Redis restored from an older snapshot, whose backlogs
-- hold prompts already done, until the coordinator has rebuilt the jobs from storage and stamped a
-- new `seq`. Returns {prompts, facts}: prompts {id, HGETALL of its RQ job as it was queued} per
-- prompt; facts, per job it hands prompts of from a backlog that is not in `known`, what a worker
-- reads of it once (its id, spec, tokenizer identity, stop ids and incarnation), read with its
-- weight in the one HMGET the scan makes of it anyway: a worker's first prompt of a job costs it no
-- read of its own.
--
-- KEYS[1]    queue             RQ's queue list of the class
-- KEYS[2]    paused            the paused jobs
-- KEYS[3]    high              the class's dispatch set at priority high
-- KEYS[4]    normal            ... at priority normal
-- KEYS[5]    low               ... at priority low
-- KEYS[6]    window            the current window bucket (dispatches per job)
-- KEYS[7]    started           the class's RQ started registry
-- KEYS[8]    epoch             the epoch hash
-- ARGV[1]    job_prefix        job key prefix (the job id follows)
-- ARGV[2]    backlog_suffix    what follows a job's key in its backlog's of the class
-- ARGV[3]    window_ttl_s      the window bucket's TTL (s)
-- ARGV[4]    rq_list_scan: number  how many of RQ's list a claim looks at, at most
-- ARGV[5]    rq_id_prefix      RQ id prefix (`{ns}-`; the job id follows it up to the next `-`)
-- ARGV[6]    rq_job_prefix     RQ job key prefix (`rq:job:`)
-- ARGV[7]    want: number      how many prompts at most
-- ARGV[8]    heartbeat_expiry  the started-registry score (the heartbeat's expiry, epoch s)
-- ARGV[9]    now_rq            now in RQ's time format
-- ARGV[10]   worker_name       the worker's RQ name
-- ARGV[11]   execution_id      the execution id of its started-registry members
-- ARGV[12]   running_suffix    what follows a job's key in its running set's
-- ARGV[13]   epoch_floor: number  the worker's epoch floor
-- ARGV[14]   tail: number      a job picked with this many prompts left or fewer gets them all
--                              (`TAIL_PROMPTS`)
-- ARGV[15]   known             the job ids whose run facts this worker holds, space-separated
--                              ('*': every job's; it wants none)
-- ARGV[16..] skip              job ids this worker passes over (too many of their records wait for a
--                              commit here)

if tonumber(redis.call('HGET', epoch, 'seq') or '0') < epoch_floor then return {{}, {}} end
local skipped = {}
for _, job in ipairs(skip) do skipped[job] = true end
local knows = {}
local knows_all = known == '*'
for job in string.gmatch(known, '%S+') do knows[job] = true end
local facts = {}
local sets = {high = high, normal = normal, low = low}
local function job_of(id)
  local rest = string.sub(id, #rq_id_prefix + 1)
  local dash = string.find(rest, '-', 1, true)
  return dash and string.sub(rest, 1, dash - 1) or ''
end
local ids = {}
for _ = 1, rq_list_scan do
  if #ids >= want then break end
  local id = redis.call('LPOP', queue)
  if not id then break end
  local job = job_of(id)
  if job ~= '' and (skipped[job] or redis.call('SISMEMBER', paused, job) == 1) then
    redis.call('LPUSH', job_prefix .. job .. backlog_suffix, id)
    local jobkey = job_prefix .. job
    rejoin(sets[redis.call('HGET', jobkey, 'priority') or 'normal'] or normal, paused, job, jobkey)
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
for _, set in ipairs({high, normal, low}) do
  while #ids < want do
    local need = want - #ids
    local jobs = {}
    local page = need + #skip
    local offset = 0
    local to_end = false -- the page scan reached the set's end: every job with work is in `jobs`
    -- What the jobs read so far give at their first picks: a job with its tail left, all of it;
    -- any other, one. Once that covers `need`, the picks below reach `need` before every job read
    -- has had its first pick, and a job read but not picked yet scores below every job not read:
    -- so no job past the scan would have come first, and it stops there. A claim among many small
    -- jobs reads a few of them, not `need` (the same picks as reading `need` jobs, each giving one).
    local covered = 0
    while covered < need do
      local entries = redis.call('ZRANGE', set, offset, offset + page - 1, 'WITHSCORES')
      local removed = 0
      for i = 1, #entries, 2 do
        if covered >= need then break end
        local job = entries[i]
        if not skipped[job] then
          local jobkey = job_prefix .. job
          local left = redis.call('LLEN', jobkey .. backlog_suffix)
          if left == 0 then
            leave(set, job, jobkey)
            removed = removed + 1
          else
            local raw_weight
            if knows_all or knows[job] then
              raw_weight = redis.call('HGET', jobkey, 'weight')
            else
              local got = redis.call('HMGET', jobkey, 'weight', 'spec', 'tokenizer_identity', 'stop_ids',
                'incarnation')
              raw_weight = got[1]
              if got[2] then facts[job] = {job, got[2], got[3] or '', got[4] or '', got[5] or ''} end
            end
            local weight = tonumber(raw_weight or '1') or 1
            if weight <= 0 then weight = 1 end
            jobs[#jobs + 1] = {job = job, vt = tonumber(entries[i + 1]), w = weight, left = left, take = 0}
            if left <= tail then covered = covered + left else covered = covered + 1 end
          end
        end
      end
      if covered < need and #entries < 2 * page then
        to_end = true
        break
      end
      offset = offset + page - removed
    end
    if #jobs == 0 then break end
    local heap = {}
    for _, j in ipairs(jobs) do push(heap, j) end
    local got = 0
    while got < need and #heap > 0 do
      local best = pop(heap)
      local rest = best.left - best.take
      local n = 1
      if rest <= tail then n = math.min(rest, need - got) end
      best.take = best.take + n
      best.vt = best.vt + n / best.w
      got = got + n
      if best.left > best.take then push(heap, best) end
    end
    for _, j in ipairs(jobs) do
      if j.take > 0 then
        local jobkey = job_prefix .. j.job
        local popped = redis.call('LPOP', jobkey .. backlog_suffix, j.take)
        if popped then
          for _, id in ipairs(popped) do ids[#ids + 1] = id end
          if #popped >= j.left then
            -- Its backlog ran dry: it leaves the set now (rejoining with its next prompts), so
            -- the next claim does not look at it and the set's weight sum counts only jobs with work.
            leave(set, j.job, jobkey, j.w)
          else
            redis.call('ZINCRBY', set, #popped / j.w, j.job)
          end
          redis.call('HINCRBY', jobkey, 'dispatched', #popped)
          dispatched[j.job] = (dispatched[j.job] or 0) + #popped
        end
      end
    end
    -- Every job of the set with work was looked at: what is still wanted is not in this set.
    if to_end then break end
  end
end
-- The window bucket counts each job's dispatches and, under `*` (no job id has one), all of them.
-- Only claims write a bucket, and the one that makes it makes its `*` in the same atomic step: a
-- `*` that counts just this claim's is a new bucket, the only one without its TTL yet.
local total = 0
for job, n in pairs(dispatched) do
  redis.call('HINCRBY', window, job, n)
  total = total + n
end
if total > 0 and redis.call('HINCRBY', window, '*', total) == total then
  redis.call('EXPIRE', window, window_ttl_s)
end
local out = {}
local members = {}
local running = {}
for _, id in ipairs(ids) do
  local rqkey = rq_job_prefix .. id
  local fields = redis.call('HGETALL', rqkey)
  if #fields > 0 then
    redis.call('HSET', rqkey, 'status', 'started', 'started_at', now_rq, 'last_heartbeat', now_rq,
      'worker_name', worker_name)
    members[#members + 1] = heartbeat_expiry
    members[#members + 1] = id .. ':' .. execution_id
    local job = job_of(id)
    if job ~= '' then
      running[job] = running[job] or {}
      table.insert(running[job], id)
    end
    out[#out + 1] = {id, fields}
  end
end
if #members > 0 then redis.call('ZADD', started, unpack(members)) end
for job, ids_started in pairs(running) do
  redis.call('SADD', job_prefix .. job .. running_suffix, unpack(ids_started))
end
local told = {}
for job, n in pairs(dispatched) do
  if n > 0 and facts[job] then told[#told + 1] = facts[job] end
end
return {out, told}
