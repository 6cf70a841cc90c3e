"""One job's prompts in RQ's own keys, for the operator's controls (`service.lifecycle`): its
failed prompts (read, and put back for a retry), its prompts waiting on RQ's queue lists (dropped
by a cancel), and everything RQ and Redis hold of it (forgotten by a delete or a rebuild).

RQ's keys are shared by every job, so each control scans them for the job's RQ ids (they all start
with `Keys.rq_job_prefix`); the writes go through the job's scripts and counters
(`JobOutcomes.requeue_failed`, `JobOutcomes.count_cancelled_queued`), as the workers' do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from redis import Redis
from rq import Queue
from rq.job import Job

from datagen.control.enqueue import stored_worker_losses
from datagen.control.jobs import JobStore, RequeueItem
from datagen.control.keys import Keys, partition_label
from datagen.control.payload import parse_payload
from datagen.control.redistext import as_text, as_texts
from datagen.control.rq_format import (
    FAILURE_REASON,
    JOB_KEY_PREFIX,
    RESULTS_KEY_PREFIX,
    SERIALIZER,
    payload_of,
    queues,
    requeue_meta,
)
from datagen.states import Priority, PromptClass

__all__ = ["FailedPrompt", "RqJobs"]

# Keys per SCAN step when looking for a job's RQ hashes.
SCAN_COUNT = 1000
# The failure reason of a prompt neither its meta nor its failure report names.
UNKNOWN_REASON = "unknown"


@dataclass(frozen=True)
class FailedPrompt:
    """A prompt in RQ's failed registry of its class: its RQ job, why it failed, and where it
    counted (partition label, class)."""

    job: Job
    cls: PromptClass
    reason: str
    label: str


class RqJobs:
    def __init__(self, redis: Redis, keys: Keys, jobs: JobStore) -> None:
        self.redis = redis
        self.keys = keys
        self.jobs = jobs
        self.queues = queues(redis, keys)

    # Retry ---------------------------------------------------------------------------------------
    def failed(self, job_id: str) -> list[FailedPrompt]:
        """The job's prompts still in RQ's failed registries."""
        prefix = self.keys.rq_job_prefix(job_id)
        labelled = set(as_texts(self.redis.smembers(self.keys.job_partitions(job_id))))
        reported = self.jobs.outcomes.failure_reasons(job_id)
        out: list[FailedPrompt] = []
        for cls, queue in self.queues.items():
            ids = [i for i in queue.failed_job_registry.get_job_ids() if i.startswith(prefix)]
            for rq_job in Job.fetch_many(ids, connection=self.redis, serializer=SERIALIZER):
                if rq_job is None:
                    continue
                labels = parse_payload(payload_of(rq_job)).labels
                reason = str(rq_job.meta.get(FAILURE_REASON) or reported.get(rq_job.id, UNKNOWN_REASON))
                out.append(FailedPrompt(rq_job, cls, reason, partition_label(labels.partition, labelled)))
        return out

    def requeue(self, job_id: str, prompts: Sequence[FailedPrompt], priority: Priority) -> list[str]:
        """Put failed prompts back in the job's backlogs with fresh attempts and their worker-loss
        budget restored, class by class, each only if this call takes it out of the failed registry
        (`JobOutcomes.requeue_failed`); returns the ids that moved."""
        moved: list[str] = []
        for cls in PromptClass:
            items = [
                RequeueItem(
                    p.job.id, requeue_meta(p.job.meta), stored_worker_losses(p.job.meta), p.label, cls.value
                )
                for p in prompts
                if p.cls is cls
            ]
            if not items:
                continue
            registry = self.queues[cls].failed_job_registry.key
            moved += self.jobs.outcomes.requeue_failed(
                job_id, cls, priority, registry_key=registry, items=items
            )
        return moved

    # Cancel --------------------------------------------------------------------------------------
    def drop_queued(self, job_id: str) -> int:
        """Drop the job's prompts on RQ's queue lists (handed back, or requeued by the reaper),
        counting each cancelled; returns how many."""
        prefix = self.keys.rq_job_prefix(job_id)
        dropped = 0
        for cls, queue in self.queues.items():
            for rq_id in as_texts(self.redis.lrange(queue.key, 0, -1)):
                if rq_id.startswith(prefix) and self.redis.lrem(queue.key, 1, rq_id):
                    with self.redis.pipeline() as pipe:
                        pipe.unlink(JOB_KEY_PREFIX + rq_id)
                        self.jobs.outcomes.count_cancelled_queued(pipe, job_id, cls, 1)
                        pipe.execute()
                    dropped += 1
        return dropped

    # Forget --------------------------------------------------------------------------------------
    def forget(self, job_id: str, *, keep_hash: bool = False) -> int:
        """Remove everything Redis holds of the job (its keys, RQ jobs, places in dispatch); returns
        how many RQ jobs went. ``keep_hash``: the job's hash stays (a rebuild replaces it in one
        step, so the job is never missing)."""
        rq_jobs = self.delete(job_id)
        self.jobs.forget_keys(job_id, keep_hash=keep_hash)
        # A worker's ack that landed after the first sweep and before the job's keys went finished
        # its prompt in RQ (a hash and a finished-registry entry, kept for the result TTL). Acks
        # count only prompts still in the job's running set, which is gone now: this sweep is the last.
        return rq_jobs + self.delete(job_id)

    def delete(self, job_id: str) -> int:
        """One sweep: the job's RQ ids out of every registry and queue list, and its RQ hashes (with
        their results) deleted; returns how many hashes went."""
        prefix = self.keys.rq_job_prefix(job_id)
        for queue in self.queues.values():
            self._unregister(queue, prefix)
        deleted = 0
        for key in self.redis.scan_iter(match=f"{JOB_KEY_PREFIX}{prefix}*", count=SCAN_COUNT):
            rq_id = as_text(key)[len(JOB_KEY_PREFIX) :]
            if ":" in rq_id:  # a sub-key (dependents), not a job hash
                self.redis.unlink(key)
                continue
            self.redis.unlink(key, RESULTS_KEY_PREFIX + rq_id)
            deleted += 1
        return deleted

    def _unregister(self, queue: Queue, prefix: str) -> None:
        for registry in (
            queue.finished_job_registry,
            queue.failed_job_registry,
            queue.started_job_registry,
            queue.canceled_job_registry,
        ):
            members = [m for m in as_texts(self.redis.zrange(registry.key, 0, -1)) if m.startswith(prefix)]
            if members:
                self.redis.zrem(registry.key, *members)
        for rq_id in as_texts(self.redis.lrange(queue.key, 0, -1)):
            if rq_id.startswith(prefix):
                self.redis.lrem(queue.key, 0, rq_id)
