"""Long polls of ``GET /jobs/{id}?wait_s=``, shared and capped so they cannot starve the coordinator.

A long poll holds its connection until its job ends or ``wait_s`` passes. Every waiting poll is
served by one watcher task, which reads the states of all the jobs polled in one pipeline (one
round trip, one thread) every `LONG_POLL_CHECK_S`: a thousand polls cost Redis and the thread pool
what one does. At most `MAX_LONG_POLLS_PER_JOB` polls of one job and `MAX_LONG_POLLS` in all wait at
once; a poll beyond either cap is answered at once with the job as it is (as with ``wait_s=0``) and
the header ``X-Long-Poll: capped``, so the connections, file descriptors and threads of ``/healthz``
and every other route stay free. ``datagen submit --wait`` then asks again after its own interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

from starlette.concurrency import run_in_threadpool

from datagen.control.jobs import JobStore
from datagen.states import JobState

__all__ = ["CAPPED_HEADER", "LONG_POLL_CHECK_S", "MAX_LONG_POLLS", "MAX_LONG_POLLS_PER_JOB", "LongPolls"]

log = logging.getLogger(__name__)

# Polls of one job that may wait at once (one `datagen submit --wait` holds one), and polls in all:
# each holds a connection (a file descriptor) until its job ends or its wait_s passes.
MAX_LONG_POLLS_PER_JOB = 32
MAX_LONG_POLLS = 256
# How often the watcher reads the polled jobs' states (one pipeline): a poll answers within this of
# its job's end, so `datagen submit --wait` exits within a fraction of a second of it.
LONG_POLL_CHECK_S = 0.05
# The header of an answer whose wait a cap refused.
CAPPED_HEADER = ("X-Long-Poll", "capped")


class LongPolls:
    """The long polls waiting in one coordinator (used from its event loop only)."""

    def __init__(
        self,
        jobs: JobStore,
        *,
        per_job: int = MAX_LONG_POLLS_PER_JOB,
        total: int = MAX_LONG_POLLS,
        check_s: float = LONG_POLL_CHECK_S,
    ) -> None:
        self.jobs = jobs
        self.per_job = per_job
        self.total = total
        self.check_s = check_s
        self._waiting: dict[str, int] = {}  # job -> polls waiting on it
        self._ended: dict[str, asyncio.Event] = {}  # job -> set when it ends (or cannot be read)
        self._watcher: asyncio.Task[None] | None = None

    @property
    def waiting(self) -> int:
        return sum(self._waiting.values())

    async def wait(self, job_id: str, wait_s: float) -> bool:
        """Wait until the job ends or ``wait_s`` passes. False, at once, when a cap leaves no room
        (the caller answers with the job as it is). A job that is gone, or a Redis that cannot be
        read, ends the wait: the caller's own read of the job then answers what is wrong."""
        if wait_s <= 0:
            return True
        if self.waiting >= self.total or self._waiting.get(job_id, 0) >= self.per_job:
            return False  # before any read: a poll beyond the caps costs what a plain GET does
        self._waiting[job_id] = self._waiting.get(job_id, 0) + 1  # its place, before any await
        try:
            if _over((await run_in_threadpool(self._states, [job_id]))[0]):
                return True
            ended = self._ended.setdefault(job_id, asyncio.Event())
            if self._watcher is None or self._watcher.done():
                self._watcher = asyncio.create_task(self._watch(), name="long-polls")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ended.wait(), wait_s)
            return True
        finally:
            self._waiting[job_id] -= 1
            if not self._waiting[job_id]:
                del self._waiting[job_id]
                self._ended.pop(job_id, None)

    def _states(self, job_ids: Sequence[str]) -> list[JobState | None]:
        """The jobs' states, in order, in one round trip (None: no such job)."""
        return [None if row is None else JobState(row[0]) for row in self.jobs.states(job_ids)]

    async def _watch(self) -> None:
        """Read the polled jobs' states until no poll waits; wake the polls of each job that ended."""
        while self._waiting:
            job_ids = list(self._waiting)
            try:
                states = await run_in_threadpool(self._states, job_ids)
                over = [job_id for job_id, state in zip(job_ids, states, strict=True) if _over(state)]
            except Exception as exc:  # Redis away: every poll answers now, with what its own read finds
                log.debug("long polls: cannot read the jobs' states: %s", exc)
                over = job_ids
            for job_id in over:
                ended = self._ended.pop(job_id, None)
                if ended is not None:
                    ended.set()
            await asyncio.sleep(self.check_s)


def _over(state: JobState | None) -> bool:
    """Nothing more to wait for: the job ended, or is gone."""
    return state is None or state.is_final
