--! uses lib
-- Multi-turn `all` mode: one committed turn finishes in RQ and counts done as `ack_done.lua` does
-- (`ack_in_job`), and its conversation's next turn is enqueued in the same step **only if this
-- call counted the turn**: a job that is gone (Redis lost it: nothing is written, no hash comes
-- back), of another incarnation, or a turn no longer running (acknowledged before, or a stale ack
-- after a rebuild from storage, which enqueues the next turn itself from the records) enqueues
-- nothing. So each turn's next turn is enqueued once, by the ack that counts it. The next turn
-- is also skipped when its key is in the job's `enqueued` guard already. Enqueuing it: its RQ job
-- hash (the fields RQ's `Job.save` writes, computed by RQ in Python), RQ's queue registered, its id
-- appended to the job's backlog of its class (a cancelled job counts it cancelled instead, as
-- `backlog_add.lua`), idle workers told, and `accepted`, `prompt_tokens` and the breakdown counted
-- before the completion check, so the job cannot complete in between. Returns 1 if the turn
-- counted, else 0.
--
-- KEYS[1]   started          the acknowledged turn's class's RQ started registry
-- KEYS[2]   finished         its finished registry
-- KEYS[3]   job_key          the job's hash
-- KEYS[4]   running          its running set
-- KEYS[5]   breakdown        its breakdown hash
-- KEYS[6]   partitions       its labelled partitions
-- KEYS[7]   enqueued         its guard set of next turns enqueued
-- KEYS[8]   next_rq_key      the next turn's RQ job hash
-- KEYS[9]   backlog          the job's backlog of the next turn's class
-- KEYS[10]  dispatch_set     the dispatch set of that class at the job's priority
-- KEYS[11]  queues           RQ's set of queue keys
-- KEYS[12]  paused           the paused jobs
-- KEYS[13]  wake             the wake channel
-- ARGV[1]   rq_job_prefix    RQ job key prefix (`rq:job:`)
-- ARGV[2]   now_ms           now (ms)
-- ARGV[3]   now_rq           now in RQ's time format
-- ARGV[4]   now_s: number    now (epoch s)
-- ARGV[5]   execution_id     the execution id of the started-registry member
-- ARGV[6]   running_state    the state of a job whose prompts run
-- ARGV[7]   completed_state  the state a job moves to when its last prompt ends
-- ARGV[8]   cancelled_state  the state of a cancelled job
-- ARGV[9]   rq_id            the acknowledged turn's RQ id
-- ARGV[10]  job_id           its job
-- ARGV[11]  incarnation      the job incarnation it belongs to ('' for none)
-- ARGV[12]  output_tokens: number  its output tokens
-- ARGV[13]  partition        its partition (the next turn's too)
-- ARGV[14]  cls              its class
-- ARGV[15]  finish           its finish reason
-- ARGV[16]  result_ttl_s: number  its RQ result TTL (s)
-- ARGV[17]  arm              its recipe arm ('' for none)
-- ARGV[18]  queue_key        the next turn's RQ queue key
-- ARGV[19]  next_member      the next turn's prompt key in the guard set
-- ARGV[20]  next_rq_id       the next turn's RQ id
-- ARGV[21]  next_cls         the next turn's class
-- ARGV[22]  next_tokens: number  the next turn's prompt tokens
-- ARGV[23..] next_fields     the next turn's RQ job hash: field, value, field, value, ...

local prompt = {
  rq_id = rq_id, incarnation = incarnation, output_tokens = output_tokens, partition = partition, cls = cls,
  finish = finish, result_ttl_s = result_ttl_s, arm = arm,
}
redis.call('ZREM', started, rq_id .. ':' .. execution_id)
local job = {key = job_key, running = running, breakdown = breakdown, partitions = partitions}
local rq = {prefix = rq_job_prefix, now = now_rq, now_s = now_s, expiring = {}}
local done, tokens, counts, fields = ack_in_job(job, {prompt}, rq)
if #rq.expiring > 0 then redis.call('ZADD', finished, unpack(rq.expiring)) end
if done == 0 then return 0 end

if redis.call('SADD', enqueued, next_member) == 1 then
  local label = partition_label(job, partition, labels_read(fields, {partition}))
  if fields.state == cancelled_state then
    count_cancelled_queued(job_key, breakdown, next_cls, 1)
    fields.cancelled = counted(fields, 'cancelled') + 1 -- as written just now, for the completion rule
  else
    redis.call('HSET', next_rq_key, unpack(next_fields))
    redis.call('SADD', queues, queue_key)
    backlog_push({
      backlog = backlog, set = dispatch_set, paused = paused, job_id = job_id, job_key = job_key, wake = wake,
      cls = next_cls,
    }, {next_rq_id}, 1)
  end
  job_set(fields, 'accepted', decimal(counted(fields, 'accepted') + 1))
  redis.call('HINCRBY', job_key, 'prompt_tokens', next_tokens)
  local field = breakdown_field('accepted', label, next_cls)
  counts[field] = (counts[field] or 0) + 1
end
count_and_complete(job, fields, 'done', done, tokens, counts, now_ms, running_state, completed_state)
return 1
