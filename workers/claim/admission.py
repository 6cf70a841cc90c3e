"""Admission: one claim loop per class takes prompts from RQ while that class has free slots,
as many per claim as are free, and runs each as an asyncio task. With nothing to claim it waits
for a wake-up (`workers.claim.wake`) instead of polling Redis; after a wake-up whose claim found nothing,
the next wake-driven claim comes no sooner than ``WAKE_COALESCE_S`` later, however many wake-ups
arrive, while a claim that found work is followed at once. On a fleet of mixed speeds the slots of
servers held back at the end of the backlog (`Fleet.held_back`) are not claimed for. While the
records waiting for their shard commit (`RecordWriter.pending`) reach ``max_uncommitted_records``
(storage that cannot be written), nothing is claimed: what runs is bounded by that plus the slots.

:class:`Slots` is the account of what runs: the tasks of each class, how many of them are still
generating, per class and per job (a slot is held from the claim until the server has answered,
not while the record waits for its shard commit), and which were cancelled because their job was
cancelled with ``--abort-in-flight``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import Callable, Collection, Coroutine, Mapping
from typing import Any

import redis

from datagen.backoff import Backoff
from datagen.control.dispatch import MAX_CLAIM, Dispatch
from datagen.control.jobs import RunFacts
from datagen.control.payload import ParsedPayload, parse_payload
from datagen.control.redismemory import is_out_of_memory
from datagen.control.rq_format import payload_of
from datagen.settings import OUTAGE_RETRY_FIRST_S, OUTAGE_RETRY_MAX_S
from datagen.states import PromptClass
from workers.claim.rqbridge import InFlight, QueueIdentity
from workers.claim.wake import WAKE_COALESCE_S, Wakeups
from workers.fleet.servers import Fleet
from workers.fleet.sync import FleetSync

__all__ = ["Admission", "RunPrompt", "Slots"]

log = logging.getLogger(__name__)

# While requests end one by one, a claim waits for freed slots to gather, until a capacity /
# CLAIM_BATCH_DIVISOR of them are free or CLAIM_GATHER_FRACTION of a typical request's wall time
# has passed (within CLAIM_GATHER_MIN_S..CLAIM_GATHER_MAX_S): one claim then starts several
# prompts. Redis pays mostly per claim, not per prompt, so a busy node's claims of one or two
# prompts cost it several times what claims of tens do; a slot refilled a small share of a request
# later costs at most about half that share of its time, and nothing while the server holds a queue
# of its own longer than the window's completions (figures: bench/README.md, "Figures the code no
# longer carries").
CLAIM_GATHER_FRACTION = 0.02
CLAIM_GATHER_MIN_S = 0.005
CLAIM_GATHER_MAX_S = 0.1
CLAIM_BATCH_DIVISOR = 4
# An idle claim loop polls at most this rarely; wake-ups (`workers.claim.wake`) bring it back at once.
IDLE_POLL_MAX_S = 5.0
# With servers of clearly different speeds, the backlog left decides the end of a run: the slower
# servers start no new prompts (`Fleet.held_back`). It is read at most this often, and counted down
# by this worker's claims in between.
BACKLOG_REFRESH_S = 0.5

# The life of one claimed prompt (``workers.run.prompt.PromptRunner.run``).
RunPrompt = Callable[[QueueIdentity, InFlight, ParsedPayload, PromptClass], Coroutine[Any, Any, None]]


def _claim_failed(cls: PromptClass, exc: redis.RedisError) -> None:
    why = "Redis is out of memory: raise its maxmemory" if is_out_of_memory(exc) else "Redis unreachable?"
    log.warning("cannot claim %s prompts (%s): %s", cls.value, why, exc)


class Slots:
    def __init__(self) -> None:
        self.stopping = asyncio.Event()
        self.freed = asyncio.Event()
        self.tasks: dict[PromptClass, set[asyncio.Task[None]]] = {cls: set() for cls in PromptClass}
        self.generating: dict[PromptClass, int] = dict.fromkeys(PromptClass, 0)
        # Per job: its prompts still generating (the record writer commits a job's records at once
        # when none is: they are its last for now).
        self._generating_jobs: dict[str, int] = {}
        # Job id of each running prompt task, and the tasks cancelled because their job was
        # cancelled with abort (those finish as cancelled instead of being handed back).
        self._task_jobs: dict[asyncio.Task[None], str] = {}
        self._aborted: set[asyncio.Task[None]] = set()
        # Set while no prompt task runs (burst mode checks whether it is done then).
        self.empty = asyncio.Event()
        self.empty.set()

    def stop(self) -> None:
        self.stopping.set()
        self.freed.set()

    def running(self) -> list[asyncio.Task[None]]:
        return [t for group in self.tasks.values() for t in group]

    def add(self, cls: PromptClass, task: asyncio.Task[None], job_id: str) -> None:
        tasks = self.tasks[cls]
        tasks.add(task)
        self.empty.clear()
        self._task_jobs[task] = job_id
        self._generating_jobs[job_id] = self._generating_jobs.get(job_id, 0) + 1
        task.add_done_callback(tasks.discard)
        task.add_done_callback(self._task_done)

    def release(self, cls: PromptClass, job_id: str) -> None:
        """The prompt's request is over: its slot is free for the next claim."""
        self.generating[cls] -= 1
        left = self._generating_jobs.get(job_id, 0) - 1
        if left > 0:
            self._generating_jobs[job_id] = left
        else:
            self._generating_jobs.pop(job_id, None)
        self.freed.set()

    def generating_of(self, job_id: str) -> int:
        """The job's prompts claimed here whose request is not over yet."""
        return self._generating_jobs.get(job_id, 0)

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
        if not self._task_jobs:
            self.empty.set()


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
        wakeups: Wakeups | None = None,
        on_claim_empty: Callable[[PromptClass], None] | None = None,
        on_claimed: Callable[[PromptClass], None] | None = None,
        uncommitted: Callable[[], int] | None = None,
        max_uncommitted_records: int = 0,
        crowded_jobs: Callable[[int], set[str]] | None = None,
        known_jobs: Callable[[], Collection[str]] | None = None,
        learn_job: Callable[[str, RunFacts], None] | None = None,
    ) -> None:
        self.slots = slots
        self.identities = identities
        self.dispatch = dispatch
        self.fleet = fleet
        self.sync = sync
        self.run_prompt = run_prompt
        self.burst = burst
        self.poll_interval_s = poll_interval_s
        self.wakeups = wakeups
        self.on_claim_empty = on_claim_empty
        self.on_claimed = on_claimed
        # Records waiting for their commit now, and how many of them stop the claims (0: no bound).
        self.uncommitted = uncommitted
        self.max_uncommitted_records = max_uncommitted_records
        # The jobs with at least N records waiting for their commit (`RecordWriter.crowded_jobs`).
        self.crowded_jobs = crowded_jobs
        # The jobs whose run facts the worker holds, and where a claim's run facts of the others go
        # (`workers.run.jobinfo`): a job's first prompts come with them, not after a read of them.
        self.known_jobs = known_jobs
        self.learn_job = learn_job
        self._commits_behind = False
        # Claims that found work and the prompts they started, for the stop's log line.
        self.claims = 0
        self.claimed_prompts = 0
        # Per class: when the backlog was read (monotonic) and what is left of it since.
        self._backlogs: dict[PromptClass, list[float]] = {}

    async def run(self) -> None:
        await asyncio.gather(*(self._admit(cls) for cls in PromptClass))

    async def _admit(self, cls: PromptClass) -> None:
        slots = self.slots
        identity = self.identities[cls]
        poll_s = self.poll_interval_s
        idle = Backoff(min(poll_s, IDLE_POLL_MAX_S), IDLE_POLL_MAX_S)
        outage = Backoff(OUTAGE_RETRY_FIRST_S, OUTAGE_RETRY_MAX_S)
        woken = False  # the next claim was asked for by a wake-up
        while not slots.stopping.is_set():
            if self.burst and self._burst_done():
                return
            if cls in self.sync.paused_classes:
                await self._wait_freed(poll_s)
                continue
            backlog = self._end_of_backlog(cls)
            if (free := min(self._free(cls, backlog), self._uncommitted_room())) <= 0:
                await self._wait_freed(poll_s)
                continue
            if free < self._min_batch(cls) and slots.generating[cls] and not idle.failures:
                # Requests are ending one by one: gather a few freed slots into one claim.
                free = await self._gather(cls, free, backlog)
                if free <= 0:
                    continue
            try:
                items = self._claim(identity, cls, free)
                outage.reset()
            except redis.RedisError as exc:
                if not outage.failures:
                    _claim_failed(cls, exc)
                await asyncio.sleep(outage.next_s())
                continue
            if not items:
                if self.on_claim_empty is not None:
                    self.on_claim_empty(cls)
                # Nothing to claim: wait for a wake-up (`workers.claim.wake`), polling ever more slowly.
                idle_s = idle.next_s()
                timeout_s = idle_s if self.wakeups is not None else poll_s
                woken = await self._wait_for_work(cls, timeout_s, held=woken)
                continue
            idle.reset()
            woken = False
            self._start(cls, identity, items)
            if len(items) < min(free, MAX_CLAIM) and self.wakeups is not None:
                # The claim took every prompt it could see (it got fewer than it asked for): a
                # claim now would find nothing. Whatever is enqueued from here on wakes the loop
                # (and a wake-up since the claim began already has), so it waits for that instead
                # of an empty claim; the poll is the safety net, as when idle.
                woken = await self._wait_for_work(cls, poll_s, held=False)

    def _claim(self, identity: QueueIdentity, cls: PromptClass, free: int) -> list[InFlight]:
        if self.wakeups is not None:
            self.wakeups.answered(cls)  # this claim finds what they told of
        known = self.known_jobs() if self.known_jobs is not None else ()
        return identity.claim_many(
            self.dispatch, cls, free, skip=self._crowded(), known=known, learn=self.learn_job
        )

    def _start(self, cls: PromptClass, identity: QueueIdentity, items: list[InFlight]) -> None:
        """Run a task per claimed prompt."""
        self._claimed(cls, len(items))
        for item in items:
            self.slots.generating[cls] += 1
            parsed = parse_payload(payload_of(item.job))  # the one read of its payload
            task = asyncio.create_task(self.run_prompt(identity, item, parsed, cls), name=item.job.id)
            self.slots.add(cls, task, parsed.job or "")

    async def _gather(self, cls: PromptClass, free: int, backlog: int | None) -> int:
        """Wait up to the gather window for a batch's worth of free slots; returns how many are free."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._gather_s()
        while free < self._min_batch(cls) and (left_s := deadline - loop.time()) > 0:
            await self._wait_freed(left_s)
            if self.slots.stopping.is_set():
                break
            free = min(self._free(cls, backlog), self._uncommitted_room())
        return free

    def _gather_s(self) -> float:
        typical_s = self.fleet.typical_latency_s()
        if typical_s is None:
            return CLAIM_GATHER_MIN_S
        return min(CLAIM_GATHER_MAX_S, max(CLAIM_GATHER_MIN_S, CLAIM_GATHER_FRACTION * typical_s))

    def _free(self, cls: PromptClass, backlog: int | None) -> int:
        """Slots to claim for: the servers' slots (prompts waiting only for their shard commit no
        longer hold one) less those of servers held back at the end of the backlog."""
        free = self.fleet.capacity(cls) - self.slots.generating[cls]
        if free > 0 and backlog is not None:
            free -= sum(s.free(cls) for s in self.fleet.held_back(cls, backlog))
        return free

    def _crowded(self) -> set[str]:
        """Jobs whose records waiting for their commit here reach half the bound: not claimed, so
        one job whose storage fails leaves the other half to jobs whose commits go through."""
        if self.crowded_jobs is None or self.max_uncommitted_records <= 0:
            return set()
        return self.crowded_jobs(max(1, self.max_uncommitted_records // 2))

    def _uncommitted_room(self) -> int:
        """How many more records may wait for their commit here (claims stop at none)."""
        if self.uncommitted is None or self.max_uncommitted_records <= 0:
            return sys.maxsize
        waiting = self.uncommitted()
        room = self.max_uncommitted_records - waiting
        if (room <= 0) != self._commits_behind:
            self._commits_behind = room <= 0
            if self._commits_behind:
                log.warning("%d records wait for their commit: no claims until storage takes them", waiting)
            else:
                log.info("records are committed again (%d waiting): claims resume", waiting)
        return room

    def _end_of_backlog(self, cls: PromptClass) -> int | None:
        """With servers of clearly different speeds, the prompts of ``cls`` left to dispatch
        fleet-wide; None otherwise, or when Redis cannot tell (nothing is held back then)."""
        return self._backlog(cls) if self.fleet.mixed_speeds() else None

    def _claimed(self, cls: PromptClass, n: int) -> None:
        self.fleet.metrics.claims.labels(cls.value).inc()
        self.fleet.metrics.claimed_prompts.labels(cls.value).inc(n)
        self.claims += 1
        self.claimed_prompts += n
        if (read := self._backlogs.get(cls)) is not None:
            read[1] -= n
        if self.on_claimed is not None:
            self.on_claimed(cls)

    def _backlog(self, cls: PromptClass) -> int | None:
        """Prompts of ``cls`` left to dispatch fleet-wide, read at most every BACKLOG_REFRESH_S."""
        now = time.monotonic()
        read = self._backlogs.get(cls)
        if read is None or now - read[0] >= BACKLOG_REFRESH_S:
            try:
                read = self._backlogs[cls] = [now, float(self.dispatch.depth(cls))]
            except redis.RedisError:
                return None
        return max(0, int(read[1]))

    def _min_batch(self, cls: PromptClass) -> int:
        return max(1, self.fleet.capacity(cls) // CLAIM_BATCH_DIVISOR)

    async def _wait_freed(self, timeout_s: float) -> None:
        self.slots.freed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.slots.freed.wait(), timeout=timeout_s)

    async def _wait_for_work(self, cls: PromptClass, timeout_s: float, *, held: bool) -> bool:
        """Wait for a wake-up, a poll's timeout or a stop; True if woken. ``held``: the claim that
        found nothing was asked for by a wake-up, so the wake-ups of the next ``WAKE_COALESCE_S``
        count as one (a flood of them must not become a claim each); after an idle poll a wake-up
        is answered at once, so a new job's first prompts start within a round trip."""
        if self.wakeups is None:
            await asyncio.sleep(timeout_s)
            return False
        hold_until = asyncio.get_running_loop().time() + WAKE_COALESCE_S if held else 0.0
        wake = asyncio.ensure_future(self.wakeups.wait(cls, timeout_s, hold_until=hold_until))
        # A stop must not wait out a long idle poll, nor burst mode the end of its last prompt.
        waiters = {wake, asyncio.ensure_future(self.slots.stopping.wait())}
        if self.burst and not self.slots.empty.is_set():
            waiters.add(asyncio.ensure_future(self.slots.empty.wait()))
        try:
            done, _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            return wake in done and wake.result()
        finally:
            for waiter in waiters:
                waiter.cancel()

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
