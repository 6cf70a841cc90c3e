"""Putting prompts on the RQ queues, by way of each job's backlog: shared by ingestion
(coordinator) and by workers, which enqueue turn k+1 of a multi-turn ``all`` conversation
when turn k is committed.

Every enqueue goes into the caller's transaction together with the prompts' keys in the job's
``enqueued`` set, which is what keeps a prompt from being enqueued twice (RQ itself accepts a
second enqueue of the same job id). A worker's next turn is saved by the script that counts its
turn done (``ack_next_turn.lua``), from the fields `queued_job_fields` computes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from redis.client import Pipeline
from rq import Queue, Retry
from rq.job import Job, JobStatus
from rq.utils import now

from datagen.control.dispatch import Dispatch
from datagen.control.job_outcomes import QueuedTurn
from datagen.control.keys import Keys, prompt_key
from datagen.control.payload import PromptPayload
from datagen.control.rq_format import ENQUEUE
from datagen.settings import DEFAULT_FAILURE_TTL_S, DEFAULT_MAX_WORKER_LOSSES, DEFAULT_RESULT_TTL_S
from datagen.states import Priority, PromptClass

__all__ = [
    "JOB_TIMEOUT_S",
    "RQ_JOB_FUNC",
    "EnqueueOptions",
    "enqueue_prompts",
    "queued_job_fields",
    "queued_turn",
    "stored_options",
    "stored_worker_losses",
]

# Dotted path stored in each RQ job. Only the datagen worker runs these jobs (it reads the payload
# itself); the coordinator never imports the workers package, so the path is a string.
RQ_JOB_FUNC = "workers.claim.rqbridge.refuse_stock_rq_worker"
# RQ's job timeout; the worker enforces per-request read timeouts itself, so these only bound how
# long RQ considers a started job plausible.
JOB_TIMEOUT_S = {PromptClass.SHORT: 6 * 3600, PromptClass.LONG: 24 * 3600}


@dataclass(frozen=True)
class EnqueueOptions:
    """The coordinator's settings for the RQ jobs of its prompts, kept in each job's ``meta``
    (`datagen.control.rq_format.ENQUEUE`) so that a worker enqueues next turns and a retry restores
    budgets by them (`stored_options`, `stored_worker_losses`)."""

    result_ttl_s: int
    failure_ttl_s: int
    # RQ retries are spent only when a worker dies with the prompt (see workers/claim/reaper.py).
    max_worker_losses: int

    def to_meta(self) -> dict[str, int]:
        return {
            "result_ttl_s": self.result_ttl_s,
            "failure_ttl_s": self.failure_ttl_s,
            "max_worker_losses": self.max_worker_losses,
        }


def stored_options(job: Job) -> EnqueueOptions:
    """The enqueue settings ``job`` was made with (RQ's own fields, then the defaults, for a job
    whose meta has none)."""
    stored = job.meta.get(ENQUEUE) or {}
    return EnqueueOptions(
        result_ttl_s=int(stored.get("result_ttl_s", job.result_ttl or DEFAULT_RESULT_TTL_S)),
        failure_ttl_s=int(stored.get("failure_ttl_s", job.failure_ttl or DEFAULT_FAILURE_TTL_S)),
        max_worker_losses=int(stored.get("max_worker_losses", DEFAULT_MAX_WORKER_LOSSES)),
    )


def stored_worker_losses(meta: dict[str, Any]) -> int | None:
    """The worker-loss budget a job's ``meta`` says it was made with (None: it does not say)."""
    losses = (meta.get(ENQUEUE) or {}).get("max_worker_losses")
    return None if losses is None else int(losses)


def enqueue_prompts(
    pipe: Pipeline,
    queues: Mapping[PromptClass, Queue],
    keys: Keys,
    job_id: str,
    payloads: Sequence[PromptPayload],
    options: EnqueueOptions,
    *,
    dispatch: Dispatch,
    priority: Priority,
    guard: bool = True,
) -> None:
    """Add RQ jobs for ``payloads`` (not yet enqueued: the caller checked) to ``pipe``.

    The RQ jobs are saved as queued on their class's queue, but their ids wait in the job's
    backlog until a worker's claim dispatches them (:mod:`datagen.control.dispatch`). ``guard=False`` leaves
    the prompts out of the ``enqueued`` set: ingestion guards its rows by the job's rows hash
    instead (one entry per row, written in the same transaction; `service.rowids`), which costs
    Redis one entry per row rather than one more per prompt.
    """
    for cls, queue in queues.items():
        datas = [_job_data(keys, p, options) for p in payloads if p.cls is cls]
        if not datas:
            continue
        pipe.sadd(queue.redis_queues_keys, queue.key)
        ids = []
        for data in datas:
            job = _queued_job(queue, data)
            job.save(pipeline=pipe)
            ids.append(job.id)
        dispatch.add(pipe, job_id, cls, priority, ids)
    if payloads and guard:
        pipe.sadd(keys.job_enqueued(job_id), *[prompt_key(p.sample_id, p.turn, p.gen) for p in payloads])


def queued_job_fields(
    queue: Queue, keys: Keys, payload: PromptPayload, options: EnqueueOptions
) -> tuple[str, dict[str, Any]]:
    """The RQ id and the hash fields that :func:`enqueue_prompts` saves for ``payload``, for a
    script that saves them only on a condition (a next turn: ``ack_next_turn.lua``)."""
    job = _queued_job(queue, _job_data(keys, payload, options))
    return job.id, job.to_dict()


def queued_turn(
    queue: Queue, keys: Keys, payload: PromptPayload, *, priority: Priority, after: Job
) -> QueuedTurn:
    """Multi-turn ``all`` mode: the next turn ``payload`` as the ack of the turn before it
    (``after``, whose enqueue settings it keeps) enqueues it (`JobOutcomes.ack_next_turn`)."""
    rq_id, fields = queued_job_fields(queue, keys, payload, stored_options(after))
    return QueuedTurn(
        rq_id=rq_id,
        fields=fields,
        member=prompt_key(payload.sample_id, payload.turn, payload.gen),
        cls=payload.cls,
        priority=priority,
        prompt_tokens=len(payload.prompt_ids),
        queue_key=queue.key,
        queues_key=queue.redis_queues_keys,
    )


def _queued_job(queue: Queue, data: Any) -> Job:
    """An RQ job as RQ's ``Queue.enqueue`` makes it, queued on ``queue`` (not yet saved)."""
    job = queue.create_job(
        data.func,
        args=data.args,
        timeout=data.timeout,
        result_ttl=data.result_ttl,
        failure_ttl=data.failure_ttl,
        description=data.description,
        job_id=data.job_id,
        meta=data.meta,
        retry=data.retry,
        status=JobStatus.QUEUED,
    )
    job.origin = queue.name
    job.enqueued_at = now()
    return job


def _job_data(keys: Keys, payload: PromptPayload, options: EnqueueOptions) -> Any:
    return Queue.prepare_data(
        RQ_JOB_FUNC,
        args=(payload.to_json(),),
        job_id=keys.rq_job_id(payload.job, payload.sample_id, payload.turn, payload.gen),
        timeout=JOB_TIMEOUT_S[payload.cls],
        result_ttl=options.result_ttl_s,
        failure_ttl=options.failure_ttl_s,
        description=f"{payload.job} {payload.sample_id} t{payload.turn} g{payload.gen}",
        retry=Retry(max=options.max_worker_losses),
        meta={ENQUEUE: options.to_meta()},
    )
