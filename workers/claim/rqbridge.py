"""RQ bookkeeping for prompts run as asyncio tasks.

RQ 2.x runs one job per worker process. We keep RQ's queues, registries and job hashes (so
``rq info`` and rq-dashboard stay true) from a subclass of ``BaseWorker`` that never calls
``work()``, one identity per queue. The common path is batched in our own scripts, which write
what RQ's worker would: a claim starts up to N prompts at once (`datagen.control.dispatch`), and the
prompts of a committed shard finish at once (`workers.run.finish.Acks`); one heartbeat per identity renews
all of its started-registry entries. The rare paths (failure, cancel, hand back) use RQ's own
transitions. RQ's execution hashes are not written: a started-registry member is
``<rq id>:<execution id>`` as RQ's, and the execution id names the worker process.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from redis import Redis
from redis.client import Pipeline
from rq import Queue
from rq.job import Job, JobStatus
from rq.utils import now
from rq.worker import BaseWorker, WorkerStatus
from rq.worker_registration import clean_worker_registry

from datagen.control.dispatch import Claimant, Dispatch
from datagen.control.jobs import AckTarget, RunFacts
from datagen.control.payload import parse_payload
from datagen.control.rq_format import META, RETRIES_LEFT, SERIALIZER, failure_meta, started_member
from datagen.control.scripts import KEY, LuaScript, ScriptArgs
from datagen.states import PromptClass

__all__ = [
    "InFlight",
    "QueueIdentity",
    "fail_job",
    "heartbeat_ttl_s",
    "refuse_stock_rq_worker",
    "requeue_at_front",
]

log = logging.getLogger(__name__)

# Grace added to heartbeat TTLs so that a busy event loop is not mistaken for a dead worker.
HEARTBEAT_GRACE_S = 10
HEARTBEATS_PER_TTL = 3

FinishHook = Callable[[Pipeline], None]


def refuse_stock_rq_worker(payload: dict[str, Any]) -> None:
    """The function every prompt's RQ job names (`datagen.control.enqueue.RQ_JOB_FUNC`).

    The datagen worker reads the payload and never calls it; a stock ``rq worker`` pointed at our
    queues would, and fails loudly instead of generating without group commit and retries."""
    parsed = parse_payload(payload)
    raise RuntimeError(
        "datagen prompt jobs must be run by `datagen worker`, not by a stock `rq worker` "
        f"(job {parsed.job!r}, sample {parsed.sample_id!r})"
    )


def heartbeat_ttl_s(heartbeat_interval_s: float) -> int:
    """How long a heartbeat (of an identity, and of the prompts it runs) holds: three intervals
    plus the grace."""
    return int(heartbeat_interval_s * HEARTBEATS_PER_TTL) + HEARTBEAT_GRACE_S


@dataclass(frozen=True)
class DropRemnantArgs(ScriptArgs):
    script = "drop_remnant"
    package = "workers.claim"
    rq_job_key: str = field(metadata=KEY)


@dataclass(eq=False)
class InFlight:
    job: Job
    queue: Queue
    # The prompt's started-registry member, ``<rq id>:<execution id>``.
    member: str


class QueueIdentity(BaseWorker):
    """The RQ worker identity for one queue of a datagen worker process."""

    def __init__(
        self,
        queue_name: str,
        name: str,
        connection: Redis,
        heartbeat_interval_s: float,
        execution_id: str | None = None,
        wake: tuple[str, str] | None = None,
    ) -> None:
        self._ttl_s = heartbeat_ttl_s(heartbeat_interval_s)
        # Names the worker process in its started-registry members (no ``:``: RQ splits on it).
        self.execution_id = (execution_id or name).replace(":", "-")
        super().__init__(
            [queue_name],
            name=name,
            connection=connection,
            serializer=SERIALIZER,
            worker_ttl=self._ttl_s,
            job_monitoring_interval=max(1, int(heartbeat_interval_s)),
        )
        self.in_flight: set[InFlight] = set()
        self._shown_state: str | None = None
        # The wake channel and this queue's class, published when a prompt is handed back.
        self.wake_channel, self.cls_value = wake or ("", "")
        self._drop_remnant = LuaScript(connection, DropRemnantArgs)

    @property
    def queue(self) -> Queue:
        return self.queues[0]

    # RQ hooks -----------------------------------------------------------------------------------
    def get_heartbeat_ttl(self, job: Job) -> int:
        # The task heartbeats every job it runs, so the TTL need not cover the job's timeout.
        return self._ttl_s

    def clean_registries(self) -> None:
        """RQ's maintenance, minus the started registry and the intermediate list.

        Those belong to :mod:`workers.claim.reaper`: RQ's own cleanup would mark a dead worker's prompts
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
        self._shown_state = WorkerStatus.IDLE

    def unregister(self) -> None:
        self.register_death()

    # Jobs ---------------------------------------------------------------------------------------
    @functools.cached_property
    def claimant(self) -> Claimant:
        queue = self.queue
        return Claimant(
            queue_key=queue.key,
            started_key=queue.started_job_registry.key,
            worker_name=self.name,
            execution_id=self.execution_id,
            ttl_s=self._ttl_s,
        )

    @functools.cached_property
    def ack_target(self) -> AckTarget:
        queue = self.queue
        return AckTarget(
            started_key=queue.started_job_registry.key,
            finished_key=queue.finished_job_registry.key,
            execution_id=self.execution_id,
        )

    def claim_many(
        self,
        dispatch: Dispatch,
        cls: PromptClass,
        n: int,
        *,
        skip: Collection[str] = (),
        known: Collection[str] = (),
        learn: Callable[[str, RunFacts], None] | None = None,
    ) -> list[InFlight]:
        """Start up to ``n`` prompts due (:mod:`datagen.control.dispatch`), none of the jobs in ``skip``
        (``learn`` told the run facts of the jobs outside ``known`` it starts prompts of); never blocks."""
        queue = self.queue
        items = []
        for claimed in dispatch.claim_many(cls, n, self.claimant, skip=skip, known=known, learn=learn):
            job = self.job_class(claimed.rq_id, connection=self.connection, serializer=self.serializer)
            job.restore(claimed.fields)
            # What the claim script wrote, as RQ's prepare_for_execution sets it on its object.
            job._status = JobStatus.STARTED
            job.worker_name = self.name
            job.started_at = job.last_heartbeat = claimed.started_at
            item = InFlight(job, queue, started_member(claimed.rq_id, self.execution_id))
            self.in_flight.add(item)
            items.append(item)
        return items

    def claim(self, dispatch: Dispatch, cls: PromptClass) -> InFlight | None:
        """Start the next prompt due, if any."""
        items = self.claim_many(dispatch, cls, 1)
        return items[0] if items else None

    def forget(self, items: list[InFlight]) -> None:
        """Forget prompts that finished (their ack is in Redis): no more heartbeats for them."""
        for item in items:
            self.in_flight.discard(item)

    def finish_failure(
        self, item: InFlight, message: str, hook: FinishHook | None, *, reason: str | None = None
    ) -> None:
        """Put the job in RQ's failed registry with ``message`` as its exception text, and
        ``reason`` (what ``datagen retry --reason`` filters on) in its meta.

        Not ``handle_job_failure``: that would spend the job's RQ retries, which are kept for dead
        workers (``workers/claim/reaper.py``), and it commits in two steps, where our counters must move
        in the same transaction as the failed registry.
        """
        job = item.job
        job.ended_at = now()
        with self.connection.pipeline() as pipe:
            if reason is not None:
                pipe.hset(job.key, META, failure_meta(job, reason))
            fail_job(job, message, pipe, worker_name=self.name)
            pipe.zrem(item.queue.started_job_registry.key, item.member)
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
            pipe.zrem(item.queue.started_job_registry.key, item.member)
            job.set_status(JobStatus.CANCELED, pipeline=pipe)
            item.queue.canceled_job_registry.add(job, pipeline=pipe)
            if hook is not None:
                hook(pipe)
            pipe.execute()
        self.in_flight.discard(item)

    def drop(self, item: InFlight) -> None:
        """Forget a prompt whose datagen job was deleted while it ran: only this run of it goes.
        Its RQ job hash is gone, or belongs to a new job of the same id, and is left alone; but the
        claim wrote its start into the deleted one, so a hash with no ``data`` (a remnant) goes."""
        self.connection.zrem(item.queue.started_job_registry.key, item.member)
        self._drop_remnant(DropRemnantArgs(rq_job_key=item.job.key))
        self.in_flight.discard(item)

    def hand_back(self, item: InFlight, hook: FinishHook | None) -> None:
        """Return an unfinished job to the front of its queue without charging an attempt."""
        with self.connection.pipeline() as pipe:
            pipe.zrem(item.queue.started_job_registry.key, item.member)
            requeue_at_front(item.job, item.queue, pipe)
            if self.wake_channel:
                pipe.publish(self.wake_channel, self.cls_value)
            if hook is not None:
                hook(pipe)
            pipe.execute()
        self.in_flight.discard(item)

    def beat(self) -> None:
        """One heartbeat for the identity and every prompt it runs, in one round trip: one ZADD
        renews all of their started-registry entries."""
        ttl = self._ttl_s
        with self.connection.pipeline(transaction=False) as pipe:
            self.heartbeat(ttl, pipeline=pipe)
            if self.in_flight:
                expiry = now().timestamp() + ttl
                pipe.zadd(
                    self.queue.started_job_registry.key,
                    dict.fromkeys((item.member for item in self.in_flight), expiry),
                    xx=True,
                )
            pipe.execute()
        state = WorkerStatus.BUSY if self.in_flight else WorkerStatus.IDLE
        if state != self._shown_state:
            self.set_state(state)
            self._shown_state = state
        if self.should_run_maintenance_tasks:
            self.run_maintenance_tasks()


def fail_job(job: Job, message: str, pipe: Pipeline, *, worker_name: str) -> None:
    """Mark ``job`` failed and put it in RQ's failed registry with ``message`` as its exception text
    (and an RQ result saying so), in ``pipe``.

    RQ's own transition, without spending the job's RQ retries (``Job.handle_failure`` would).
    """
    job.set_status(JobStatus.FAILED, pipeline=pipe)
    job._handle_failure(message, pipe, worker_name=worker_name)


def requeue_at_front(job: Job, queue: Queue, pipe: Pipeline, *, retries_left: int | None = None) -> None:
    """Queue ``job`` again at the front of ``queue``, in ``pipe``: a prompt handed back, or a dead
    worker's requeued by the reaper (``retries_left``: its worker-loss budget now, None to keep it)."""
    if retries_left is not None:
        pipe.hset(job.key, RETRIES_LEFT, retries_left)
    job.set_status(JobStatus.QUEUED, pipeline=pipe)
    queue.push_job_id(job.id, pipeline=pipe, at_front=True)
