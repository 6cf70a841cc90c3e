-- Deletes an RQ job hash only if it is a remnant (no `data`: no enqueue ever saved it). Returns 1 if
-- it did.
--
-- KEYS[1]  rq_job_key  the RQ job hash

if redis.call('HEXISTS', rq_job_key, 'data') == 0 then return redis.call('DEL', rq_job_key) end
return 0
