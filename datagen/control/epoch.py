"""Telling whether Redis still holds what this process saw: its **epoch**.

Many people run Redis without persistence (a container restarted without its volume), or fail over
to a replica that lags, or restore a snapshot. Redis then answers as if nothing happened, with less
than it had. The epoch (`datagen.control.keys.Keys.epoch`) makes that visible: a hash with an ``id``, made
by the coordinator when it finds none, and a ``seq``, a time in ms that the coordinator stamps
every check (never lower than before):

- ``id`` gone (or another one): Redis lost its data, or it is another dataset (`EpochChange.LOST`);
- ``seq`` lower than the coordinator's last stamp: Redis went back to an older snapshot
  (`EpochChange.ROLLED_BACK`).

The coordinator then rebuilds jobs from storage (`service.rebuild`), and stamps again only after
that. Workers read both: a new ``id`` makes them publish their servers again, and a ``seq`` lower
than the highest they saw (their ``floor``) makes the claim script hand out nothing
(`datagen.control.dispatch`), so that no worker runs the prompts a restored snapshot put back in the
backlogs before the coordinator has rebuilt their jobs; its next stamp lets them go on.
"""

from __future__ import annotations

import enum
import time
import uuid

from redis import Redis

from datagen.control.keys import Keys
from datagen.control.redistext import as_text

__all__ = ["EpochChange", "EpochWatch"]


class EpochChange(enum.Enum):
    SAME = "same"
    FIRST = "first"  # this process's first look
    LOST = "lost"
    ROLLED_BACK = "rolled back"


class EpochWatch:
    """One process's view of the epoch. Not thread-safe: one thread checks it (the coordinator's
    watch, a worker's fleet sync); others only read ``floor``."""

    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.key = keys.epoch()
        self.id: str | None = None
        # The highest ``seq`` seen (a worker), or last stamped (the coordinator).
        self.floor = 0
        # Whether the first look found no epoch (a new Redis, or one that lost its data).
        self.found_none = False
        self._seen = False
        self._read_seq = 0
        # The last look found the epoch gone or replaced: the next stamp writes a new ``id``.
        self._renew = False

    # The coordinator ------------------------------------------------------------------------------
    def look(self) -> EpochChange:
        """What changed since this process's last :meth:`stamp` (nothing is written)."""
        raw_id, raw_seq = self.redis.hmget(self.key, ["id", "seq"])
        current = as_text(raw_id) if raw_id is not None else None
        seq = int(raw_seq or 0)
        self._read_seq = seq
        if not self._seen:
            self._seen, self.found_none, self.id = True, current is None, current
            return EpochChange.FIRST
        if current is None or current != self.id:
            # ``id`` stays the old one until the stamp: a rebuild that fails is tried again.
            self._renew = True
            return EpochChange.LOST
        if seq < self.floor:
            return EpochChange.ROLLED_BACK
        return EpochChange.SAME

    @property
    def read_seq(self) -> int:
        """The ``seq`` the last :meth:`look` read (0: none)."""
        return self._read_seq

    def stamp(self) -> None:
        """Write a new ``seq`` (and an ``id`` if Redis has none): call after :meth:`look`, once
        whatever it found is dealt with.

        After a loss the ``id`` is a new one, never the old one written back: a worker that did
        not look while Redis was empty must still see the loss, or it never publishes its
        servers again."""
        seq = max(int(time.time() * 1000), self._read_seq + 1, self.floor + 1)
        new_id = uuid.uuid4().hex[:16] if self._renew or self.id is None else self.id
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.hsetnx(self.key, "id", new_id)
            pipe.hset(self.key, "seq", seq)
            pipe.hget(self.key, "id")
            _, _, raw_id = pipe.execute()
        self.id, self.floor, self._renew = as_text(raw_id), seq, False

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
        first = not self._seen
        # Another Redis (or one that lost everything): its sequence starts afresh.
        self._seen, self.id, self.floor = True, current, seq
        return EpochChange.FIRST if first else EpochChange.LOST
