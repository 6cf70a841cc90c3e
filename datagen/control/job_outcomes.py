"""How prompts end, as `datagen.control.jobs.JobStore` records it: a worker counts a committed shard's
prompts done in one script with their RQ bookkeeping (`ack_done`), and a prompt failed or cancelled
inside that prompt's RQ transaction (the count script); either way a prompt finished twice counts
once and a prompt of another incarnation of the job is not counted. A retry puts failed prompts
back, one retry per job at a time and each prompt at most once. Part of `JobStore` (its base
class), kept apart only for size: the job's keys and scripts are JobStore's."""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis import Redis
from redis.client import Pipeline
from redis.commands.core import Script
from rq.job import Job
from rq.utils import now as rq_now
from rq.utils import utcformat

from datagen.control.keys import Keys
from datagen.control.progress import now_ms
from datagen.control.redistext import as_texts
from datagen.errors import JobStateError
from datagen.states import JobState, PromptClass

__all__ = ["COUNT_STATES", "FAILED_REPORTS_CAP", "AckItem", "AckTarget", "JobOutcomes", "RequeueItem"]

FAILED_REPORTS_CAP = 10_000
# The states the count script moves a job between (it completes a running job).
COUNT_STATES = (JobState.RUNNING.value, JobState.COMPLETED.value)
UNKNOWN_PARTITION = "unknown"
# How long a retry may hold the job's retry lock; a crashed coordinator's lock expires by itself.
RETRY_LOCK_TTL_MS = 120_000
# RQ ids per call of the report-forgetting script (Lua's stack limits ARGV).
RETRY_FORGET_SLICE = 5000
RQ_JOB_KEY_PREFIX = Job.redis_job_namespace_prefix


@dataclass(frozen=True)
class RequeueItem:
    """One failed prompt to put back: its RQ id, new RQ meta (serialized), worker-loss budget to
    restore (None: keep), and where it counts (partition label, class)."""

    rq_id: str
    meta: bytes
    retries_left: int | None
    label: str
    cls: str


@dataclass(frozen=True)
class AckItem:
    """One prompt whose record is committed: what RQ and its job's counters need."""

    rq_id: str
    job_id: str
    incarnation: str
    output_tokens: int
    partition: str
    cls: str
    finish: str
    result_ttl_s: int


@dataclass(frozen=True)
class AckTarget:
    """Where a worker's prompts of one class finish in RQ."""

    started_key: str
    finished_key: str
    execution_id: str


class JobOutcomes:
    """JobStore's counting and retrying half (see the module docstring)."""

    redis: Redis
    keys: Keys
    _count_script: Script
    _requeue: Script
    _release: Script
    _forget: Script
    _ack: Script

    # Workers ------------------------------------------------------------------------------------
    # A set of RQ ids rather than a counter: a prompt that is handed back or reaped and then
    # started again must not be counted twice.
    def started(self, job_id: str, rq_id: str) -> None:
        self.redis.sadd(self.keys.job_running(job_id), rq_id)

    def handed_back(self, pipe: Pipeline, job_id: str, rq_id: str) -> None:
        pipe.srem(self.keys.job_running(job_id), rq_id)

    def _count_keys(self, job_id: str) -> list[str]:
        k = self.keys
        return [
            k.job(job_id),
            k.job_running(job_id),
            k.job_failed(job_id),
            k.job_breakdown(job_id),
            k.job_partitions(job_id),
        ]

    def ack_done(
        self, target: AckTarget, items: Sequence[AckItem], *, client: Redis | Pipeline | None = None
    ) -> int:
        """Finish committed prompts in RQ and count them done in their jobs, in one script
        (`datagen.control._ack_script`); returns how many counted (0 inside a pipeline). Safe to repeat:
        a prompt already counted is not counted again."""
        if not items:
            return 0
        keys = self.keys
        at = rq_now()
        args: list[str | int | float] = [
            RQ_JOB_KEY_PREFIX,
            keys.job_key_prefix(),
            keys.running_suffix(),
            keys.breakdown_suffix(),
            keys.partitions_suffix(),
            now_ms(),
            utcformat(at),
            at.timestamp(),
            target.execution_id,
            *COUNT_STATES,
        ]
        for item in items:
            args += [
                item.rq_id,
                item.job_id,
                item.incarnation,
                item.output_tokens,
                item.partition,
                item.cls,
                item.finish,
                item.result_ttl_s,
            ]
        counted = self._ack(keys=[target.started_key, target.finished_key], args=args, client=client)
        return counted if isinstance(counted, int) else 0

    def count_failed(
        self,
        pipe: Pipeline,
        job_id: str,
        rq_id: str,
        report: dict[str, Any],
        *,
        partition: str,
        cls: str,
        incarnation: str = "",
    ) -> None:
        report_json = json.dumps(report, sort_keys=True)
        args: list[str | int] = [
            "failed",
            1,
            0,
            now_ms(),
            rq_id,
            report_json,
            FAILED_REPORTS_CAP,
            partition,
            cls,
            "",
            incarnation,
        ]
        self._count_script(keys=self._count_keys(job_id), args=[*args, *COUNT_STATES], client=pipe)

    def count_cancelled_queued(self, pipe: Pipeline, job_id: str, cls: PromptClass, n: int) -> None:
        """Prompts of a cancelled job dropped before they ran (see scripts.COUNT_CANCELLED_QUEUED)."""
        pipe.hincrby(self.keys.job(job_id), "cancelled", n)
        pipe.hincrby(self.keys.job_breakdown(job_id), f"cancelled|{UNKNOWN_PARTITION}|{cls.value}", n)

    def count_cancelled(
        self, pipe: Pipeline, job_id: str, rq_id: str, *, partition: str, cls: str, incarnation: str = ""
    ) -> None:
        """An in-flight prompt of a cancelled job that a worker aborted."""
        args: list[str | int] = ["cancelled", 1, 0, now_ms(), rq_id, "", 0, partition, cls, "", incarnation]
        self._count_script(keys=self._count_keys(job_id), args=[*args, *COUNT_STATES], client=pipe)

    # Retry ---------------------------------------------------------------------------------------
    def acquire_retry(self, job_id: str) -> str:
        """Take the job's retry lock; returns its token. A retry already running is refused."""
        token = secrets.token_hex(8)
        if not self.redis.set(self.keys.job_retry_lock(job_id), token, nx=True, px=RETRY_LOCK_TTL_MS):
            raise JobStateError(
                f"a retry of job {job_id} is already running; wait for its answer, then retry again if needed"
            )
        return token

    def release_retry(self, job_id: str, token: str) -> None:
        self._release(keys=[self.keys.job_retry_lock(job_id)], args=[token])

    def requeue_failed(
        self,
        job_id: str,
        *,
        registry_key: str,
        backlog_key: str,
        dispatch_key: str,
        rq_job_prefix: str,
        items: Sequence[RequeueItem],
    ) -> list[str]:
        """Move failed prompts of one class back to the job's backlog, atomically: each prompt only
        if it is still in the failed registry (so concurrent retries cannot run it twice), none if
        the job was cancelled or deleted. Returns the ids that moved; a refused job raises."""
        args: list[str | int | bytes] = [
            rq_job_prefix,
            job_id,
            JobState.COMPLETED.value,
            JobState.CANCELLED.value,
            JobState.RUNNING.value,
        ]
        for item in items:
            retries = "" if item.retries_left is None else str(item.retries_left)
            args += [item.rq_id, item.meta, retries, f"|{item.label}|{item.cls}"]
        keys = [
            self.keys.job(job_id),
            self.keys.job_breakdown(job_id),
            registry_key,
            backlog_key,
            dispatch_key,
            self.keys.paused_jobs(),
        ]
        moved = self._requeue(keys=keys, args=args)
        if isinstance(moved, int):
            raise JobStateError(
                f"job {job_id} was cancelled or deleted; submit its dataset again under a new job id"
            )
        if moved and items:
            self.redis.publish(self.keys.wake_channel(), items[0].cls)
        return as_texts(moved)

    def forget_failure_reports(self, job_id: str, rq_ids: Sequence[str]) -> None:
        """Drop the failure reports of prompts that were put back to run again."""
        for start in range(0, len(rq_ids), RETRY_FORGET_SLICE):
            self._forget(
                keys=[self.keys.job_failed(job_id)], args=list(rq_ids[start : start + RETRY_FORGET_SLICE])
            )

    def failed_reports(self, job_id: str, limit: int) -> list[dict[str, Any]]:
        raw = self.redis.lrange(self.keys.job_failed(job_id), 0, limit - 1)
        return [json.loads(item) for item in raw]
