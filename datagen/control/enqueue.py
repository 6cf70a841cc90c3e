"""Putting prompts on the RQ queues, by way of each job's backlog: shared by ingestion
(coordinator) and by workers, which enqueue turn k+1 of a multi-turn ``all`` conversation
when turn k is committed.

Every enqueue is guarded, because RQ itself accepts a second enqueue of the same job id: an
ingestion chunk's prompts by the job's rows guard, written in the same script that saves them
(`datagen.control.ingest_chunks`, from the hashes `queued_jobs` computes); a next turn by its key
in the job's ``enqueued`` set, added by the script that counts its turn done
(``ack_next_turn.lua``, from the fields `queued_job_fields` computes).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rq import Queue, Retry
from rq.job import Job, JobStatus
from rq.utils import now

from datagen.control.job_outcomes import QueuedTurn
from datagen.control.keys import Keys, prompt_key
from datagen.control.payload import PromptPayload
from datagen.control.rq_format import ENQUEUE, SERIALIZER, QueuedJobs
from datagen.settings import DEFAULT_FAILURE_TTL_S, DEFAULT_MAX_WORKER_LOSSES, DEFAULT_RESULT_TTL_S
from datagen.states import Priority, PromptClass

__all__ = [
    "JOB_TIMEOUT_S",
    "RAW_DATA_BYTES",
    "RQ_JOB_FUNC",
    "EnqueueOptions",
    "queued_job_fields",
    "queued_jobs",
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


def queued_jobs(
    queue: Queue, keys: Keys, payloads: Sequence[PromptPayload], options: EnqueueOptions, at: str
) -> QueuedJobs:
    """The RQ jobs of ``payloads`` (one class, queued on ``queue``) as ``backlog_add.lua`` saves
    them: the hash RQ's ``Queue.create_job`` and ``Job.save`` would write, ``at`` its creation and
    enqueue time. What every prompt shares comes from RQ's own ``Job.to_dict`` once per queue and
    options (`_shared_fields`); each prompt adds its description and data, serialized as RQ does,
    compressed only when long and then faster (`compressed`; ``tests/datagen/test_enqueue_fields.py``
    holds the two to RQ's whole hash). Building an RQ ``Job`` per prompt and sending its 20 fields
    cost ingestion about 150 µs a prompt."""
    own = tuple(
        (
            keys.rq_job_id(p.job, p.sample_id, p.turn, p.gen),
            _description(p),
            compressed(SERIALIZER.dumps((RQ_JOB_FUNC, None, (p.to_json(),), {}))),
        )
        for p in payloads
    )
    return QueuedJobs(_shared_fields(queue, keys, payloads[0].cls, options, at), own)


# Payloads under this size are stored as they are: zlib saves about a quarter of a chat prompt's
# 280 bytes (70 bytes, 3 % of what Redis holds for a queued prompt) at 16.5 µs a prompt where
# rendering a row took 210 µs, setting up its state most of it: the coordinator's largest cost of
# landing a chunk.
# RQ reads an uncompressed ``data`` as it is (``Job.restore`` falls back to the raw bytes when
# ``zlib.decompress`` fails, which it always does on JSON: ``[`` is no zlib header).
RAW_DATA_BYTES = 1024
# Payloads up to this size are compressed with a small window: zlib's default state (a 32 KiB
# window, memLevel 8) takes about 20 µs to set up, four times what compressing a payload of a few
# KiB takes in a 4 KiB window; longer ones with the default window, at level 1 (at level 6, as RQ's
# ``Job.to_dict`` compresses, a 4,000-token prompt's payload took 980 µs, at level 1 230 µs and
# 5 % larger).
SMALL_DATA_BYTES = 4096
_SMALL_WINDOW_BITS = 12
_SMALL_MEM_LEVEL = 4


def compressed(data: bytes) -> bytes:
    """An RQ job's ``data`` as RQ reads it: as it is under `RAW_DATA_BYTES`, a zlib stream above
    (RQ's ``zlib.decompress`` reads it whatever the level and window it was written with)."""
    if len(data) < RAW_DATA_BYTES:
        return data
    if len(data) > SMALL_DATA_BYTES:
        return zlib.compress(data, 1)
    packer = zlib.compressobj(1, zlib.DEFLATED, _SMALL_WINDOW_BITS, _SMALL_MEM_LEVEL)
    return packer.compress(data) + packer.flush()


# RQ's ``Job.to_dict`` fields that differ between prompts, or between calls (the times).
_OWN_FIELDS = frozenset({"data", "description", "created_at", "enqueued_at"})
_TIMES = ("created_at", "enqueued_at")
_shared: dict[tuple[str, PromptClass, EnqueueOptions], list[str]] = {}


def _shared_fields(queue: Queue, keys: Keys, cls: PromptClass, options: EnqueueOptions, at: str) -> str:
    """RQ's fields of a queued job that every prompt of ``cls`` on ``queue`` with ``options``
    shares, with ``at`` as both times, as a JSON list of field/value strings (Redis's own encoding:
    numbers in decimal, statuses by value). Kept per process; two threads that miss at once compute
    the same list, which is harmless."""
    key = (queue.name, cls, options)
    pairs = _shared.get(key)
    if pairs is None:
        probe = PromptPayload(
            job="", sample_id="", turn=0, gen=0, cls=cls, prompt_ids=[], max_new_tokens=0, partition=""
        )
        fields = _queued_job(queue, _job_data(keys, probe, options)).to_dict()
        pairs = _shared[key] = [
            text for name, value in fields.items() if name not in _OWN_FIELDS for text in (name, _text(value))
        ]
    return json.dumps([*pairs, *(text for name in _TIMES for text in (name, at))])


def _text(value: Any) -> str:
    """A hash value as redis-py sends it, as text."""
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise TypeError(f"RQ job field of unexpected type {type(value).__name__}")
    if isinstance(value, str):
        return str.__str__(value)
    return repr(value)


def _description(payload: PromptPayload) -> str:
    return f"{payload.job} {payload.sample_id} t{payload.turn} g{payload.gen}"


def queued_job_fields(
    queue: Queue, keys: Keys, payload: PromptPayload, options: EnqueueOptions
) -> tuple[str, dict[str, Any]]:
    """The RQ id and the hash fields that ingestion saves for ``payload`` (`queued_jobs`), for a
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
        description=_description(payload),
        retry=Retry(max=options.max_worker_losses),
        meta={ENQUEUE: options.to_meta()},
    )
