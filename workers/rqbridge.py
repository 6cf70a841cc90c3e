"""RQ bookkeeping for prompts run as asyncio tasks.

RQ 2.x runs one job per worker process. We keep RQ's queues, registries and job hashes (so
``rq info`` and rq-dashboard stay true) and reuse its own transitions, from a subclass of
``BaseWorker`` that never calls ``work()``: one identity per queue, because RQ's
intermediate-list bookkeeping assumes a single-queue worker (RQ 2.12 removes a taken job from its
queue's intermediate list only when ``len(worker.queues) == 1``, in ``rq/worker/base.py``).

Everything here is synchronous and is called from the event loop with no ``await`` between
setting ``self.execution`` and the RQ call that reads it, since RQ keeps one current execution
per worker object.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from redis import Redis
from redis.client import Pipeline
from rq import Queue
from rq.exceptions import NoSuchJobError
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer
from rq.utils import now
from rq.worker import BaseWorker, WorkerStatus
from rq.worker_registration import clean_worker_registry

from datagen.dispatch import Dispatch
from datagen.states import PromptClass

__all__ = ["InFlight", "QueueIdentity", "fail_job", "payload_of"]

log = logging.getLogger(__name__)

# Grace added to heartbeat TTLs so that a busy event loop is not mistaken for a dead worker.
HEARTBEAT_GRACE_S = 10
HEARTBEATS_PER_TTL = 3

FinishHook = Callable[[Pipeline], None]

# KEYS: an RQ job hash. Deletes it only if it is a heartbeat's remnant (no status: RQ never saved it).
_DROP_REMNANT = """
if redis.call('HEXISTS', KEYS[1], 'status') == 0 then return redis.call('DEL', KEYS[1]) end
return 0
"""


@dataclass(eq=False)
class InFlight:
    job: Job
    queue: Queue
    execution: Execution


class QueueIdentity(BaseWorker):
    """The RQ worker identity for one queue of a datagen worker process."""

    def __init__(self, queue_name: str, name: str, connection: Redis, heartbeat_interval_s: float) -> None:
        self._ttl_s = int(heartbeat_interval_s * HEARTBEATS_PER_TTL) + HEARTBEAT_GRACE_S
        super().__init__(
            [queue_name],
            name=name,
            connection=connection,
            serializer=JSONSerializer,
            worker_ttl=self._ttl_s,
            job_monitoring_interval=max(1, int(heartbeat_interval_s)),
        )
        self._finish_hook: FinishHook | None = None
        self.in_flight: set[InFlight] = set()
        self._drop_remnant = connection.register_script(_DROP_REMNANT)

    @property
    def queue(self) -> Queue:
        return self.queues[0]

    # RQ hooks -----------------------------------------------------------------------------------
    def get_heartbeat_ttl(self, job: Job) -> int:
        # The task heartbeats every job it runs, so the TTL need not cover the job's timeout.
        return self._ttl_s

    def increment_successful_job_count(self, pipeline: Pipeline | None = None) -> None:
        super().increment_successful_job_count(pipeline)
        if self._finish_hook is not None and pipeline is not None:
            self._finish_hook(pipeline)

    def clean_registries(self) -> None:
        """RQ's maintenance, minus the started registry and the intermediate list.

        Those belong to :mod:`workers.reaper`: RQ's own cleanup would mark a dead worker's prompts
        failed (no RQ retries are configured) instead of handing them back.
        """
        for queue in self.queues:
            if queue.acquire_maintenance_lock():
                for registry in (
                    queue.finished_job_registry,
                    queue.failed_job_registry,
                    queue.deferred_job_registry,
                ):
                    registry.cleanup()
                clean_worker_registry(queue)
                queue.release_maintenance_lock()
        self.last_cleaned_at = now()  # type: ignore[assignment]  # RQ annotates it as None

    # Lifecycle ----------------------------------------------------------------------------------
    def register(self) -> None:
        self.register_birth()
        self.set_state(WorkerStatus.IDLE)

    def unregister(self) -> None:
        self.register_death()

    # Jobs ---------------------------------------------------------------------------------------
    def claim(self, dispatch: Dispatch, cls: PromptClass) -> InFlight | None:
        """Move the next prompt due (:mod:`datagen.dispatch`) into started; never blocks."""
        queue = self.queue
        while True:
            rq_id = dispatch.claim(cls, queue.key, queue.intermediate_queue_key)
            if rq_id is None:
                return None
            try:
                job = self.job_class.fetch(rq_id, connection=self.connection, serializer=self.serializer)
            except NoSuchJobError:
                # Deleted meanwhile (its job was cancelled or deleted): nothing to run.
                self.connection.lrem(queue.intermediate_queue_key, 1, rq_id)
                continue
            break
        execution = self.prepare_execution(job)
        self.prepare_job_execution(job, remove_from_intermediate_queue=True)
        item = InFlight(job, queue, execution)
        self.in_flight.add(item)
        return item

    def finish_success(self, item: InFlight, hook: FinishHook) -> None:
        """Finish the job; ``hook`` adds our own counters to RQ's transaction."""
        item.job.ended_at = now()
        item.job._status = JobStatus.FINISHED
        self.execution = item.execution
        self._finish_hook = hook
        try:
            self.handle_job_success(item.job, item.queue, item.queue.started_job_registry)
        finally:
            self._finish_hook = None
            self.in_flight.discard(item)

    def finish_failure(self, item: InFlight, message: str, hook: FinishHook | None) -> None:
        """Put the job in RQ's failed registry with ``message`` as its exception text.

        Not ``handle_job_failure``: that would spend the job's RQ retries, which are kept for dead
        workers (``workers/reaper.py``), and it commits in two steps, where our counters must move
        in the same transaction as the failed registry.
        """
        job = item.job
        job.ended_at = now()
        with self.connection.pipeline() as pipe:
            fail_job(job, message, pipe, worker_name=self.name, execution=item.execution)
            item.execution.delete(job, pipe)
            self.increment_failed_job_count(pipe)
            if hook is not None:
                hook(pipe)
            pipe.execute()
        self.in_flight.discard(item)

    def finish_cancelled(self, item: InFlight, hook: FinishHook | None) -> None:
        """An in-flight prompt of a cancelled job, aborted: RQ's canceled registry, no record."""
        job = item.job
        job.ended_at = now()
        with self.connection.pipeline() as pipe:
            item.execution.delete(job, pipe)
            job.set_status(JobStatus.CANCELED, pipeline=pipe)
            item.queue.canceled_job_registry.add(job, pipeline=pipe)
            if hook is not None:
                hook(pipe)
            pipe.execute()
        self.in_flight.discard(item)

    def drop(self, item: InFlight) -> None:
        """Forget a prompt whose datagen job was deleted while it ran: only this run of it goes.
        Its RQ job hash is gone, or belongs to a new job of the same id, and is left alone; but our
        own heartbeats wrote ``last_heartbeat`` into the deleted one, so a hash with nothing else
        (no ``status``) is removed."""
        with self.connection.pipeline() as pipe:
            item.execution.delete(item.job, pipe)
            pipe.execute()
        self._drop_remnant(keys=[item.job.key])
        self.in_flight.discard(item)

    def hand_back(self, item: InFlight, hook: FinishHook | None) -> None:
        """Return an unfinished job to the front of its queue without charging an attempt."""
        with self.connection.pipeline() as pipe:
            item.execution.delete(item.job, pipe)
            item.job.set_status(JobStatus.QUEUED, pipeline=pipe)
            item.queue.push_job_id(item.job.id, pipeline=pipe, at_front=True)
            if hook is not None:
                hook(pipe)
            pipe.execute()
        self.in_flight.discard(item)

    def beat(self) -> None:
        """One heartbeat for the identity and every job it runs, in one round trip."""
        ttl = self._ttl_s
        with self.connection.pipeline() as pipe:
            self.heartbeat(ttl, pipeline=pipe)
            for item in self.in_flight:
                item.execution.heartbeat(item.queue.started_job_registry, ttl, pipeline=pipe)
                item.job.heartbeat(now(), ttl, pipeline=pipe, xx=True)
            pipe.execute()
        self.set_state(WorkerStatus.BUSY if self.in_flight else WorkerStatus.IDLE)
        if self.should_run_maintenance_tasks:
            self.run_maintenance_tasks()


def fail_job(
    job: Job, message: str, pipe: Pipeline, *, worker_name: str, execution: Execution | None = None
) -> None:
    """Mark ``job`` failed and put it in RQ's failed registry with ``message`` as its exception text
    (and an RQ result saying so), in ``pipe``; ``execution`` is the run that failed, if one is known.

    RQ's own transition, without spending the job's RQ retries (``Job.handle_failure`` would).
    """
    job.set_status(JobStatus.FAILED, pipeline=pipe)
    if execution is None:
        job._handle_failure(message, pipe, worker_name=worker_name)
        return
    job._handle_failure(
        message,
        pipe,
        worker_name=worker_name,
        execution_id=execution.id,
        execution_started_at=execution.created_at,
        execution_ended_at=job.ended_at,
    )


def payload_of(job: Job) -> dict[str, Any] | None:
    """The prompt payload dict of a datagen RQ job, or None for anything else."""
    payload = job.args[0] if job.args else None
    return payload if isinstance(payload, dict) else None
