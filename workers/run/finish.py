"""The RQ transitions that record how a prompt ended, each with the job's counters in the same
transaction: succeeded (batched with its shard, `Acks` below; in multi-turn ``all`` mode with its
next turn enqueued by the script that counts it, or its conversation's stop stored first,
`workers.run.conversation`), failed,
cancelled with its job, dropped because its job was deleted, or handed back unfinished.

Succeeded prompts finish in batches: the tasks of a shard resume together once the shard is
durable, and their acknowledgements (RQ finished, job counted done) go to Redis in one script call
per class (`datagen.control.jobs.JobStore.ack_done`) instead of one transaction each.

A task waits until its ack is in Redis, so its heartbeat and burst mode's "nothing in flight" keep
their meaning. A Redis outage holds the batch and retries it: the script is safe to
repeat, since a prompt already counted is not counted again. A worker killed between the shard
commit and the ack leaves its prompts started; the reaper hands them out again and the second
record of each is dropped by exports (first record wins), while the count happens once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass

import redis
from redis.client import Pipeline
from rq.job import Job, JobStatus

from datagen.clock import now_ms
from datagen.control.dispatch import Dispatch
from datagen.control.enqueue import queued_turn
from datagen.control.job_outcomes import QueuedTurn, failure_report
from datagen.control.jobs import AckItem, JobStore
from datagen.control.keys import Keys
from datagen.control.payload import ParsedPayload, PromptPayload, counts_in
from datagen.errors import JobNotFoundError, RetryableError
from datagen.records.schema import Record
from datagen.settings import DEFAULT_RESULT_TTL_S
from datagen.states import PromptClass
from workers.claim.rqbridge import InFlight, QueueIdentity
from workers.metrics import WorkerMetrics
from workers.run.conversation import Conversations, ConversationStop, NextTurn, note_of
from workers.run.jobinfo import JobInfos
from workers.run.redisretry import while_redis_down

__all__ = ["Acks", "Finisher", "ack_item", "is_final"]

log = logging.getLogger(__name__)

# Prompts per script call at most (Lua's unpack, and one call's time on Redis, stay bounded).
MAX_ACKS_PER_CALL = 1000


@dataclass(eq=False)
class _Waiting:
    identity: QueueIdentity
    item: InFlight
    ack: AckItem
    done: asyncio.Future[int]


class Acks:
    def __init__(self, jobs: JobStore, *, delay_s: float = 0.0) -> None:
        self.jobs = jobs
        self._waiting: list[_Waiting] = []
        self._scheduled = False
        # Running flushes (the event loop keeps only weak references to tasks).
        self._flushes: set[asyncio.Task[None]] = set()
        # Fault tests only (``test_ack_delay_s``): a window to kill the worker after the commit.
        self.delay_s = delay_s

    async def done(self, identity: QueueIdentity, item: InFlight, ack: AckItem) -> None:
        """Return once the prompt is finished in RQ and counted in its job (or was before)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[int] = loop.create_future()
        self._waiting.append(_Waiting(identity, item, ack, future))
        if not self._scheduled:
            # The other tasks of the same shard resume in this loop iteration: flushing on the
            # next one takes them all in one call.
            self._scheduled = True
            loop.call_soon(self._start_flush)
        await asyncio.shield(future)

    def _start_flush(self) -> None:
        task = asyncio.ensure_future(self._flush())
        self._flushes.add(task)
        task.add_done_callback(self._flushes.discard)

    async def _flush(self) -> None:
        self._scheduled = False
        batch, self._waiting = self._waiting, []
        if not batch:
            return
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        by_identity: dict[QueueIdentity, list[_Waiting]] = {}
        for waiting in batch:
            by_identity.setdefault(waiting.identity, []).append(waiting)
        groups = [
            (identity, waiting[start : start + MAX_ACKS_PER_CALL])
            for identity, waiting in by_identity.items()
            for start in range(0, len(waiting), MAX_ACKS_PER_CALL)
        ]
        for identity, group in groups:
            target = identity.ack_target
            acks = [w.ack for w in group]
            try:
                counted = await while_redis_down(functools.partial(self.jobs.outcomes.ack_done, target, acks))
            except Exception as exc:  # a bug: the prompts stay started and the reaper runs them again
                log.exception("cannot acknowledge %d prompts", len(group))
                for waiting in group:
                    if not waiting.done.done():
                        waiting.done.set_exception(exc)
                continue
            identity.forget([w.item for w in group])
            log.debug("acknowledged %d prompts (%d counted)", len(group), counted)
            for waiting in group:
                if not waiting.done.done():
                    waiting.done.set_result(counted)


def ack_item(
    item: InFlight,
    *,
    job_id: str,
    incarnation: str,
    output_tokens: int,
    partition: str,
    cls: str,
    finish: str,
    arm: str = "",
) -> AckItem:
    """What the ack script needs of one committed prompt (``arm``: its recipe arm, '' for none)."""
    job = item.job
    return AckItem(
        rq_id=job.id,
        job_id=job_id,
        incarnation=incarnation,
        output_tokens=output_tokens,
        partition=partition,
        cls=cls,
        finish=finish,
        result_ttl_s=job.get_result_ttl(DEFAULT_RESULT_TTL_S),
        arm=arm,
    )


class Finisher:
    def __init__(
        self,
        redis_client: redis.Redis,
        keys: Keys,
        jobs: JobStore,
        dispatch: Dispatch,
        identities: Mapping[PromptClass, QueueIdentity],
        metrics: WorkerMetrics,
        job_infos: JobInfos,
        acks: Acks,
        conversations: Conversations,
    ) -> None:
        self.acks = acks
        self.conversations = conversations
        self.redis = redis_client
        self.keys = keys
        self.jobs = jobs
        self.dispatch = dispatch
        self.identities = identities
        self.metrics = metrics
        self.job_infos = job_infos

    async def following_turn(self, payload: PromptPayload, record: Record) -> tuple[Record, NextTurn]:
        """Multi-turn ``all`` mode, once the turn is generated and before its record is committed:
        what follows it (the next turn's payload, nothing, or why the conversation stops:
        `workers.run.conversation`), and the record carrying it in ``next_turn``, so that storage holds
        the next turn's history with the turn's commit (a Redis that loses the next turn's payload
        loses nothing: a rebuild enqueues it from the records, `service.committed`). Raises only
        JobNotFoundError and CancelledError."""
        following = await self.conversations.after(payload, record)
        note = note_of(following)
        return (record if note is None else dataclasses.replace(record, next_turn=note)), following

    async def succeed(
        self,
        identity: QueueIdentity,
        item: InFlight,
        record: Record,
        following: NextTurn,
        payload: PromptPayload,
    ) -> None:
        """The record is committed: finish the prompt in RQ and count it done, batched with the
        other prompts of its shard (`Acks`); a next turn is enqueued by the same script as its
        turn's done count, and only if that count happens (`JobOutcomes.ack_next_turn`), so the job
        cannot complete in between, a stale or repeated ack enqueues nothing, and a job Redis lost
        gets no hash written back; a conversation's stop is stored before the done count, so a
        completed job shows every stop."""
        ack = ack_item(
            item,
            job_id=record.job_id,
            incarnation=payload.incarnation,
            output_tokens=record.output_len,
            partition=record.partition,
            cls=record.cls,
            finish=record.finish_type,
            arm=record.arm or "",
        )
        if isinstance(following, ConversationStop):
            await self.conversations.record_stop(payload, following)
        queued = None
        if isinstance(following, PromptPayload):
            queued = await while_redis_down(functools.partial(self._queued_turn, item, following))
        if queued is None:
            await self.acks.done(identity, item, ack)
        else:
            await while_redis_down(
                functools.partial(self.jobs.outcomes.ack_next_turn, identity.ack_target, ack, queued),
                already_done=lambda: is_final(item.job),
            )
            identity.forget([item])
        self._observe(record)
        log.info(
            "done %s server=%s class=%s prompt=%d output=%d finish=%s attempts=%d %.2fs",
            item.job.id,
            record.server,
            record.cls,
            record.prompt_len,
            record.output_len,
            record.finish_type,
            record.attempts,
            (record.finished_at_ms - record.started_at_ms) / 1000,
        )

    def _queued_turn(self, item: InFlight, following: PromptPayload) -> QueuedTurn | None:
        """The next turn as the ack script enqueues it; None if its job is gone (the ack then counts
        nothing either)."""
        try:
            priority = self.job_infos.get(following.job, following.incarnation).spec.priority
        except JobNotFoundError:
            return None
        queue = self.identities[following.cls].queue
        return queued_turn(queue, self.keys, following, priority=priority, after=item.job)

    def _observe(self, record: Record) -> None:
        metrics = self.metrics
        metrics.finishes.labels(record.cls, record.finish_type).inc()
        metrics.output_length.labels(record.cls).observe(record.output_len)
        metrics.prompt_length.labels(record.cls).observe(record.prompt_len)
        if record.enqueued_at_ms is not None:
            metrics.time_to_result.labels(record.cls).observe(
                max(0.0, (now_ms() - record.enqueued_at_ms) / 1000)
            )

    def fail(
        self, identity: QueueIdentity, item: InFlight, parsed: ParsedPayload, exc: BaseException
    ) -> None:
        if self._gone(parsed):
            self.drop_stale(identity, item)
            return
        reason = type(exc).__name__
        if isinstance(exc.__cause__, RetryableError):
            # Retries ran out: the cause says why (timeouts, 5xx, aborts), not the FatalError wrapper.
            reason = f"gave_up_{type(exc.__cause__).__name__}"
        message = str(exc) or reason
        self.metrics.failures.labels(reason).inc()
        log.warning("failed %s: %s", item.job.id, message)
        job_id = parsed.job
        report = failure_report(item.job.id, parsed, reason=reason, message=message)

        def hook(pipe: Pipeline) -> None:
            if job_id is not None:
                self.jobs.outcomes.count_failed(pipe, job_id, item.job.id, report, **parsed.labels.kwargs())

        identity.finish_failure(item, message, hook, reason=reason)

    def cancelled(self, identity: QueueIdentity, item: InFlight, parsed: ParsedPayload, job_id: str) -> None:
        if self._gone(parsed):
            self.drop_stale(identity, item)
            return
        labels = parsed.labels.kwargs()

        def hook(pipe: Pipeline) -> None:
            self.jobs.outcomes.count_cancelled(pipe, job_id, item.job.id, **labels)

        identity.finish_cancelled(item, hook)
        self.metrics.aborted.inc()
        log.info("aborted %s: its job %s was cancelled", item.job.id, job_id)

    def drop_stale(self, identity: QueueIdentity, item: InFlight) -> None:
        """Forget a prompt of a deleted job (`QueueIdentity.drop`): nothing of it is stored or counted."""
        identity.drop(item)
        log.info("dropped %s: its job was deleted while it ran", item.job.id)

    def _gone(self, parsed: ParsedPayload) -> bool:
        """Whether the prompt's job was deleted, or its id reused, while it ran: the prompt no longer
        counts in it (`datagen.control.payload.counts_in`, the count scripts' rule). RQ's transitions
        write the prompt's RQ hash unconditionally: they would write a deleted job's back (kept for
        a TTL, or for good) or change the new job's prompt of the same RQ id (failed, or queued twice)."""
        if parsed.job is None or parsed.prompt is None:
            return False
        return not counts_in(parsed.prompt.incarnation, self.jobs.incarnation(parsed.job))

    def hand_back(self, identity: QueueIdentity, item: InFlight, parsed: ParsedPayload) -> None:
        """Return an unfinished prompt to the front of its queue; if Redis is down, the reaper will."""
        job_id = parsed.job
        try:
            if self._gone(parsed):
                self.drop_stale(identity, item)
                return
            hook = (
                (lambda pipe: self.jobs.outcomes.handed_back(pipe, job_id, item.job.id)) if job_id else None
            )
            identity.hand_back(item, hook)
        except redis.RedisError as exc:
            log.error("cannot hand %s back (Redis unreachable): the reaper will: %s", item.job.id, exc)


def is_final(job: Job) -> bool:
    """Whether RQ already has the job finished or failed (a retried transition that went through)."""
    return job.get_status(refresh=True) in (JobStatus.FINISHED, JobStatus.FAILED)
