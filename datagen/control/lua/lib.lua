-- The rules that several scripts share, written once. The loader (datagen/control/scripts.py) puts this
-- file before each script whose first line is `--! uses lib`. Redis lets a script define no
-- globals, so every rule is a local function of the script it is put before (.luacheckrc names
-- them as the scripts' read-only globals). No function here reads KEYS or ARGV: a script passes
-- what it bound.

-- Counting prompts that ended -----------------------------------------------------------------------
-- count_and_maybe_complete.lua counts one prompt (done, failed or cancelled), ack_done.lua the
-- prompts of a committed shard (done), by the same rules:
-- - A prompt of another incarnation of its job (one deleted meanwhile, its id reused) is not
--   counted (the job's one read, `job_read`, answers both "is the job there" and "which
--   incarnation" for every job made since incarnations).
-- - A prompt is counted only if it was still in the job's running set, so finishing the same prompt
--   twice (a stalled worker and its rescuer) counts once.
-- - The job's counter and its breakdown (counter, output tokens and finish reason per partition
--   label and class) move together; a partition the job did not label counts as 'other'.
-- - Two timestamps, each set once, only where the job's read found none (the first writer wins;
--   a retry or a second count never moves them), show how a run starts and ends:
--   `first_record_at_ms`: by the count that moves `done` from 0 to positive (the job's first
--   record); failed and cancelled prompts never set it. A job counted before this field existed
--   keeps none.
--   `tail_from_ms`: by the first call that finds the job running (ingestion finished, so
--   `accepted` is the whole job) with done + failed + cancelled >= ceil(0.95 * accepted), i.e.
--   20 * ended >= 19 * accepted in integers: the job's last 5 % of prompts ("the tail") start then.
--   It is set before the completion check, so the call that completes a job sets it too (a tail
--   of 0 s at the least), and so does finish_ingest.lua as ingestion ends (a job 95 % done by
--   then has its tail start at the end of ingestion). A prompt
--   added later (the next turn of multi-turn `all` mode) does not move it.
-- - A running job completes when all of its accepted prompts have ended, at `finished_at_ms` now;
--   but a job that a resubmission reopened after its completion (`completed_before`, written by
--   `JobStore.restart_ingest`: `<finished_at_ms> <accepted> <output_tokens>` then) and that has run
--   nothing new since (the same accepted prompts and output tokens) keeps its completion time, so
--   re-attaching by resubmitting moves none of its rates or its tail. The field goes either way.
-- A call reads the job's hash once and writes it once (`job_read`, `count_and_complete`): a
-- 3-prompt ack cost 15 commands on its job when each rule read or wrote for itself, 7 now.
-- `job` names one job's keys: {key = its hash, running = its running set, breakdown = its
-- breakdown hash, partitions = its labelled partitions}.

-- What the counting rules read of a job's hash, in one HMGET (`job_read`), by name.
local COUNTED_FIELDS = {
  'incarnation', 'state', 'done', 'failed', 'cancelled', 'accepted', 'output_tokens', 'completed_before',
  'first_record_at_ms', 'tail_from_ms', 'labels',
}

-- The job's counted fields (COUNTED_FIELDS, then `extra`), read once: {field = value or false}, and
-- `writes`, the fields a call sets (`job_set`), all of them in one HSET at its end (`job_write`,
-- which `count_and_complete` calls). A script reads once and writes once instead of one HINCRBY, HSETNX or
-- HMGET per rule: atomic, so the same as those commands one after another. `leaving`: the ids
-- `leave_running` found running and left for `count_and_complete` to take out.
local function job_read(job, extra)
  local names = {unpack(COUNTED_FIELDS)}
  for _, name in ipairs(extra or {}) do names[#names + 1] = name end
  local v = redis.call('HMGET', job.key, unpack(names))
  local fields = {writes = {}, leaving = {}}
  for i, name in ipairs(names) do fields[name] = v[i] end
  return fields
end

-- A counter of `fields` as a number (absent: 0).
local function counted(fields, name)
  return tonumber(fields[name] or '0') or 0
end

-- Sets `name` to `value` in `fields` and in what its call writes.
local function job_set(fields, name, value)
  fields[name] = value
  fields.writes[name] = value
end

-- A count as Redis keeps it: an integer in decimal (Lua's own numbers print 15 digits and more in
-- exponent form, which HINCRBY would refuse).
local function decimal(n)
  return string.format('%d', n)
end

-- The job's incarnation: '' for a job made before incarnations, nil for a job that is gone. A hash
-- with neither an incarnation nor a state is no job: a remnant that writes of an older version
-- made after Redis lost the job (a next turn's counters, `accepted` alone); as `create.lua` and
-- `JobStore.incarnation` do, it counts as gone, so nothing counts in it and a rebuild makes the job
-- anew over it. `fields`: from `job_read`.
local function job_incarnation(fields)
  if fields.incarnation then return fields.incarnation end
  if fields.state then return '' end
  return nil
end

-- Whether a prompt that carries incarnation `wanted` ('' for none) counts in a job of `incarnation`.
local function counts_in(wanted, incarnation)
  return wanted == '' or wanted == incarnation
end

-- Which of `ids` are in the job's running set: per id, 1 if it was there and 0 if not. One id
-- leaves the set at once (SREM answers both). Several are left in `fields.leaving`
-- (`fields` from `job_read`) for `count_and_complete` to take out, or to drop with the whole set
-- when the job completes: a caller that counts none of them has none there.
local function leave_running(job, ids, fields)
  if #ids == 1 then return {redis.call('SREM', job.running, ids[1])} end
  local was_running = redis.call('SMISMEMBER', job.running, unpack(ids))
  for n, id in ipairs(ids) do
    if was_running[n] == 1 then fields.leaving[#fields.leaving + 1] = id end
  end
  return was_running
end

-- A job keeps the partitions it labelled in its hash too: `labels`, how many (written as 0 by its
-- create), and `label:<partition>` = '1' for each, read with the job (`job_read`, the fields
-- `label_fields` names), so that a count or an ingestion chunk looks its labels up at no command.
-- Its labelled partitions (a set) stay the list, for readers and for workers of the version
-- before, and the only record of a job made before it (no `labels`: looked up there).
local function label_field(partition)
  return 'label:' .. partition
end

-- The fields `job_read` reads for the labels of `partitions` (a list, repeats allowed): none for
-- more than `LABEL_READS` partitions, which are looked up in the set as before (one HMGET stays
-- short, and far below Lua's limit on unpacked values).
local LABEL_READS = 64
local function label_fields(partitions)
  local names, seen = {}, {}
  for _, partition in ipairs(partitions) do
    if not seen[partition] then
      seen[partition] = true
      names[#names + 1] = label_field(partition)
    end
  end
  if #names > LABEL_READS then return {} end
  return names
end

-- Which of `partitions` the job labelled (partition -> true or false), as its hash read says,
-- for `partition_label`'s `known`: none of a job made before its hash kept its labels, of a job
-- that is gone, or whose label fields were not read.
local function labels_read(fields, partitions)
  local known = {}
  if not (fields and fields.labels) then return known end
  for _, partition in ipairs(partitions) do
    local read = fields[label_field(partition)]
    if read ~= nil then known[partition] = read == '1' end
  end
  return known
end

-- The breakdown label of a partition: the partition if the job labelled it (its first ones, up to
-- a cap), else 'other'. `known` keeps the answers of one script call (partition -> labelled),
-- filled from the job's hash where it can be (`labels_read`).
local function partition_label(job, partition, known)
  if known[partition] == nil then
    known[partition] = redis.call('SISMEMBER', job.partitions, partition) == 1
  end
  if known[partition] then return partition end
  return 'other'
end

-- The field of a job's breakdown hash that counts `counter` for one partition label and class:
-- `counter|label|class`, the form `datagen.control.keys.BreakdownField` encodes and decodes (every
-- script builds its fields here; tests/datagen/test_lua_files.py holds the two together).
local function breakdown_field(counter, label, cls)
  return counter .. '|' .. label .. '|' .. cls
end

-- Adds to `fields` (breakdown field -> increment) what `n` prompts of one label and class, counted
-- as `counter`, add: the counter, their output tokens, and one per finish reason ('' for none).
-- Prompts of a recipe's arm (`arm`, '' or nil for none) also add the counter and their output
-- tokens as `<counter>@<arm>` and `output_tokens@<arm>` (`BreakdownField.of_arm`), beside the plain
-- ones, so the plain counters still sum to the job's.
local function tally(fields, counter, label, cls, n, tokens, finish, arm)
  local field = breakdown_field(counter, label, cls)
  fields[field] = (fields[field] or 0) + n
  if tokens ~= 0 then
    field = breakdown_field('output_tokens', label, cls)
    fields[field] = (fields[field] or 0) + tokens
  end
  if finish ~= '' then
    field = breakdown_field('finish:' .. finish, label, cls)
    fields[field] = (fields[field] or 0) + 1
  end
  if arm and arm ~= '' then
    field = breakdown_field(counter .. '@' .. arm, label, cls)
    fields[field] = (fields[field] or 0) + n
    if tokens ~= 0 then
      field = breakdown_field('output_tokens@' .. arm, label, cls)
      fields[field] = (fields[field] or 0) + tokens
    end
  end
end

-- Adds `increments` (field -> n) to the counters of hash `key`: one HINCRBY for one field, one read
-- and one write for more.
local function add_counts(key, increments)
  local names = {}
  for field in pairs(increments) do names[#names + 1] = field end
  if #names == 0 then return end
  if #names == 1 then
    redis.call('HINCRBY', key, names[1], increments[names[1]])
    return
  end
  local v = redis.call('HMGET', key, unpack(names))
  local sums = {}
  for i, field in ipairs(names) do
    sums[#sums + 1] = field
    sums[#sums + 1] = decimal((tonumber(v[i] or '0') or 0) + increments[field])
  end
  redis.call('HSET', key, unpack(sums))
end

-- Writes what a call set on the job (`job_set`), in one HSET.
local function job_write(job, fields)
  local writes = {}
  for name, value in pairs(fields.writes) do
    writes[#writes + 1] = name
    writes[#writes + 1] = value
  end
  if #writes > 0 then redis.call('HSET', job.key, unpack(writes)) end
end

-- Counts `n` prompts as `counter` in the job (setting `first_record_at_ms` by the rule above), their
-- `tokens` output tokens and `breakdown` (from `tally`) in its breakdown, then applies the tail and
-- completion rules to a job in `running_state`: its tail starts, and it moves to `completed_state`
-- (its running set goes) when all of its prompts have ended. `fields`: the job as `job_read` read
-- it, with what the caller set since (`job_set`), all written here in one HSET; the ids it left
-- running (`leave_running`) leave the running set unless the whole set goes. Answers whether the
-- job completed.
local function count_and_complete(job, fields, counter, n, tokens, breakdown, now_ms, running_state,
                                  completed_state)
  if n ~= 0 then
    local before = counted(fields, counter)
    job_set(fields, counter, decimal(before + n))
    if counter == 'done' and before == 0 and before + n > 0 and not fields.first_record_at_ms then
      job_set(fields, 'first_record_at_ms', now_ms)
    end
  end
  if tokens ~= 0 then job_set(fields, 'output_tokens', decimal(counted(fields, 'output_tokens') + tokens)) end
  add_counts(job.breakdown, breakdown)
  local completed = false
  if fields.state == running_state then
    local ended = counted(fields, 'done') + counted(fields, 'failed') + counted(fields, 'cancelled')
    local accepted = counted(fields, 'accepted')
    if 20 * ended >= 19 * accepted and not fields.tail_from_ms then
      job_set(fields, 'tail_from_ms', now_ms)
    end
    if ended >= accepted then
      local finished_at_ms = now_ms
      if fields.completed_before then
        local then_ms, then_accepted, then_tokens =
          string.match(fields.completed_before, '^(%d+) (%d+) (%d+)$')
        if then_ms and tonumber(then_accepted) == accepted
          and tonumber(then_tokens) == counted(fields, 'output_tokens') then
          finished_at_ms = then_ms
        end
        redis.call('HDEL', job.key, 'completed_before')
      end
      job_set(fields, 'state', completed_state)
      job_set(fields, 'finished_at_ms', finished_at_ms)
      redis.call('DEL', job.running)
      completed = true
    end
  end
  job_write(job, fields)
  if not completed and #fields.leaving > 0 then redis.call('SREM', job.running, unpack(fields.leaving)) end
  return completed
end

-- Acknowledging committed prompts ----------------------------------------------------------------
-- ack_done.lua (a shard's prompts) and ack_next_turn.lua (one prompt and its conversation's next
-- turn) finish prompts alike. `rq` = {prefix = RQ's job key prefix, now = now in RQ's format, now_s =
-- now (epoch s), expiring = the finished registry's ZADD arguments, filled here}.

-- As RQ's handle_job_success: the RQ job `finished` with its `ended_at`, expiring after its result
-- TTL (gone at once for a TTL of 0, kept for good for a negative one), and in the finished registry.
local function finish_in_rq(rq, prompt)
  local rqkey = rq.prefix .. prompt.rq_id
  local ttl = prompt.result_ttl_s
  if ttl == 0 then
    redis.call('UNLINK', rqkey)
    return
  end
  redis.call('HSET', rqkey, 'status', 'finished', 'ended_at', rq.now)
  if ttl > 0 then
    redis.call('EXPIRE', rqkey, ttl)
    rq.expiring[#rq.expiring + 1] = rq.now_s + ttl
  else
    redis.call('PERSIST', rqkey)
    rq.expiring[#rq.expiring + 1] = '+inf'
  end
  rq.expiring[#rq.expiring + 1] = prompt.rq_id
end

-- Finishes in RQ the prompts of one job that count by the counting rules (the job's incarnation,
-- still running); a prompt that does not count keeps its RQ job as it is (a stale ack never
-- finishes a copy that waits to run). Answers how many counted, their output tokens, their
-- breakdown (`tally`) and the job as read (`job_read`, nil for a job that is gone), for
-- `count_and_complete`, which a caller with any counted must call: it takes them out of the
-- running set.
local function ack_in_job(job, prompts, rq)
  local done, tokens, breakdown = 0, 0, {}
  local partitions = {}
  for _, prompt in ipairs(prompts) do partitions[#partitions + 1] = prompt.partition end
  local fields = job_read(job, label_fields(partitions))
  local current = job_incarnation(fields)
  if not current then return done, tokens, breakdown, nil end
  local mine, ids = {}, {}
  for _, prompt in ipairs(prompts) do
    if counts_in(prompt.incarnation, current) then
      mine[#mine + 1] = prompt
      ids[#ids + 1] = prompt.rq_id
    end
  end
  if #mine == 0 then return done, tokens, breakdown, fields end
  local was_running = leave_running(job, ids, fields)
  local known = labels_read(fields, partitions)
  for n, prompt in ipairs(mine) do
    if was_running[n] == 1 then
      finish_in_rq(rq, prompt)
      done = done + 1
      tokens = tokens + prompt.output_tokens
      tally(breakdown, 'done', partition_label(job, prompt.partition, known), prompt.cls, 1,
        prompt.output_tokens, prompt.finish, prompt.arm)
    end
  end
  return done, tokens, breakdown, fields
end

-- Dispatch ---------------------------------------------------------------------------------------

-- Each dispatch set keeps a running sum of its members' weights beside it (`<set>:weight`, in
-- thousandths of a weight unit, at least 1 per job, so sums stay exact integers), moved by every
-- join and leave below: the API reads a job's target share from two sums and its own weight, not
-- from every job (`Dispatch.page_shares`). `dispatch_weights.lua` recomputes the sums from the sets
-- for a Redis whose sets were filled before the sums existed.
local function weight_units(weight)
  local w = tonumber(weight or '1') or 1
  if w <= 0 then w = 1 end
  return math.max(1, math.floor(w * 1000 + 0.5))
end

-- A job with prompts to dispatch (enqueued, retried, handed back, resumed) joins a dispatch set at
-- the set's lowest virtual time, so it gets its share from then on without a catch-up burst (and a
-- resumed job none below the jobs beside it), unless it is in the set already. A paused job is in
-- no set, so that no claim ever scans it: it joins on resume. `job_key`: the job's hash (its
-- weight); `weight`: the job's weight if the caller read it (nil: read from `job_key` on joining).
-- `was_empty`: the caller knows the job's backlog was empty before its push. Such a job is rarely
-- in the set (a claim that empties a backlog takes the job out), so it skips the look and joins
-- with NX: a member keeps its place, and the sum its weight once.
local function rejoin(set, paused, job_id, job_key, weight, was_empty)
  if redis.call('SISMEMBER', paused, job_id) == 1 then return end
  if not was_empty and redis.call('ZSCORE', set, job_id) then return end
  local first = redis.call('ZRANGE', set, 0, 0, 'WITHSCORES')
  if redis.call('ZADD', set, 'NX', first[2] or 0, job_id) == 0 then return end
  if weight == nil then weight = redis.call('HGET', job_key, 'weight') end
  redis.call('INCRBY', set .. ':weight', weight_units(weight))
end

-- Saves `n` prompts' RQ jobs as queued, the hash RQ's `Job.save` writes
-- (`datagen.control.enqueue.queued_jobs`): from `prompts[first]` on, per prompt its RQ id, its
-- description and its data, with `shared` (field, value, ...: what every one of them shares).
-- Answers their RQ ids.
local function save_queued(rq_job_prefix, prompts, first, n, shared)
  local rq_ids = {}
  for p = first, first + 3 * (n - 1), 3 do
    rq_ids[#rq_ids + 1] = prompts[p]
    redis.call('HSET', rq_job_prefix .. prompts[p], 'description', prompts[p + 1], 'data', prompts[p + 2],
      unpack(shared))
  end
  return rq_ids
end

-- Appends `rq_ids` to a job's backlog of one class, `slice` at a time (Lua's unpack has a stack
-- limit); the job joins the class's dispatch set (`rejoin`), and idle workers are told
-- (`workers.claim.wake`). `to` = {backlog = the backlog, set = the dispatch set of the class at the
-- job's priority, paused = the paused jobs, job_id, job_key = its hash, weight = its weight if read
-- (else nil), wake = the wake channel, cls = the class}.
local function backlog_push(to, rq_ids, slice)
  local length = 0
  for s = 1, #rq_ids, slice do
    length = redis.call('RPUSH', to.backlog, unpack(rq_ids, s, math.min(s + slice - 1, #rq_ids)))
  end
  rejoin(to.set, to.paused, to.job_id, to.job_key, to.weight, length == #rq_ids)
  redis.call('PUBLISH', to.wake, to.cls)
end

-- The job leaves a dispatch set (no prompts left there, paused, cancelled, deleted); `weight`: its
-- weight if the caller read it, else nil (read from `job_key` only if it was a member).
local function leave(set, job_id, job_key, weight)
  if redis.call('ZREM', set, job_id) == 0 then return end
  if weight == nil then weight = redis.call('HGET', job_key, 'weight') end
  redis.call('DECRBY', set .. ':weight', weight_units(weight))
end

-- Prompts cancelled before any worker ran them (dropped from a backlog, refused by it, or taken off
-- RQ's queue): the job's counter and its breakdown move together. Their partition is not read back,
-- so it counts as 'unknown'.
local function count_cancelled_queued(jobkey, breakdown, cls, n)
  redis.call('HINCRBY', jobkey, 'cancelled', n)
  redis.call('HINCRBY', breakdown, breakdown_field('cancelled', 'unknown', cls), n)
end
