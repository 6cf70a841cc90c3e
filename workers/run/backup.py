"""Backup requests for stragglers at the end of a run (MapReduce's backup tasks).

Once a class's backlog is empty here (a claim found nothing: :meth:`Backups.on_claim_empty`) and
until a claim finds work again (:meth:`Backups.on_claimed`), free slots on fast servers would sit
idle while slow servers finish their last, often long, requests alone. So each prompt running on a
slower server may get one backup: the same request (same prompt, same sampling parameters, hence
the same tokens for greedy or seeded sampling) on a server measured faster (seconds per output
token, `workers.fleet.servers.Server.s_per_token`) that has a free slot. The prompt's task races the two
(:meth:`Backups.race`), keeps the first answer and cancels the other, which closes its HTTP request
so that SGLang aborts it. Both live inside one prompt task that returns one record: a backup can
never store or count a prompt twice, and a worker killed mid-race loses both requests together
like any in-flight prompt (the reaper hands it out again).

Which prompts: oldest first, each onto the fastest server that is not already tried for this
prompt, has a free slot now (never queued behind real work), is not paused, down or refused (those
have no free slots), gives the prompt the same ``max_new_tokens``, and is fast enough for the
backup to win at all: at most ``BACKUP_MAX_SPEED_RATIO`` of the primary server's seconds per token,
and able to catch up with what the primary has generated so far within ``max_new_tokens``. A
running backup is cancelled when its class is paused or its server stops taking requests;
cancelling the prompt (a job cancelled with abort, a hard stop) cancels both requests.

A request outstanding ``HUNG_MARGIN`` times longer than ``max_new_tokens`` at its server's seconds
per token is overdue: its server is probably hung (SGLang's ``/generate`` is not streamed, so there
is no progress to watch). It may be backed up at any time, even while the backlog is not empty, on
any server with a free slot (the next one freed), however fast; the hung server's health probe
then usually marks it down, which abandons its requests (`workers.run.generate`).
``WorkerSettings.backup_requests`` (``DATAGEN_BACKUP_REQUESTS``) turns backups off.

How each backup ended is counted in ``datagen_worker_backup_requests{outcome}``: ``won`` (it
answered first and its record is stored), ``lost`` (the primary answered first), ``failed`` (it got
an error; the primary went on), ``stopped`` (its class was paused or its server left) and
``cancelled`` (the prompt's task was cancelled).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from datagen.errors import RetryableError
from datagen.states import PromptClass
from workers.fleet.servers import Fleet, Server
from workers.metrics import WorkerMetrics

__all__ = ["BACKUP_MAX_SPEED_RATIO", "Backups", "Straggler"]

log = logging.getLogger(__name__)

T = TypeVar("T")

# A backup goes only to a server whose seconds per output token are at most this share of the
# primary's server's: from scratch on a server about as fast it would rarely catch up.
BACKUP_MAX_SPEED_RATIO = 0.8
# How often a racing prompt checks whether its backup must stop (class paused, server left).
STOP_CHECK_INTERVAL_S = 0.25
# A request outstanding longer than this multiple of ``max_new_tokens`` times its server's seconds
# per token should have answered long ago: its server is probably hung (SGLang's /generate is not
# streamed, so no progress can be seen). Such a request may be backed up at any time, not only at
# the end of a backlog, on any server with a free slot, however fast.
HUNG_MARGIN = 3.0


@dataclass(eq=False)
class Straggler:
    """A primary request in flight, as :class:`Backups` sees it."""

    server: Server
    cls: PromptClass
    started: float  # time.monotonic()
    # The request's max_new_tokens, and whether a backup on a server would send the same request.
    max_new: int
    fits: Callable[[Server], bool]
    # Servers this prompt already failed on.
    avoid: frozenset[str]
    # Set to the backup's server (its slot already taken) when a backup should start.
    offer: asyncio.Future[Server] = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    @property
    def backup_server(self) -> Server | None:
        return self.offer.result() if self.offer.done() and not self.offer.cancelled() else None

    def overdue_in_s(self) -> float | None:
        """Seconds until this request is overdue (``HUNG_MARGIN``), negative once it is; None
        while its server's speed is not measured."""
        own = self.server.s_per_token
        if own is None:
            return None
        return self.started + HUNG_MARGIN * self.max_new * own - time.monotonic()


class Backups:
    def __init__(
        self,
        fleet: Fleet,
        metrics: WorkerMetrics,
        *,
        enabled: bool,
        is_paused: Callable[[PromptClass], bool],
        stop_check_interval_s: float = STOP_CHECK_INTERVAL_S,
    ) -> None:
        self.fleet = fleet
        self.metrics = metrics
        self.enabled = enabled
        self.is_paused = is_paused
        self.stop_check_interval_s = stop_check_interval_s
        self._running: dict[PromptClass, set[Straggler]] = {cls: set() for cls in PromptClass}
        # Those found overdue (by their race's timer): a freed slot looks at these only, not at
        # every request in flight (hundreds per class), so a slot's turn costs nothing when none is.
        self._overdue: dict[PromptClass, set[Straggler]] = {cls: set() for cls in PromptClass}
        # Classes whose backlog is empty here: backups are considered whenever a slot frees.
        self._draining: set[PromptClass] = set()

    # Admission's calls ------------------------------------------------------------------------
    def on_claim_empty(self, cls: PromptClass) -> None:
        """A claim for ``cls`` found nothing while this worker had room: back up stragglers."""
        if not self.enabled:
            return
        self._draining.add(cls)
        self._launch(cls)

    def on_claimed(self, cls: PromptClass) -> None:
        """A claim found work: real work takes the free slots again, no new backups."""
        self._draining.discard(cls)

    # The generator's calls --------------------------------------------------------------------
    def track(
        self,
        server: Server,
        cls: PromptClass,
        *,
        max_new: int,
        fits: Callable[[Server], bool],
        avoid: frozenset[str],
    ) -> Straggler:
        straggler = Straggler(server, cls, time.monotonic(), max_new, fits, avoid)
        self._running[cls].add(straggler)
        return straggler

    def mark_overdue(self, straggler: Straggler) -> None:
        """``straggler`` ran past ``HUNG_MARGIN``: a backup may take the next free slot."""
        self._overdue[straggler.cls].add(straggler)

    def freed(self, cls: PromptClass) -> None:
        """A request of ``cls`` ended and gave its slot back: a backup may take it (while the
        backlog is not empty, only a backup of an overdue request)."""
        if self.enabled:
            self._launch(cls, overdue_only=cls not in self._draining)

    async def race(
        self,
        straggler: Straggler,
        primary: Awaitable[T],
        backup: Callable[[Server], Awaitable[T]],
        *,
        name: str,
    ) -> tuple[Server, T]:
        """Await ``primary``; if a backup is offered meanwhile, race ``backup(server)`` against it.

        Returns the server that answered first and its answer. The primary's error is raised when
        both fail (or it fails with no backup running). Whatever way this ends, the other request
        is cancelled and awaited, the backup's slot is given back and ``straggler`` is forgotten.
        """
        first = asyncio.ensure_future(primary)
        run: _BackupRun[T] | None = None
        try:
            either: set[asyncio.Future[Any]] = {first, straggler.offer}
            overdue_in_s = straggler.overdue_in_s()
            if overdue_in_s is not None:
                await asyncio.wait(
                    either, timeout=max(0.0, overdue_in_s), return_when=asyncio.FIRST_COMPLETED
                )
                if not first.done() and not straggler.offer.done():
                    # Overdue: a backup may take any free slot now, or the next one freed.
                    self.mark_overdue(straggler)
                    self._launch(straggler.cls, overdue_only=straggler.cls not in self._draining)
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            target = straggler.backup_server
            if first.done() or target is None:
                return straggler.server, await first
            run = _BackupRun(name, target, asyncio.ensure_future(backup(target)), time.monotonic())
            log.info(
                "backup of %s on %s: its request has run %.1f s on %s",
                name,
                target.name,
                time.monotonic() - straggler.started,
                straggler.server.name,
            )
            return await self._race(straggler, first, run)
        finally:
            self._running[straggler.cls].discard(straggler)
            self._overdue[straggler.cls].discard(straggler)
            straggler.offer.cancel()  # no-op once an offer was made
            await self._end(straggler, first, run)

    # Choosing backups -------------------------------------------------------------------------
    def _launch(self, cls: PromptClass, *, overdue_only: bool = False) -> None:
        # A backup runs on another server than its primary: with one server there is none, and
        # sorting every running request at each freed slot of the tail would be spent for nothing.
        if self.is_paused(cls) or len(self.fleet.generators) < 2:
            return
        pool = self._overdue[cls] if overdue_only else self._running[cls]
        if not pool:
            return
        waiting = sorted((s for s in pool if not s.offer.done()), key=lambda s: s.started)
        for straggler in waiting:
            if self.fleet.free_slots(cls) <= 0:
                return
            target = self._target(straggler, cls)
            if target is not None and self.fleet.try_acquire(target, cls):
                straggler.offer.set_result(target)

    def _target(self, straggler: Straggler, cls: PromptClass) -> Server | None:
        """The fastest free server on which a backup could still finish first, or None."""
        best: Server | None = None
        for server in self.fleet.generators:
            speed = server.s_per_token
            if (
                server is straggler.server
                or server.name in straggler.avoid
                or server.free(cls) <= 0
                or speed is None
                or not straggler.fits(server)
                or not self._could_win(straggler, speed, server)
            ):
                continue
            if best is None or speed < (best.s_per_token or 0.0):
                best = server
        return best

    @staticmethod
    def _could_win(straggler: Straggler, speed: float, server: Server) -> bool:
        """Whether a backup at ``speed`` (seconds per token) could answer before the primary.

        The primary has generated about ``elapsed / own`` tokens; starting from nothing, the
        backup finishes first only for outputs longer than ``done * own / (own - speed)``. When
        that is beyond ``max_new_tokens`` it can only lose (a slightly faster server, or a
        primary far along): it would take a slot and KV from the fast server's own last requests.
        """
        elapsed_s = time.monotonic() - straggler.started
        own = straggler.server.s_per_token
        if _overdue(straggler):
            return True  # its server is probably hung: any backup wins
        if own is None:
            # Its server was never measured: back it up once it runs longer than a typical
            # request takes on the faster one.
            return elapsed_s >= (server.latency_ewma_s or 0.0)
        if speed > BACKUP_MAX_SPEED_RATIO * own:
            return False
        done = elapsed_s / own
        return done * own / (own - speed) < straggler.max_new

    # Racing -------------------------------------------------------------------------------------
    async def _race(
        self, straggler: Straggler, first: asyncio.Future[T], run: _BackupRun[T]
    ) -> tuple[Server, T]:
        cls, target, second = straggler.cls, run.server, run.future
        while True:
            pending = {f for f in (first, second) if not f.done() and (f is first or run.live)}
            await asyncio.wait(
                pending,
                timeout=self.stop_check_interval_s if run.live else None,
                return_when=asyncio.FIRST_COMPLETED,
            )
            if run.live and second.done():
                error = RetryableError("cancelled") if second.cancelled() else second.exception()
                if error is None:
                    self._end_run(run, cls, "won")
                    return target, second.result()
                self._end_run(run, cls, "failed", error)
                if isinstance(error, RetryableError) and error.server_fault:
                    await self.fleet.mark_down(target, str(error))
                await self._drop(run, cls)
            if first.done() and (not run.live or first.exception() is None):
                if run.live:
                    self._end_run(run, cls, "lost")
                return straggler.server, first.result()  # the primary's answer, or its error
            if run.live and (self.is_paused(cls) or not target.accepting):
                self._end_run(run, cls, "stopped")
                await self._drop(run, cls)

    async def _end(self, straggler: Straggler, first: asyncio.Future[T], run: _BackupRun[T] | None) -> None:
        """Cancel and await what still runs; give the backup's slot back."""
        cls = straggler.cls
        if run is not None and run.live:
            # Leaving while both ran: the prompt's task was cancelled (job aborted, hard stop).
            self._end_run(run, cls, "cancelled")
        first.cancel()  # no-op once done
        try:
            # Shielded: a second cancel must not leave a request open.
            await asyncio.shield(asyncio.gather(first, return_exceptions=True))
        finally:
            if run is not None:
                await self._drop(run, cls)
            elif (offered := straggler.backup_server) is not None:
                # Offered a slot, but the primary answered before the backup started.
                await self._give_back(offered, cls)

    async def _drop(self, run: _BackupRun[T], cls: PromptClass) -> None:
        """Close the backup's request if it still runs and give its slot back, once."""
        run.future.cancel()  # no-op once done
        try:
            await asyncio.shield(asyncio.gather(run.future, return_exceptions=True))
        finally:
            if not run.released:
                run.released = True
                await self._give_back(run.server, cls)

    async def _give_back(self, server: Server, cls: PromptClass) -> None:
        await self.fleet.release(server, cls)
        self.freed(cls)

    def _end_run(
        self, run: _BackupRun[T], cls: PromptClass, outcome: str, error: BaseException | None = None
    ) -> None:
        run.live = False
        self.metrics.backup_requests.labels(run.server.name, cls.value, outcome).inc()
        log.info(
            "backup of %s on %s %s after %.1f s%s",
            run.name,
            run.server.name,
            outcome,
            time.monotonic() - run.started,
            f": {error}" if error is not None else "",
        )


def _overdue(straggler: Straggler) -> bool:
    overdue_in_s = straggler.overdue_in_s()
    return overdue_in_s is not None and overdue_in_s <= 0


@dataclass(eq=False)
class _BackupRun(Generic[T]):
    """A backup request racing its primary; ``live`` until its outcome is counted."""

    name: str
    server: Server
    future: asyncio.Future[T]
    started: float  # time.monotonic()
    live: bool = True
    released: bool = False  # its slot was given back
