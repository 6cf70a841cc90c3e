"""Returns the prompts of dead workers to their queue, well within a minute.

RQ alone notices a dead worker's jobs only when a registry cleanup happens to run after their
heartbeat TTL: ``StartedJobRegistry.cleanup`` runs every ``maintenance_interval`` (600 s) or on
``rq info``, so up to ten minutes. Here every worker runs a reaper every ``reaper_interval_s``; a
per-queue lock lets one of them do each pass. A started-registry entry whose heartbeat lapsed is
claimed with ZREM (so two reapers never requeue the same prompt) and pushed back to the front of its
queue without using up the prompt's attempts. Each prompt is enqueued with
``Retry(max=max_worker_losses)`` and a requeue spends one of those RQ retries, so a prompt that
keeps killing workers fails (reason ``WorkerLost``) instead of stopping the fleet. RQ's own cleanup
(``rq info``, rq-dashboard) follows the same budget, since it also requeues while RQ retries are
left; when *it* fails a prompt at the cap, the reconciliation pass counts that failure in the job.

A stalled Redis (or a stalled process) must not pass for dead workers: while nobody can write a
heartbeat, every entry lapses. So each pass starts with a round trip, and when the time since this
reaper's previous round trip exceeds half a heartbeat TTL, it claims nothing for one heartbeat TTL,
by which time every live worker has beaten again. An entry is claimed only if its score is still
lapsed when it is claimed (a heartbeat between the read and the claim wins), and a requeue spends a
worker-loss retry only when the owning worker's own RQ heartbeat (``rq:worker:<name>``) is gone or
no later than the prompt's: a prompt whose worker still beats is requeued uncharged.

Jobs stranded in RQ's intermediate list (a worker killed between taking a job and registering
it) are requeued once they are seen there on two passes in a row.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from redis import Redis, RedisError
from rq.exceptions import NoSuchJobError
from rq.job import Job
from rq.queue import Queue
from rq.utils import utcparse
from rq.worker import BaseWorker
from rq.worker_registration import clean_worker_registry

from datagen.control.job_outcomes import failure_report
from datagen.control.jobs import JobStore
from datagen.control.keys import Keys
from datagen.control.payload import parse_payload
from datagen.control.redistext import as_text, as_texts
from datagen.control.rq_format import payload_of, rq_id_of_member
from datagen.control.scripts import KEY, LuaScript, ScriptArgs
from datagen.states import PromptClass
from workers.claim.rqbridge import fail_job, requeue_at_front
from workers.metrics import WorkerMetrics

__all__ = ["ReapResult", "Reaper"]

log = logging.getLogger(__name__)

# How many of the most recent failures each pass checks against the jobs' running sets.
RECONCILE_SCAN = 200
# The failure reason of a prompt that was running in too many workers that died.
WORKER_LOST = "WorkerLost"
# A gap between two of the reaper's Redis round trips longer than this share of the heartbeat TTL
# is a stall (entries lapse only after a whole TTL without heartbeats).
STALL_SHARE_OF_TTL = 0.5

# How much later than a prompt's last heartbeat its worker's own must be to be a later heartbeat
# (one heartbeat writes both, the worker's first, microseconds apart).
LATER_BEAT_S = 0.001


@dataclass(frozen=True)
class ClaimLapsedArgs(ScriptArgs):
    script = "claim_lapsed"
    package = "workers.claim"
    started: str = field(metadata=KEY)
    member: str
    cutoff: float


@dataclass
class ReapResult:
    requeued: int = 0
    failed: int = 0
    # Of ``requeued``: prompts whose worker still beats, requeued without spending a retry.
    uncharged: int = 0


class Reaper:
    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        jobs: JobStore,
        queues: list[Queue],
        *,
        owner: str,
        interval_s: float,
        heartbeat_ttl_s: float,
        metrics: WorkerMetrics,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.jobs = jobs
        self.queues = queues
        self.owner = owner
        self.interval_s = interval_s
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.metrics = metrics
        self._claim_lapsed = LuaScript(redis, ClaimLapsedArgs)
        # Monotonic times: this reaper's last Redis round trip, and the end of a hold after a stall.
        self._last_round_trip = time.monotonic()
        self._hold_until = 0.0

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                result = self.reap_once()
            except RedisError as exc:
                log.warning("reaper pass skipped (Redis unreachable?): %s", exc)
                continue
            except Exception:  # a failed pass is retried on the next one
                log.exception("reaper pass failed")
                continue
            self.metrics.reaped.labels("requeued").inc(result.requeued - result.uncharged)
            self.metrics.reaped.labels("uncharged").inc(result.uncharged)
            self.metrics.reaped.labels("failed").inc(result.failed)
            if result.requeued or result.failed:
                log.warning(
                    "reaper: %d prompts of dead workers requeued (%d of them uncharged), %d failed",
                    result.requeued,
                    result.uncharged,
                    result.failed,
                )

    def reap_once(self) -> ReapResult:
        result = ReapResult()
        holding = self._holding()
        lock_ms = max(1, int(self.interval_s * 1000))
        for queue in self.queues:
            if not self.redis.set(self.keys.reaper_lock(queue.name), self.owner, nx=True, px=lock_ms):
                continue
            if not holding:
                self._reap_started(queue, result)
            self._reap_intermediate(queue, result)
            self._reconcile_failed(queue, result)
            clean_worker_registry(queue)
        self._last_round_trip = time.monotonic()
        return result

    def _holding(self) -> bool:
        """One round trip; True while lapsed heartbeats are not to be trusted: for a heartbeat TTL
        after a gap between round trips (Redis or this process stalled) long enough to fake them."""
        self.redis.ping()
        at = time.monotonic()
        gap_s = at - self._last_round_trip
        self._last_round_trip = at
        if gap_s > self.heartbeat_ttl_s * STALL_SHARE_OF_TTL:
            self._hold_until = at + self.heartbeat_ttl_s
            log.warning(
                "reaper: no Redis round trip for %.1f s; lapsed heartbeats are not reaped for %.0f s, "
                "until live workers have beaten again",
                gap_s,
                self.heartbeat_ttl_s,
            )
        return at < self._hold_until

    def _reap_started(self, queue: Queue, result: ReapResult) -> None:
        registry = queue.started_job_registry
        cutoff = time.time()
        for member in as_texts(self.redis.zrangebyscore(registry.key, 0, cutoff)):
            expiry = self._claim_lapsed(ClaimLapsedArgs(started=registry.key, member=member, cutoff=cutoff))
            if expiry is None:
                continue  # beaten, finished meanwhile, or another reaper took it
            rq_id = rq_id_of_member(member)
            self._recover(queue, rq_id, float(expiry) - self.heartbeat_ttl_s, result)

    def _reap_intermediate(self, queue: Queue, result: ReapResult) -> None:
        listed = set(as_texts(self.redis.lrange(queue.intermediate_queue_key, 0, -1)))
        seen_key = self.keys.reaper_seen(queue.name)
        seen_before = set(as_texts(self.redis.smembers(seen_key)))
        started = {
            rq_id_of_member(m) for m in as_texts(self.redis.zrange(queue.started_job_registry.key, 0, -1))
        }
        stuck = (listed & seen_before) - started
        for rq_id in stuck:
            if self.redis.lrem(queue.intermediate_queue_key, 1, rq_id) == 1:
                queue.push_job_id(rq_id, at_front=True)
                self.redis.publish(self.keys.wake_channel(), self._class_of(queue))
                result.requeued += 1
        waiting = listed - stuck - started
        with self.redis.pipeline() as pipe:
            pipe.delete(seen_key)
            if waiting:
                pipe.sadd(seen_key, *waiting)
                pipe.pexpire(seen_key, int(self.interval_s * 3000))
            pipe.execute()

    def _class_of(self, queue: Queue) -> str:
        return next((cls.value for cls in PromptClass if self.keys.queue_name(cls) == queue.name), "")

    def _recover(self, queue: Queue, rq_id: str, last_beat_s: float, result: ReapResult) -> None:
        """Requeue (or fail) a prompt whose heartbeat lapsed, last renewed at ``last_beat_s``."""
        try:
            job = Job.fetch(rq_id, connection=self.redis, serializer=queue.serializer)
        except NoSuchJobError:
            return
        parsed = parse_payload(payload_of(job))
        job_id = parsed.job
        left = job.retries_left or 0
        charged = not self._beat_since(job.worker_name, last_beat_s)
        with self.redis.pipeline() as pipe:
            if charged and left <= 0:
                message = "gave up: the prompt was running in too many workers that died (max_worker_losses)"
                fail_job(job, message, pipe, worker_name=self.owner)
                if job_id is not None:
                    report = failure_report(rq_id, parsed, reason=WORKER_LOST, message=message)
                    self.jobs.outcomes.count_failed(pipe, job_id, rq_id, report, **parsed.labels.kwargs())
                result.failed += 1
            else:
                if not charged:
                    result.uncharged += 1
                requeue_at_front(job, queue, pipe, retries_left=left - 1 if charged else None)
                pipe.publish(self.keys.wake_channel(), self._class_of(queue))
                if job_id is not None:
                    self.jobs.outcomes.handed_back(pipe, job_id, rq_id)
                result.requeued += 1
            pipe.execute()
        if not charged:
            log.warning("reaper: requeued %s uncharged: its worker %s still beats", rq_id, job.worker_name)
            return
        log.info(
            "reaper: %s %s (%d worker losses left)",
            "failed" if left <= 0 else "requeued",
            rq_id,
            max(0, left - 1),
        )

    def _beat_since(self, worker_name: str | None, last_beat_s: float) -> bool:
        """Whether the RQ worker identity ``worker_name`` beat after ``last_beat_s`` (a prompt's
        last heartbeat) and has not died: it lives, but no longer runs the prompt (a claim whose
        reply it never got). A killed worker's key outlives its prompts' entries by a moment, with
        the ``last_heartbeat`` of their last renewal."""
        if not worker_name:
            return False
        key = f"{BaseWorker.redis_worker_namespace_prefix}{worker_name}"
        last_heartbeat, death = self.redis.hmget(key, ["last_heartbeat", "death"])
        if last_heartbeat is None or death is not None:
            return False
        return utcparse(as_text(last_heartbeat)).timestamp() > last_beat_s + LATER_BEAT_S

    def _reconcile_failed(self, queue: Queue, result: ReapResult) -> None:
        """Count prompts that RQ's own cleanup failed as abandoned; they are still 'running' for us."""
        for rq_id in as_texts(self.redis.zrevrange(queue.failed_job_registry.key, 0, RECONCILE_SCAN - 1)):
            job_id = self.keys.job_of_rq_id(rq_id)
            if job_id is None or not self.redis.sismember(self.keys.job_running(job_id), rq_id):
                continue
            message = "abandoned by a dead worker and failed by RQ's registry cleanup (max_worker_losses)"
            unknown = parse_payload(None)
            with self.redis.pipeline() as pipe:
                report = failure_report(rq_id, unknown, reason=WORKER_LOST, message=message)
                self.jobs.outcomes.count_failed(pipe, job_id, rq_id, report, **unknown.labels.kwargs())
                pipe.execute()
            result.failed += 1
