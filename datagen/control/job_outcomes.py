"""How prompts end, as `datagen.control.jobs.JobStore` records it: a worker counts a committed shard's
prompts done in one script with their RQ bookkeeping (`ack_done`; a turn with its conversation's next
turn, enqueued only if the ack counts it: `ack_next_turn`), and a prompt failed or cancelled
inside that prompt's RQ transaction (the count script); either way a prompt finished twice counts
once and a prompt of another incarnation of the job is not counted (the counting rules are written
once, in ``datagen/control/lua/lib.lua``). A retry puts failed prompts back, one retry per job at a
time and each prompt at most once. Part of `JobStore` (its base class), kept apart only for size:
the job's keys and scripts are JobStore's; the scripts' arguments are here."""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from redis import Redis
from redis.client import Pipeline

from datagen.clock import now_ms
from datagen.control.keys import BreakdownField, Keys
from datagen.control.payload import ParsedPayload
from datagen.control.redistext import as_texts
from datagen.control.rq_format import JOB_KEY_PREFIX, rq_now
from datagen.control.scripts import KEY, LuaScript, ScriptArgs
from datagen.errors import JobStateError
from datagen.states import JobState, Priority, PromptClass

__all__ = [
    "COUNT_STATES",
    "FAILED_REPORTS_CAP",
    "AckItem",
    "AckTarget",
    "JobOutcomes",
    "QueuedTurn",
    "RequeueItem",
    "failure_report",
]

FAILED_REPORTS_CAP = 10_000


def failure_report(rq_id: str, parsed: ParsedPayload, *, reason: str, message: str) -> dict[str, object]:
    """The report `JobOutcomes.count_failed` stores for a prompt that failed for good and
    ``GET /jobs/{id}/errors?kind=failed`` shows: ``{rq_id, reason, message, at_ms, sample_id,
    turn}``; ``parsed`` is the prompt's RQ payload (`datagen.control.payload.parse_payload`; of
    None when unknown). Written by the worker and by the reaper."""
    return {
        "rq_id": rq_id,
        "reason": reason,
        "message": message,
        "at_ms": now_ms(),
        "sample_id": parsed.sample_id,
        "turn": parsed.turn,
    }


# The states the count script moves a job between (it completes a running job).
COUNT_STATES = (JobState.RUNNING.value, JobState.COMPLETED.value)
# How long a retry may hold the job's retry lock; a crashed coordinator's lock expires by itself.
RETRY_LOCK_TTL_MS = 120_000
# RQ ids per call of the report-forgetting script (Lua's stack limits ARGV).
RETRY_FORGET_SLICE = 5000


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
    """One prompt whose record is committed: what RQ and its job's counters need. ``arm``: the
    recipe arm that made the record ('' in a job without a recipe), counted per arm as well."""

    rq_id: str
    job_id: str
    incarnation: str
    output_tokens: int
    partition: str
    cls: str
    finish: str
    result_ttl_s: int
    arm: str = ""


@dataclass(frozen=True)
class AckTarget:
    """Where a worker's prompts of one class finish in RQ."""

    started_key: str
    finished_key: str
    execution_id: str


# The scripts' arguments: named and ordered as the signature of datagen/control/lua/<script>.lua.
@dataclass(frozen=True)
class CountAndMaybeCompleteArgs(ScriptArgs):
    script = "count_and_maybe_complete"
    job_key: str = field(metadata=KEY)
    running: str = field(metadata=KEY)
    reports: str = field(metadata=KEY)
    breakdown: str = field(metadata=KEY)
    partitions: str = field(metadata=KEY)
    counter: str
    increment: int
    output_tokens: int
    now_ms: int
    rq_id: str
    report: str
    report_cap: int
    partition: str
    cls: str
    finish: str
    incarnation: str
    running_state: str
    completed_state: str


@dataclass(frozen=True)
class AckDoneArgs(ScriptArgs):
    script = "ack_done"
    started: str = field(metadata=KEY)
    finished: str = field(metadata=KEY)
    rq_job_prefix: str
    job_prefix: str
    running_suffix: str
    breakdown_suffix: str
    partitions_suffix: str
    now_ms: int
    now_rq: str
    now_s: float
    execution_id: str
    running_state: str
    completed_state: str
    # Per prompt: RQ id, job id, incarnation, output tokens, partition, class, finish, result TTL, arm.
    prompts: tuple[tuple[str | int, ...], ...]


@dataclass(frozen=True)
class QueuedTurn:
    """Multi-turn ``all`` mode: a conversation's next turn, enqueued by the ack that counts its
    turn (`JobOutcomes.ack_next_turn`): its RQ id and hash fields as RQ saves them
    (`datagen.control.enqueue.queued_job_fields`), where it queues, and what it adds to its job."""

    rq_id: str
    fields: dict[str, Any]
    member: str  # its key in the job's ``enqueued`` guard (`datagen.control.keys.prompt_key`)
    cls: PromptClass
    priority: Priority
    prompt_tokens: int
    queue_key: str  # its RQ queue's key, and RQ's set of them
    queues_key: str


@dataclass(frozen=True)
class AckNextTurnArgs(ScriptArgs):
    script = "ack_next_turn"
    started: str = field(metadata=KEY)
    finished: str = field(metadata=KEY)
    job_key: str = field(metadata=KEY)
    running: str = field(metadata=KEY)
    breakdown: str = field(metadata=KEY)
    partitions: str = field(metadata=KEY)
    enqueued: str = field(metadata=KEY)
    next_rq_key: str = field(metadata=KEY)
    backlog: str = field(metadata=KEY)
    dispatch_set: str = field(metadata=KEY)
    queues: str = field(metadata=KEY)
    paused: str = field(metadata=KEY)
    wake: str = field(metadata=KEY)
    rq_job_prefix: str
    now_ms: int
    now_rq: str
    now_s: float
    execution_id: str
    running_state: str
    completed_state: str
    cancelled_state: str
    rq_id: str
    job_id: str
    incarnation: str
    output_tokens: int
    partition: str
    cls: str
    finish: str
    result_ttl_s: int
    arm: str
    queue_key: str
    next_member: str
    next_rq_id: str
    next_cls: str
    next_tokens: int
    # The next turn's RQ job hash: field, value, field, value, ...
    next_fields: tuple[str | int | float | bytes, ...]


@dataclass(frozen=True)
class RequeueFailedArgs(ScriptArgs):
    script = "requeue_failed"
    job_key: str = field(metadata=KEY)
    breakdown: str = field(metadata=KEY)
    registry: str = field(metadata=KEY)
    backlog: str = field(metadata=KEY)
    dispatch_set: str = field(metadata=KEY)
    paused: str = field(metadata=KEY)
    rq_job_prefix: str
    job_id: str
    completed_state: str
    cancelled_state: str
    running_state: str
    # Per prompt: RQ id, new RQ meta, retries left ("" to keep), breakdown field it failed in.
    prompts: tuple[tuple[str | bytes, ...], ...]


@dataclass(frozen=True)
class ForgetReportsArgs(ScriptArgs):
    script = "forget_reports"
    reports: str = field(metadata=KEY)
    rq_ids: tuple[str, ...]


@dataclass(frozen=True)
class ReleaseArgs(ScriptArgs):
    script = "release"
    lock: str = field(metadata=KEY)
    token: str


@dataclass(frozen=True)
class CountCancelledQueuedArgs(ScriptArgs):
    script = "count_cancelled_queued"
    job_key: str = field(metadata=KEY)
    breakdown: str = field(metadata=KEY)
    cls: str
    n: int


class JobOutcomes:
    """How a job's prompts end (`JobStore.outcomes`): started and handed back, counted done with
    their shard, failed or cancelled, and failed ones retried (see the module docstring)."""

    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._count_script = LuaScript(redis, CountAndMaybeCompleteArgs)
        self._requeue = LuaScript(redis, RequeueFailedArgs)
        self._release = LuaScript(redis, ReleaseArgs)
        self._forget = LuaScript(redis, ForgetReportsArgs)
        self._ack = LuaScript(redis, AckDoneArgs)
        self._ack_next_turn = LuaScript(redis, AckNextTurnArgs)
        self._count_cancelled_queued = LuaScript(redis, CountCancelledQueuedArgs)

    # Workers ------------------------------------------------------------------------------------
    # A set of RQ ids rather than a counter: a prompt that is handed back or reaped and then
    # started again must not be counted twice.
    def started(self, job_id: str, rq_id: str) -> None:
        self.redis.sadd(self.keys.job_running(job_id), rq_id)

    def handed_back(self, pipe: Pipeline, job_id: str, rq_id: str) -> None:
        pipe.srem(self.keys.job_running(job_id), rq_id)

    def count(
        self,
        pipe: Pipeline,
        job_id: str,
        counter: str,
        *,
        increment: int = 1,
        rq_id: str = "",
        report: str = "",
        partition: str = "",
        cls: str = "",
        incarnation: str = "",
    ) -> None:
        """The count script (`CountAndMaybeCompleteArgs`) inside ``pipe``."""
        k = self.keys
        args = CountAndMaybeCompleteArgs(
            job_key=k.job(job_id),
            running=k.job_running(job_id),
            reports=k.job_failed(job_id),
            breakdown=k.job_breakdown(job_id),
            partitions=k.job_partitions(job_id),
            counter=counter,
            increment=increment,
            output_tokens=0,
            now_ms=now_ms(),
            rq_id=rq_id,
            report=report,
            report_cap=FAILED_REPORTS_CAP,
            partition=partition,
            cls=cls,
            finish="",
            incarnation=incarnation,
            running_state=JobState.RUNNING.value,
            completed_state=JobState.COMPLETED.value,
        )
        self._count_script(args, client=pipe)

    def ack_done(
        self, target: AckTarget, items: Sequence[AckItem], *, client: Redis | Pipeline | None = None
    ) -> int:
        """Finish committed prompts in RQ and count them done in their jobs, in one script
        (``datagen/control/lua/ack_done.lua``); returns how many counted (0 inside a pipeline). Safe
        to repeat: a prompt already counted is not counted again."""
        if not items:
            return 0
        keys = self.keys
        at = rq_now()
        args = AckDoneArgs(
            started=target.started_key,
            finished=target.finished_key,
            rq_job_prefix=JOB_KEY_PREFIX,
            job_prefix=keys.job_key_prefix(),
            running_suffix=keys.running_suffix(),
            breakdown_suffix=keys.breakdown_suffix(),
            partitions_suffix=keys.partitions_suffix(),
            now_ms=now_ms(),
            now_rq=at.text,
            now_s=at.s,
            execution_id=target.execution_id,
            running_state=JobState.RUNNING.value,
            completed_state=JobState.COMPLETED.value,
            prompts=tuple(
                (
                    item.rq_id,
                    item.job_id,
                    item.incarnation,
                    item.output_tokens,
                    item.partition,
                    item.cls,
                    item.finish,
                    item.result_ttl_s,
                    item.arm,
                )
                for item in items
            ),
        )
        counted = self._ack(args, client=client)
        return counted if isinstance(counted, int) else 0

    def ack_next_turn(
        self,
        target: AckTarget,
        item: AckItem,
        following: QueuedTurn,
        *,
        client: Redis | Pipeline | None = None,
    ) -> bool:
        """Multi-turn ``all`` mode: finish one committed turn as `ack_done` does and, only if this
        call counts it, enqueue its conversation's next turn in the same step
        (``datagen/control/lua/ack_next_turn.lua``). A job Redis lost gets nothing written (no
        hash comes back), and a stale ack (a job rebuilt from storage enqueues the next turn
        itself) enqueues nothing. Returns whether the turn counted (False inside a pipeline). Safe
        to repeat."""
        keys = self.keys
        at = rq_now()
        args = AckNextTurnArgs(
            started=target.started_key,
            finished=target.finished_key,
            job_key=keys.job(item.job_id),
            running=keys.job_running(item.job_id),
            breakdown=keys.job_breakdown(item.job_id),
            partitions=keys.job_partitions(item.job_id),
            enqueued=keys.job_enqueued(item.job_id),
            next_rq_key=JOB_KEY_PREFIX + following.rq_id,
            backlog=keys.job_backlog(item.job_id, following.cls),
            dispatch_set=keys.dispatch_jobs(following.cls, following.priority),
            queues=following.queues_key,
            paused=keys.paused_jobs(),
            wake=keys.wake_channel(),
            rq_job_prefix=JOB_KEY_PREFIX,
            now_ms=now_ms(),
            now_rq=at.text,
            now_s=at.s,
            execution_id=target.execution_id,
            running_state=JobState.RUNNING.value,
            completed_state=JobState.COMPLETED.value,
            cancelled_state=JobState.CANCELLED.value,
            rq_id=item.rq_id,
            job_id=item.job_id,
            incarnation=item.incarnation,
            output_tokens=item.output_tokens,
            partition=item.partition,
            cls=item.cls,
            finish=item.finish,
            result_ttl_s=item.result_ttl_s,
            arm=item.arm,
            queue_key=following.queue_key,
            next_member=following.member,
            next_rq_id=following.rq_id,
            next_cls=following.cls.value,
            next_tokens=following.prompt_tokens,
            next_fields=tuple(v for pair in following.fields.items() for v in pair),
        )
        return self._ack_next_turn(args, client=client) == 1

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
        self.count(
            pipe,
            job_id,
            "failed",
            rq_id=rq_id,
            report=report_json,
            partition=partition,
            cls=cls,
            incarnation=incarnation,
        )

    def count_cancelled_queued(self, pipe: Pipeline, job_id: str, cls: PromptClass, n: int) -> None:
        """Prompts of a cancelled job dropped before they ran, by the rule the dispatch scripts
        count them with (``count_cancelled_queued`` in ``datagen/control/lua/lib.lua``)."""
        args = CountCancelledQueuedArgs(
            job_key=self.keys.job(job_id), breakdown=self.keys.job_breakdown(job_id), cls=cls.value, n=n
        )
        self._count_cancelled_queued(args, client=pipe)

    def count_cancelled(
        self, pipe: Pipeline, job_id: str, rq_id: str, *, partition: str, cls: str, incarnation: str = ""
    ) -> None:
        """An in-flight prompt of a cancelled job that a worker aborted."""
        self.count(
            pipe, job_id, "cancelled", rq_id=rq_id, partition=partition, cls=cls, incarnation=incarnation
        )

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
        self._release(ReleaseArgs(lock=self.keys.job_retry_lock(job_id), token=token))

    def requeue_failed(
        self,
        job_id: str,
        cls: PromptClass,
        priority: Priority,
        *,
        registry_key: str,
        items: Sequence[RequeueItem],
    ) -> list[str]:
        """Move failed prompts of class ``cls`` (from RQ's failed registry ``registry_key``) back to
        the job's backlog, atomically: each prompt only if it is still in the failed registry (so
        concurrent retries cannot run it twice), none if the job was cancelled or deleted. Returns
        the ids that moved; a refused job raises."""
        args = RequeueFailedArgs(
            job_key=self.keys.job(job_id),
            breakdown=self.keys.job_breakdown(job_id),
            registry=registry_key,
            backlog=self.keys.job_backlog(job_id, cls),
            dispatch_set=self.keys.dispatch_jobs(cls, priority),
            paused=self.keys.paused_jobs(),
            rq_job_prefix=JOB_KEY_PREFIX,
            job_id=job_id,
            completed_state=JobState.COMPLETED.value,
            cancelled_state=JobState.CANCELLED.value,
            running_state=JobState.RUNNING.value,
            prompts=tuple(
                (
                    item.rq_id,
                    item.meta,
                    "" if item.retries_left is None else str(item.retries_left),
                    BreakdownField("failed", item.label, item.cls).encode(),
                )
                for item in items
            ),
        )
        moved = self._requeue(args)
        if isinstance(moved, int):
            raise JobStateError(
                f"job {job_id} was cancelled or deleted; submit its dataset again under a new job id"
            )
        if moved:
            self.redis.publish(self.keys.wake_channel(), cls.value)
        return as_texts(moved)

    def forget_failure_reports(self, job_id: str, rq_ids: Sequence[str]) -> None:
        """Drop the failure reports of prompts that were put back to run again."""
        for start in range(0, len(rq_ids), RETRY_FORGET_SLICE):
            chunk = tuple(rq_ids[start : start + RETRY_FORGET_SLICE])
            self._forget(ForgetReportsArgs(reports=self.keys.job_failed(job_id), rq_ids=chunk))

    def failure_reasons(self, job_id: str) -> dict[str, str]:
        """RQ id -> the reason its failure report gives, of every report the job keeps."""
        raw = self.redis.lrange(self.keys.job_failed(job_id), 0, -1)
        reports = (json.loads(item) for item in raw)
        return {str(r.get("rq_id")): str(r.get("reason", "unknown")) for r in reports}

    def failed_reports(self, job_id: str, limit: int) -> list[dict[str, Any]]:
        raw = self.redis.lrange(self.keys.job_failed(job_id), 0, limit - 1)
        return [json.loads(item) for item in raw]
