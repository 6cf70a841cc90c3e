"""Admission: one claim loop per class takes prompts from RQ while that class has a free slot,
and runs each as an asyncio task.

:class:`Slots` is the account of what runs: the tasks of each class, how many of them are still
generating (a slot is held from the claim until the server has answered, not while the record
waits for its shard commit), and which were cancelled because their job was cancelled with
``--abort-in-flight``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Collection, Coroutine, Mapping
from typing import Any

import redis

from datagen.dispatch import Dispatch
from datagen.states import PromptClass
from workers.control import FleetSync
from workers.fleet import Fleet
from workers.redisretry import REDIS_RETRY_MAX_S, REDIS_RETRY_MIN_S
from workers.rqbridge import InFlight, QueueIdentity, payload_of

__all__ = ["Admission", "RunPrompt", "Slots"]

log = logging.getLogger(__name__)

# The life of one claimed prompt (``workers.prompt.PromptRunner.run``).
RunPrompt = Callable[[QueueIdentity, InFlight, PromptClass], Coroutine[Any, Any, None]]


class Slots:
    def __init__(self) -> None:
        self.stopping = asyncio.Event()
        self.freed = asyncio.Event()
        self.tasks: dict[PromptClass, set[asyncio.Task[None]]] = {cls: set() for cls in PromptClass}
        self.generating: dict[PromptClass, int] = dict.fromkeys(PromptClass, 0)
        # Job id of each running prompt task, and the tasks cancelled because their job was
        # cancelled with abort (those finish as cancelled instead of being handed back).
        self._task_jobs: dict[asyncio.Task[None], str] = {}
        self._aborted: set[asyncio.Task[None]] = set()

    def stop(self) -> None:
        self.stopping.set()
        self.freed.set()

    def running(self) -> list[asyncio.Task[None]]:
        return [t for group in self.tasks.values() for t in group]

    def add(self, cls: PromptClass, task: asyncio.Task[None], job_id: str) -> None:
        tasks = self.tasks[cls]
        tasks.add(task)
        self._task_jobs[task] = job_id
        task.add_done_callback(tasks.discard)
        task.add_done_callback(self._task_done)

    def release(self, cls: PromptClass) -> None:
        """The prompt's request is over: its slot is free for the next claim."""
        self.generating[cls] -= 1
        self.freed.set()

    def aborted(self, task: asyncio.Task[None] | None) -> bool:
        return task is not None and task in self._aborted

    def abort_jobs(self, job_ids: Collection[str]) -> None:
        """Cancel the running prompts of these jobs (they finish as cancelled)."""
        for task, job_id in list(self._task_jobs.items()):
            if job_id in job_ids and task not in self._aborted and not task.done():
                self._aborted.add(task)
                task.cancel()

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._task_jobs.pop(task, None)
        self._aborted.discard(task)
        self.freed.set()


class Admission:
    def __init__(
        self,
        slots: Slots,
        identities: Mapping[PromptClass, QueueIdentity],
        dispatch: Dispatch,
        fleet: Fleet,
        sync: FleetSync,
        run_prompt: RunPrompt,
        *,
        burst: bool,
        poll_interval_s: float,
    ) -> None:
        self.slots = slots
        self.identities = identities
        self.dispatch = dispatch
        self.fleet = fleet
        self.sync = sync
        self.run_prompt = run_prompt
        self.burst = burst
        self.poll_interval_s = poll_interval_s

    async def run(self) -> None:
        await asyncio.gather(*(self._admit(cls) for cls in PromptClass))

    async def _admit(self, cls: PromptClass) -> None:
        slots = self.slots
        identity = self.identities[cls]
        poll_s = self.poll_interval_s
        outage_s = 0.0
        while not slots.stopping.is_set():
            if self.burst and self._burst_done():
                return
            # Prompts waiting only for their shard commit no longer use a server slot.
            if cls in self.sync.paused_classes or slots.generating[cls] >= self.fleet.capacity(cls):
                slots.freed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(slots.freed.wait(), timeout=poll_s)
                continue
            try:
                item = identity.claim(self.dispatch, cls)
                outage_s = 0.0
            except redis.RedisError as exc:
                if not outage_s:
                    log.warning("cannot claim %s prompts (Redis unreachable?): %s", cls.value, exc)
                outage_s = min(REDIS_RETRY_MAX_S, max(REDIS_RETRY_MIN_S, outage_s * 2))
                await asyncio.sleep(outage_s)
                continue
            if item is None:
                await asyncio.sleep(poll_s)
                continue
            slots.generating[cls] += 1
            task = asyncio.create_task(self.run_prompt(identity, item, cls), name=item.job.id)
            slots.add(cls, task, str((payload_of(item.job) or {}).get("job", "")))

    def _burst_done(self) -> bool:
        """Burst mode ends when nothing runs here and no unpaused job has prompts to dispatch."""
        if any(self.slots.tasks.values()):
            return False
        try:
            return all(
                identity.queue.count == 0 and not self.dispatch.has_work(cls)
                for cls, identity in self.identities.items()
            )
        except redis.RedisError:
            return False
