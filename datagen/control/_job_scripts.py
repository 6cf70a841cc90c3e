"""The Lua scripts behind `datagen.control.jobs.JobStore` (and the dispatch scripts' shared rule): every job
state transition and counter update that must be atomic. States and field names that vary come in as
arguments; each script's comment says its KEYS and ARGV."""

from __future__ import annotations

from datagen.control._dispatch_scripts import REJOIN

__all__ = [
    "COUNT_AND_MAYBE_COMPLETE",
    "COUNT_CANCELLED_QUEUED",
    "CREATE",
    "FORGET_REPORTS",
    "RELEASE",
    "REQUEUE_FAILED",
    "SET_IF_EXISTS",
    "TRANSITION",
]

# KEYS: job hash, the job's running set, its failure reports, its breakdown hash, its labelled
# partitions. ARGV: counter field, increment, output tokens, now ms, RQ id leaving the running set
# ("" for none), failure report ("" for none), report cap, partition, class, finish reason ("" for
# none), the prompt's job incarnation ("" for none), the running and completed states. A prompt of
# another incarnation of the job (one deleted meanwhile, its id reused) is not counted (one HGET
# answers both "is the job there" and "which incarnation" for every job made since). A prompt is
# counted only if it was still in the running set, so finishing the same prompt twice (a stalled worker
# and its rescuer) counts once.
# Two timestamps (ARGV[4], set once each with HSETNX, so the first writer wins and a retry or a second
# count never moves them) show how a run starts and ends:
# - `first_record_at_ms`: the count that moves `done` from 0 to positive (the job's first record; the
#   HINCRBY's answer tells, so later counts cost no extra command); failed and cancelled prompts never
#   set it. A job counted before this field existed keeps none.
# - `tail_from_ms`: the first call that finds the job `running` (ingestion finished, so `accepted` is
#   the whole job) with done + failed + cancelled >= ceil(0.95 * accepted), i.e. 20 * finished >= 19 *
#   accepted in integers: the job's last 5 % of prompts ("the tail") start then. It is set before the
#   completion check, so the call that completes a job sets it too (a tail of 0 s at the least), and so
#   does the zero-increment call `finish_ingest` makes as ingestion ends (a job 95 % done by then has
#   its tail start at the end of ingestion). A prompt added later (the next turn of multi-turn `all`
#   mode) does not move it.
COUNT_AND_MAYBE_COMPLETE = """
local key = KEYS[1]
local incarnation = redis.call('HGET', key, 'incarnation')
if not incarnation then
  if redis.call('EXISTS', key) == 0 then return 0 end
  incarnation = ''
end
if ARGV[11] ~= '' and incarnation ~= ARGV[11] then return 0 end
if ARGV[5] ~= '' and redis.call('SREM', KEYS[2], ARGV[5]) == 0 then return -1 end
if tonumber(ARGV[2]) ~= 0 then
  local count = redis.call('HINCRBY', key, ARGV[1], ARGV[2])
  if ARGV[1] == 'done' and count > 0 and count == tonumber(ARGV[2]) then
    redis.call('HSETNX', key, 'first_record_at_ms', ARGV[4])
  end
  local label = ARGV[8]
  if redis.call('SISMEMBER', KEYS[5], label) == 0 then label = 'other' end
  local suffix = '|' .. label .. '|' .. ARGV[9]
  redis.call('HINCRBY', KEYS[4], ARGV[1] .. suffix, ARGV[2])
  if tonumber(ARGV[3]) ~= 0 then redis.call('HINCRBY', KEYS[4], 'output_tokens' .. suffix, ARGV[3]) end
  if ARGV[10] ~= '' then redis.call('HINCRBY', KEYS[4], 'finish:' .. ARGV[10] .. suffix, 1) end
end
if tonumber(ARGV[3]) ~= 0 then redis.call('HINCRBY', key, 'output_tokens', ARGV[3]) end
if ARGV[6] ~= '' then
  redis.call('RPUSH', KEYS[3], ARGV[6])
  redis.call('LTRIM', KEYS[3], 0, tonumber(ARGV[7]) - 1)
end
if redis.call('HGET', key, 'state') == ARGV[12] then
  local done = tonumber(redis.call('HGET', key, 'done') or '0')
  local failed = tonumber(redis.call('HGET', key, 'failed') or '0')
  local cancelled = tonumber(redis.call('HGET', key, 'cancelled') or '0')
  local accepted = tonumber(redis.call('HGET', key, 'accepted') or '0')
  if 20 * (done + failed + cancelled) >= 19 * accepted then
    redis.call('HSETNX', key, 'tail_from_ms', ARGV[4])
  end
  if done + failed + cancelled >= accepted then
    redis.call('HSET', key, 'state', ARGV[13], 'finished_at_ms', ARGV[4])
    redis.call('DEL', KEYS[2])
    return 2
  end
end
return 1
"""

# KEYS: job hash, its ingest fence. ARGV: the states it may move from (space-separated), the
# state it moves to, what to do with the fence ("" nothing, "drop": ingestion may enqueue no more,
# "arm": ingestion may enqueue for the job's incarnation), the call's token, then field/value pairs
# to set with it. Returns 1 if it moved. A job that does not exist never moves (and is never
# recreated). The token is kept in the hash: the same call sent again (its reply was lost, and
# redis-py or the caller repeated it) finds its own token and answers 1 again instead of "not moved".
TRANSITION = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return 0 end
if state == ARGV[2] and redis.call('HGET', KEYS[1], 'transition') == ARGV[4] then return 1 end
local allowed = false
for from in string.gmatch(ARGV[1], '%S+') do
  if from == state then allowed = true end
end
if not allowed then return 0 end
redis.call('HSET', KEYS[1], 'state', ARGV[2], 'transition', ARGV[4])
for i = 5, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
if ARGV[3] == 'drop' then redis.call('DEL', KEYS[2]) end
if ARGV[3] == 'arm' then
  redis.call('SET', KEYS[2], redis.call('HGET', KEYS[1], 'incarnation') or '')
end
return 1
"""

# KEYS: job hash, the jobs index, the job's ingest fence. ARGV: job id, created (ms), the new
# incarnation, the fence's value ("" for none), "replace" (or ""), then field/value pairs. Creates
# the whole job at once. Returns 1 if the job now has this incarnation (made by this call, or by the
# same call sent again after its reply was lost), 0 if another job of the id exists. A hash without
# a state (half made by an older version, whose create was two commands) is made whole, never left
# as an id that refuses every submit. "replace" (a job rebuilt from storage) makes it anew whatever
# is there, in one step, so that readers never see the job missing meanwhile.
CREATE = """
local state = redis.call('HGET', KEYS[1], 'state')
if state and ARGV[5] ~= 'replace' then
  if redis.call('HGET', KEYS[1], 'incarnation') == ARGV[3] then return 1 end
  return 0
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'created_at_ms', ARGV[2], 'incarnation', ARGV[3])
for i = 6, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
if ARGV[4] ~= '' then redis.call('SET', KEYS[3], ARGV[4]) end
return 1
"""

# KEYS: job hash, its breakdown, the class's failed registry, the job's backlog of the class, the
# dispatch set of the class at the job's priority, the paused jobs. ARGV: RQ job key prefix, job id,
# the completed, cancelled and running states, then per prompt: RQ id, its new meta (serialized),
# retries left ("" to keep), its breakdown suffix ("|label|class"). Only a prompt this script
# removes from the failed registry is requeued and counted, so concurrent retries can never run a
# prompt twice or count it twice; a cancelled (or deleted) job takes none. Returns the ids that
# moved, -1 if the job refused.
REQUEUE_FAILED = (
    REJOIN
    + """
local state = redis.call('HGET', KEYS[1], 'state')
if not state or state == ARGV[4] then return -1 end
local moved = {}
for i = 6, #ARGV, 4 do
  local id = ARGV[i]
  if redis.call('ZREM', KEYS[3], id) == 1 then
    local jobkey = ARGV[1] .. id
    redis.call('HSET', jobkey, 'status', 'queued', 'meta', ARGV[i + 1])
    if ARGV[i + 2] ~= '' then redis.call('HSET', jobkey, 'retries_left', ARGV[i + 2]) end
    redis.call('PERSIST', jobkey)
    redis.call('RPUSH', KEYS[4], id)
    redis.call('HINCRBY', KEYS[2], 'failed' .. ARGV[i + 3], -1)
    moved[#moved + 1] = id
  end
end
if #moved > 0 then
  redis.call('HINCRBY', KEYS[1], 'failed', -#moved)
  redis.call('HINCRBY', KEYS[1], 'retried', #moved)
  rejoin(KEYS[5], KEYS[6], ARGV[2])
  if state == ARGV[3] then redis.call('HSET', KEYS[1], 'state', ARGV[5], 'finished_at_ms', 0) end
end
return moved
"""
)

# KEYS: the job's failure reports. ARGV: RQ ids whose reports go (their prompts were retried). One
# script, because workers append reports all the while.
FORGET_REPORTS = """
local drop = {}
for i = 1, #ARGV do drop[ARGV[i]] = true end
local kept = {}
for _, raw in ipairs(redis.call('LRANGE', KEYS[1], 0, -1)) do
  local ok, report = pcall(cjson.decode, raw)
  if not (ok and type(report) == 'table' and drop[report['rq_id']]) then kept[#kept + 1] = raw end
end
redis.call('DEL', KEYS[1])
for i = 1, #kept, 1000 do redis.call('RPUSH', KEYS[1], unpack(kept, i, math.min(i + 999, #kept))) end
return #kept
"""

# KEYS: the lock. ARGV: the holder's token. Releases the lock only if this holder still has it.
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# The one rule for counting prompts cancelled before any worker ran them (dropped from a backlog or
# refused by it), shared by the dispatch scripts and `JobStore.count_cancelled_queued`: the job's
# counter and its breakdown move together. Their partition is not read back, so it counts as unknown.
COUNT_CANCELLED_QUEUED = """
local function count_cancelled_queued(jobkey, breakdown, cls, n)
  redis.call('HINCRBY', jobkey, 'cancelled', n)
  redis.call('HINCRBY', breakdown, 'cancelled|unknown|' .. cls, n)
end
"""

# KEYS: a hash. ARGV: field, value. Sets the field only if the hash exists (never creates it).
SET_IF_EXISTS = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
return redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
"""
