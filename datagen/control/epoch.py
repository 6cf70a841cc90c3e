"""Telling whether Redis still holds what this process saw: its **epoch**.

Many people run Redis without persistence (a container restarted without its volume), or fail over
to a replica that lags, or restore a snapshot. Redis then answers as if nothing happened, with less
than it had. The epoch (`datagen.control.keys.Keys.epoch`) makes that visible, with no clock: a hash
with an ``id`` naming the dataset and a ``seq`` **counter** that only Redis moves.

- Every second each coordinator **ticks** it (``epoch_tick.lua``): ``seq`` + 1, in one script, and
  only while the epoch still has the ``id`` the coordinator knows and a ``seq`` not below its
  ``floor`` (its own last tick). So every tick moves ``seq`` forward, whoever makes it and however
  their clocks differ, and no tick ever lifts a rolled-back ``seq`` back over anyone's floor.
- ``id`` gone: Redis lost its data (`EpochChange.LOST`). ``seq`` below this process's floor, or an
  ``id`` this process knew before: Redis went back to an older snapshot (`EpochChange.ROLLED_BACK`).
- The coordinator that reconciles such a change (one at a time: the ``{ns}:reconcile`` lease,
  `service.coordinator`) **settles** the epoch afterwards (``epoch_settle.lua``): an ``id`` if Redis
  has none, ``rebuilt`` = 1 (it held every stored job to Redis), and ``seq`` lifted by `SETTLE_JUMP`
  over both Redis's value and its own floor. The jump is more than every coordinator together ticks
  in decades, so the settled ``seq`` is above every floor any process holds: the other
  coordinators then see nothing to do (a new ``id`` with ``rebuilt`` set is `EpochChange.SETTLED`:
  they take it as theirs, not rebuilding a second time) and workers claim again.

Workers read both (`EpochWatch.saw`, in their fleet sync): a new ``id`` makes them publish their
servers again, and a ``seq`` lower than the highest they saw (their ``floor``) makes the claim
script hand out nothing (`datagen.control.dispatch`), so that no worker runs the prompts a restored
snapshot put back in the backlogs before a coordinator has rebuilt their jobs; the settle lets them
go on.
"""

from __future__ import annotations

import enum
import uuid
from collections import deque
from dataclasses import dataclass, field

from redis import Redis

from datagen.control.keys import Keys
from datagen.control.redistext import as_text
from datagen.control.scripts import KEY, LuaScript, ScriptArgs

__all__ = ["SETTLE_JUMP", "EpochChange", "EpochWatch"]

# How far a settle lifts ``seq`` past the highest value its coordinator knows: above every floor
# another process may hold (each coordinator ticks once a second: ten of them tick 2**32 in 13 years).
# Redis counts in 64 bits and Lua exactly to 2**53: two million settles.
SETTLE_JUMP = 2**32
# The ids a process remembers (an older one back in Redis is a snapshot restored from before it).
PAST_IDS = 16
# The ``rebuilt`` field of a settled epoch: its coordinator held every stored job to Redis.
REBUILT = "1"


class EpochChange(enum.Enum):
    SAME = "same"
    FIRST = "first"  # this process's first look
    LOST = "lost"
    ROLLED_BACK = "rolled back"
    # Another coordinator reconciled a loss or rollback and settled the epoch: nothing to rebuild.
    SETTLED = "settled elsewhere"


# The scripts' arguments: named and ordered as the signature of datagen/control/lua/<script>.lua.
@dataclass(frozen=True)
class EpochTickArgs(ScriptArgs):
    script = "epoch_tick"
    epoch: str = field(metadata=KEY)
    expected_id: str
    floor: int


@dataclass(frozen=True)
class EpochSettleArgs(ScriptArgs):
    script = "epoch_settle"
    epoch: str = field(metadata=KEY)
    new_id: str
    floor: int
    jump: int
    rebuilt: str


class EpochWatch:
    """One process's view of the epoch. Not thread-safe: one thread checks it (the coordinator's
    watch, a worker's fleet sync); others only read ``floor``."""

    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.key = keys.epoch()
        self.id: str | None = None
        # The highest ``seq`` seen (a worker), or last ticked or settled (the coordinator).
        self.floor = 0
        # Whether the first look found no epoch (a new Redis, or one that lost its data).
        self.found_none = False
        self.past: deque[str] = deque(maxlen=PAST_IDS)
        self._seen = False
        self._read_id: str | None = None
        self._read_seq = 0
        self._tick = LuaScript(redis, EpochTickArgs)
        self._settle = LuaScript(redis, EpochSettleArgs)

    # The coordinator ------------------------------------------------------------------------------
    def look(self) -> EpochChange:
        """What changed since this process's last tick or settle (nothing is written)."""
        raw_id, raw_seq, raw_rebuilt = self.redis.hmget(self.key, ["id", "seq", "rebuilt"])
        current = as_text(raw_id) if raw_id is not None else None
        seq = int(raw_seq or 0)
        self._read_id, self._read_seq = current, seq
        if not self._seen:
            self._seen, self.found_none, self.id = True, current is None, current
            return EpochChange.FIRST
        if current is None:
            return EpochChange.LOST
        if current == self.id:
            return EpochChange.ROLLED_BACK if seq < self.floor else EpochChange.SAME
        if current in self.past:  # an id this process had before: an older snapshot, or its settle
            return EpochChange.ROLLED_BACK if seq < self.floor else EpochChange.SETTLED
        rebuilt = raw_rebuilt is not None and as_text(raw_rebuilt) == REBUILT
        return EpochChange.SETTLED if rebuilt else EpochChange.LOST

    def current(self) -> tuple[str | None, int]:
        """The epoch's ``id`` and ``seq`` in Redis now (read only: safe from any thread)."""
        raw_id, raw_seq = self.redis.hmget(self.key, ["id", "seq"])
        return (as_text(raw_id) if raw_id is not None else None), int(raw_seq or 0)

    @property
    def read_id(self) -> str | None:
        """The ``id`` the last :meth:`look` read (None: none)."""
        return self._read_id

    @property
    def read_seq(self) -> int:
        """The ``seq`` the last :meth:`look` read (0: none)."""
        return self._read_seq

    def adopt(self) -> None:
        """Take the epoch the last :meth:`look` read as this process's (`EpochChange.SETTLED`)."""
        self._remember(self._read_id)
        self.floor = self._read_seq

    def tick(self) -> bool:
        """``seq`` + 1, only while the epoch is the one this process knows (same ``id``, ``seq``
        not below its floor); returns whether it moved (if not, the next look says why)."""
        if self.id is None:
            return False
        _, seq, moved = self._tick(EpochTickArgs(epoch=self.key, expected_id=self.id, floor=self.floor))
        if moved:
            self.floor = int(seq)
        return bool(moved)

    def settle(self, *, rebuilt: bool) -> None:
        """After a reconcile (`service.rebuild`): an ``id`` if Redis has none, ``seq`` lifted past
        every floor (`SETTLE_JUMP`), and ``rebuilt`` when the reconcile held every stored job to a
        Redis that lost or rolled back its data (other coordinators then take the epoch as it is).

        After a loss the ``id`` is a new one, never the old one written back: a worker that did
        not look while Redis was empty must still see the loss, or it never publishes its
        servers again."""
        args = EpochSettleArgs(
            epoch=self.key,
            new_id=uuid.uuid4().hex[:16],
            floor=self.floor,
            jump=SETTLE_JUMP,
            rebuilt=REBUILT if rebuilt else "",
        )
        raw_id, seq = self._settle(args)
        self._remember(as_text(raw_id))
        self.floor = int(seq)

    def _remember(self, current: str | None) -> None:
        if self.id is not None and self.id != current and self.id not in self.past:
            self.past.append(self.id)
        self.id = current

    # Workers ---------------------------------------------------------------------------------------
    def saw(self, raw_id: bytes | str | None, raw_seq: bytes | str | None) -> EpochChange:
        """A worker's check, with the epoch's fields read by the caller (in a pipeline of its own)."""
        current = as_text(raw_id) if raw_id is not None else None
        seq = int(raw_seq or 0)
        if self._seen and current == self.id:
            if seq < self.floor:
                return EpochChange.ROLLED_BACK
            self.floor = seq
            return EpochChange.SAME
        if self._seen and current is not None and current in self.past and seq < self.floor:
            return EpochChange.ROLLED_BACK  # a snapshot from before this worker's last new id
        first = not self._seen
        # Another Redis (or one that lost everything, or a settled rollback to an older id).
        self._seen = True
        self._remember(current)
        self.floor = seq
        return EpochChange.FIRST if first else EpochChange.LOST
