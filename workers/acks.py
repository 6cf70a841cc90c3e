"""Finishing committed prompts in batches: the tasks of a shard resume together once the shard is
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
import functools
import logging
from dataclasses import dataclass

from datagen.control.jobs import AckItem, JobStore
from datagen.settings import DEFAULT_RESULT_TTL_S
from workers.redisretry import while_redis_down
from workers.rqbridge import InFlight, QueueIdentity

__all__ = ["Acks", "ack_item"]

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
                counted = await while_redis_down(functools.partial(self.jobs.ack_done, target, acks))
            except Exception as exc:  # a bug: the prompts stay started and the reaper runs them again
                log.exception("cannot acknowledge %d prompts", len(group))
                for waiting in group:
                    if not waiting.done.done():
                        waiting.done.set_exception(exc)
                continue
            identity.finished([w.item for w in group])
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
) -> AckItem:
    """What the ack script needs of one committed prompt."""
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
    )
