"""RQ's stored format, as this project writes it: the one module the writers of RQ's job hashes take
it from (the list of writers is in docs/architecture.md, "Who writes RQ's job hashes").

RQ's own API writes most of it (`Queue.create_job` and `Job.save`, `set_status`, the registries);
our scripts write the rest where one atomic step must also move our own keys (a claim, an ack, a
retry). What they write is RQ's format, named here: the key prefixes, the serializer, the hash fields
and the statuses each script writes (`SCRIPT_WRITES`, which ``tests/datagen/test_lua_files.py``
holds the scripts to), RQ's time format, the started-registry member, the payload's place in the job,
and the ``meta`` keys datagen keeps on its prompts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from redis import Redis
from rq import Queue
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer
from rq.utils import now as _rq_now
from rq.utils import utcformat

from datagen.control.keys import Keys
from datagen.states import PromptClass

__all__ = [
    "ATTEMPTS",
    "ENDED_AT",
    "ENQUEUE",
    "FAILURE_REASON",
    "JOB_KEY_PREFIX",
    "LAST_HEARTBEAT",
    "META",
    "RESULTS_KEY_PREFIX",
    "RETRIED",
    "RETRIES_LEFT",
    "SCRIPT_WRITES",
    "SERIALIZER",
    "STARTED_AT",
    "STATUS",
    "WORKER_NAME",
    "QueuedJobs",
    "RqTime",
    "failure_meta",
    "payload_of",
    "queues",
    "register_queues",
    "requeue_meta",
    "rq_id_of_member",
    "rq_now",
    "started_member",
]

# RQ jobs are JSON (no pickle), read and written with this serializer everywhere.
SERIALIZER = JSONSerializer
# ``rq:job:<rq id>``: an RQ job's hash; ``rq:results:<rq id>``: its results stream.
JOB_KEY_PREFIX = Job.redis_job_namespace_prefix
RESULTS_KEY_PREFIX = "rq:results:"

# The fields of an RQ job hash that our scripts write (RQ's names, as `Job.to_dict` writes them).
STATUS = "status"
STARTED_AT = "started_at"
LAST_HEARTBEAT = "last_heartbeat"
WORKER_NAME = "worker_name"
ENDED_AT = "ended_at"
META = "meta"
RETRIES_LEFT = "retries_left"

# What each script writes into RQ job hashes besides RQ's own API: field -> the literal value it
# writes (None: a value of the call's). ``lib`` is ``datagen/control/lua/lib.lua`` (`finish_in_rq`,
# which ``ack_done`` and ``ack_next_turn`` run); ``ack_next_turn`` also saves a next turn's whole
# hash, as `datagen.control.enqueue.queued_job_fields` computed it with RQ's `Job.to_dict`, and
# ``backlog_add`` new prompts' whole hashes (`QueuedJobs`, from `datagen.control.enqueue.queued_jobs`).
SCRIPT_WRITES: Mapping[str, Mapping[str, str | None]] = {
    "claim_many": {
        STATUS: JobStatus.STARTED.value,
        STARTED_AT: None,
        LAST_HEARTBEAT: None,
        WORKER_NAME: None,
    },
    "lib": {STATUS: JobStatus.FINISHED.value, ENDED_AT: None},
    "requeue_failed": {STATUS: JobStatus.QUEUED.value, META: None, RETRIES_LEFT: None},
}

# The keys of an RQ job's ``meta`` that datagen keeps: the coordinator's enqueue settings
# (`datagen.control.enqueue.EnqueueOptions`), the attempts spent in this run of the prompt
# (`workers.run.generate`), the retries an operator asked for, and why the prompt failed (what
# ``datagen retry --reason`` filters on).
ENQUEUE = "enqueue"
ATTEMPTS = "attempts"
RETRIED = "retried"
FAILURE_REASON = "failure_reason"


@dataclass(frozen=True)
class QueuedJobs:
    """Queued RQ jobs as ``backlog_add.lua`` saves them while it appends their ids to a backlog:
    the hash fields they all share (``shared_json``, a JSON list of field/value strings, taken from
    RQ's own ``Job.to_dict``: `datagen.control.enqueue.queued_jobs`), and each one's RQ id,
    ``description`` and ``data`` (RQ's zlib'ed serialized call)."""

    shared_json: str
    own: tuple[tuple[str, str, bytes], ...]


@dataclass(frozen=True)
class RqTime:
    """One moment as RQ stores it: ``text`` in RQ's format (`started_at`, `ended_at`, heartbeats),
    ``s`` in epoch seconds (registry scores)."""

    at: datetime

    @property
    def text(self) -> str:
        return utcformat(self.at)

    @property
    def s(self) -> float:
        return self.at.timestamp()


def rq_now() -> RqTime:
    return RqTime(_rq_now())


def started_member(rq_id: str, execution_id: str) -> str:
    """A started-registry member, ``<rq id>:<execution id>`` as RQ's (no ``:`` in the execution id)."""
    return f"{rq_id}:{execution_id}"


def rq_id_of_member(member: str) -> str:
    """The RQ id of a started-registry member (`started_member`)."""
    return member.split(":", 1)[0]


def queues(redis: Redis, keys: Keys) -> dict[PromptClass, Queue]:
    """The RQ queue of each class, with the JSON serializer."""
    return {cls: Queue(keys.queue_name(cls), connection=redis, serializer=SERIALIZER) for cls in PromptClass}


def register_queues(redis: Redis, keys: Keys) -> None:
    """Name both queues in RQ's set of queues (what ``rq info`` and ``Queue.all`` list): at a
    coordinator's start and after Redis lost its data, not with every chunk. A prompt waits in its
    job's backlog, not on the queue's own list: only RQ's tools read the set."""
    redis.sadd(Queue.redis_queues_keys, *(queue.key for queue in queues(redis, keys).values()))


def payload_of(job: Job) -> dict[str, Any] | None:
    """The prompt payload dict of a datagen RQ job (its one argument), or None for anything else;
    `datagen.control.payload.parse_payload` reads it."""
    payload = job.args[0] if job.args else None
    return payload if isinstance(payload, dict) else None


def requeue_meta(meta: Mapping[str, Any]) -> bytes:
    """A failed prompt's ``meta`` for its retry (``requeue_failed.lua``), serialized: no failure
    reason, no attempts spent, one retry more."""
    fresh = {k: v for k, v in meta.items() if k != FAILURE_REASON}
    fresh[ATTEMPTS] = 0
    fresh[RETRIED] = int(fresh.get(RETRIED, 0)) + 1
    return SERIALIZER.dumps(fresh)


def failure_meta(job: Job, reason: str) -> bytes:
    """The job's ``meta`` with ``reason`` as its failure reason, serialized (also set on ``job``)."""
    job.meta[FAILURE_REASON] = reason
    return SERIALIZER.dumps(job.meta)
