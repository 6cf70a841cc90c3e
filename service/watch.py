"""The coordinator's watch over Redis's epoch (`datagen.control.epoch`): at start and every second
after, it tells whether Redis lost or rolled back its data, and then has the stored jobs held to
it (`service.rebuild`) by **one** coordinator of the namespace.

Every coordinator ticks the epoch while nothing changed. One that sees a change takes the
``{ns}:reconcile`` lease (`datagen.control.leases`) and looks again under it: if another
coordinator reconciled and settled the epoch meanwhile, it takes that epoch as its own
(`EpochChange.SETTLED`) and rebuilds nothing; otherwise it reconciles, settles the epoch (which
lets every other coordinator and worker go on) and releases the lease. A coordinator that finds the
lease held leaves the change to its holder and looks again a second later. A coordinator starting
takes the lease for its start-up reconcile too (waiting for a holder), so a start never races a
rebuild either.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from redis import RedisError

from datagen.control.epoch import EpochChange, EpochWatch
from datagen.control.jobs import JobStore
from datagen.control.keys import Keys
from datagen.control.leases import HeldLease, Leases
from datagen.errors import DatagenError
from service.rebuild import Rebuilder, Suspicion

__all__ = ["EPOCH_CHECK_S", "RedisWatch"]

log = logging.getLogger(__name__)

# How often the coordinator checks Redis's epoch: two round trips, a read and the tick's script.
EPOCH_CHECK_S = 1.0
# How long a starting coordinator waits for another's reconcile before it starts without its own.
START_WAIT_S = 300.0
START_POLL_S = 0.2
JOIN_TIMEOUT_S = 10.0

_LOST = "Redis lost its data"
_ROLLED_BACK = "Redis went back to an older snapshot"


class RedisWatch:
    def __init__(
        self,
        epoch: EpochWatch,
        leases: Leases,
        keys: Keys,
        jobs: JobStore,
        rebuilder: Rebuilder,
        *,
        resume: Callable[[], None],
        check_s: float = EPOCH_CHECK_S,
    ) -> None:
        self.epoch = epoch
        self.leases = leases
        self.keys = keys
        self.jobs = jobs
        self.rebuilder = rebuilder
        self.resume = resume  # resumes the jobs Redis says are ingesting with no thread here
        self.check_s = check_s
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self._waiting: EpochChange | None = None  # a change left to another coordinator (logged once)

    def start_up(self) -> bool:
        """The coordinator's start: hold the stored jobs to Redis and settle the epoch, under the
        reconcile lease. False when Redis had no data and storage failed: the watch tries again."""
        lease = self._wait_for_lease()
        if lease is None:
            log.warning(
                "another coordinator has held the reconcile lease for over %.0f s; starting without "
                "holding the stored jobs to Redis (its own reconcile does)",
                START_WAIT_S,
            )
            self.epoch.look()
            self.epoch.adopt()
            return True
        with lease:
            self.epoch.look()
            # No epoch and no job: a new Redis, or one that lost its data while nothing watched it.
            lost = self.epoch.found_none and not self.jobs.index.list_ids(1)
            why = "Redis had no data at coordinator start" if lost else "coordinator start"
            suspicion = Suspicion(why, lost=lost, epoch_id=self.epoch.read_id, epoch_seq=self.epoch.read_seq)
            try:
                self.rebuilder.reconcile(suspicion)
            except DatagenError as exc:
                # Storage failing now: the watch tries again while Redis has no epoch.
                log.warning("cannot hold the stored jobs to Redis at start: %s", exc)
                if lost:
                    return False
            # After the rebuild: workers that saw Redis go back in time go on now.
            self.epoch.settle(rebuilt=lost)
        return True

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="epoch-watch", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closing.set()
        if self._thread is not None:
            self._thread.join(timeout=JOIN_TIMEOUT_S)

    def _run(self) -> None:
        while not self._closing.wait(self.check_s):
            try:
                self.check()
            except (RedisError, DatagenError) as exc:
                # Redis or storage away: the next check tries again (and sees what changed).
                log.warning("cannot check Redis's epoch or rebuild jobs: %s", exc)
            except Exception:  # a bug must not end the watch silently
                log.exception("the epoch watch failed; it goes on")

    def check(self) -> EpochChange:
        """One look at the epoch, and what it calls for; returns what the look saw."""
        change = self.epoch.look()
        if change in (EpochChange.SAME, EpochChange.SETTLED, EpochChange.FIRST):
            self._carry_on(change)
            return change
        lease = self.leases.try_acquire(self.keys.reconcile_lease())
        if not isinstance(lease, HeldLease):
            if self._waiting is not change:
                log.warning("%s; another coordinator is rebuilding jobs from storage", _said(change))
                self._waiting = change
            return change
        with lease:
            change = self.epoch.look()  # again, under the lease: another may have settled it
            if change in (EpochChange.SAME, EpochChange.SETTLED, EpochChange.FIRST):
                self._carry_on(change)
                return change
            self._reconcile(change, lease)
        self.resume()
        return change

    def _carry_on(self, change: EpochChange) -> None:
        if change is EpochChange.SAME:
            self.epoch.tick()
            return
        if change is EpochChange.SETTLED:
            log.warning(
                "another coordinator rebuilt jobs from storage after Redis lost or rolled back its data"
            )
        self.epoch.adopt()
        self._waiting = None

    def _reconcile(self, change: EpochChange, lease: HeldLease) -> None:
        self._waiting = None
        if change is EpochChange.LOST:
            log.warning("%s; rebuilding jobs from storage", _said(change))
            self.rebuilder.reconcile(Suspicion(_LOST, lost=True))
        else:
            log.warning("%s; rebuilding live jobs from storage", _said(change))
            self.rebuilder.reconcile(Suspicion(_ROLLED_BACK, lost=True, rolled_back=True))
        lease.check()  # a reconcile that outlived its lease leaves the settle to the new holder
        self.epoch.settle(rebuilt=True)

    def _wait_for_lease(self) -> HeldLease | None:
        deadline = time.monotonic() + START_WAIT_S
        said = False
        while not isinstance(lease := self.leases.try_acquire(self.keys.reconcile_lease()), HeldLease):
            if time.monotonic() >= deadline:
                return None
            if not said:
                log.info("another coordinator is holding the stored jobs to Redis; waiting for it")
                said = True
            time.sleep(START_POLL_S)
        return lease


def _said(change: EpochChange) -> str:
    if change is EpochChange.LOST:
        return f"{_LOST} (its epoch is gone)"
    return _ROLLED_BACK
