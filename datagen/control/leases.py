"""Leases in Redis: at most one holder at a time across every process of a namespace.

A lease is a key set (if free) to a random token with a time to live, in one script; its holder
renews it from a thread while it works (every third of its time to live) and gives it back when
done, both only while the key still holds its token. Given back after its work succeeded, a lease
can leave a **done marker** (``done:<token>``) for a short while instead of nothing: whoever comes
for the lease meanwhile learns that this work has just been done (a recover asked a moment after
another ended joins it, `service.rebuild`), and may still take the lease over it.

The token is also a **fencing token**: a write that must not land after the holder lost its lease
(a process that stalled past the lease's time, then woke up) is made in one script that first
checks that the lease still holds the token (``create.lua``), or carries the token in a value the
write is checked against (a job's ingest fence, ``service.ingest``). Redis does both the check and
the write, so no clock of any process takes part (a lease's time to live is Redis's own).

The coordinator takes two kinds (`datagen.control.keys`): ``{ns}:reconcile``, held while one
coordinator holds every stored job to Redis after Redis lost or rolled back its data, and
``{ns}:job:<id>:rebuild``, held while one job is rebuilt (`service.rebuild`).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import NamedTuple

from redis import Redis, RedisError

from datagen.control.redistext import as_text
from datagen.control.scripts import KEY, LuaScript, ScriptArgs
from datagen.errors import JobStateError

__all__ = ["DONE_PREFIX", "LEASE_TTL_MS", "Fencing", "HeldLease", "LeaseLostError", "Leases", "done_token"]

log = logging.getLogger(__name__)

# A lease's time to live; its holder renews it every third of that while it works.
LEASE_TTL_MS = 30_000
# How often a process waiting for another's lease looks whether it is gone.
WAIT_POLL_S = 0.05
# What a lease given back with a done marker holds: this, then the token of the work that was done.
DONE_PREFIX = "done:"


def done_token(value: str | None) -> str | None:
    """The token of the work a done marker says has just been done (None: not a done marker)."""
    return value[len(DONE_PREFIX) :] if value is not None and value.startswith(DONE_PREFIX) else None


class LeaseLostError(JobStateError):
    """The lease expired or another process holds it now: this holder must write nothing more."""


class Fencing(NamedTuple):
    """What a fenced write checks: the lease's key and the token it must hold."""

    key: str
    token: str


# The scripts' arguments: named and ordered as the signature of datagen/control/lua/<script>.lua.
@dataclass(frozen=True)
class LeaseAcquireArgs(ScriptArgs):
    script = "lease_acquire"
    lease: str = field(metadata=KEY)
    token: str
    ttl_ms: int
    over_done: int


@dataclass(frozen=True)
class LeaseRenewArgs(ScriptArgs):
    script = "lease_renew"
    lease: str = field(metadata=KEY)
    token: str
    ttl_ms: int


@dataclass(frozen=True)
class LeaseReleaseArgs(ScriptArgs):
    script = "lease_release"
    lease: str = field(metadata=KEY)
    token: str
    done_ms: int


class Leases:
    """Takes, waits for and renews leases on one Redis."""

    def __init__(self, redis: Redis, *, ttl_ms: int = LEASE_TTL_MS) -> None:
        self.redis = redis
        self.ttl_ms = ttl_ms
        self._acquire = LuaScript(redis, LeaseAcquireArgs)
        self._renew = LuaScript(redis, LeaseRenewArgs)
        self._release = LuaScript(redis, LeaseReleaseArgs)

    def try_acquire(self, key: str, *, done_ms: int = 0, over_done: bool = False) -> HeldLease | str:
        """The lease if it is free (``over_done``: or holds a done marker), renewed from a thread
        while its ``with`` block runs; else what holds it now (a holder's token, or a done
        marker). ``done_ms``: given back after its work was done (`HeldLease.done`), it leaves a
        done marker for that long (0: nothing)."""
        token = secrets.token_hex(8)
        args = LeaseAcquireArgs(lease=key, token=token, ttl_ms=self.ttl_ms, over_done=int(over_done))
        acquired, held = self._acquire(args)
        if acquired:
            return HeldLease(self, key, token, done_ms=done_ms)
        return as_text(held)

    def holder(self, key: str) -> str | None:
        """What holds the lease now: a holder's token, or a done marker (None: nothing)."""
        raw = self.redis.get(key)
        return as_text(raw) if raw is not None else None

    def wait_released(self, key: str, token: str, timeout_s: float) -> bool:
        """Wait until ``token`` no longer holds the lease (released, or expired after its holder
        died); False if it still does after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self.holder(key) == token:
            if time.monotonic() >= deadline:
                return False
            time.sleep(WAIT_POLL_S)
        return True

    def renew(self, key: str, token: str) -> bool:
        return bool(self._renew(LeaseRenewArgs(lease=key, token=token, ttl_ms=self.ttl_ms)))

    def release(self, key: str, token: str, *, done_ms: int = 0) -> None:
        self._release(LeaseReleaseArgs(lease=key, token=token, done_ms=done_ms))


class HeldLease:
    """A lease this process holds: a context manager that renews it while the block runs and
    releases it at the end. :meth:`check` raises `LeaseLostError` once it is lost."""

    def __init__(self, leases: Leases, key: str, token: str, *, done_ms: int = 0) -> None:
        self.leases = leases
        self.key = key
        self.token = token
        self.done_ms = done_ms
        self._work_done = False
        self.lost = threading.Event()
        self._done = threading.Event()
        self._keeper: threading.Thread | None = None

    @property
    def fencing(self) -> Fencing:
        return Fencing(self.key, self.token)

    def __enter__(self) -> HeldLease:
        self._keeper = threading.Thread(target=self._keep, name=f"lease-{self.key}", daemon=True)
        self._keeper.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._done.set()
        if self._keeper is not None:
            self._keeper.join()
        try:
            done_ms = self.done_ms if self._work_done and exc is None else 0
            self.leases.release(self.key, self.token, done_ms=done_ms)
        except RedisError as error:  # it expires by itself
            log.warning("cannot release the lease %s: %s", self.key, error)

    def done(self) -> None:
        """Its work is done: given back, the lease leaves a done marker (if it was taken with one)."""
        self._work_done = True

    def check(self) -> None:
        """Raise `LeaseLostError` unless the lease still holds this token (one round trip)."""
        if self.lost.is_set() or self.leases.holder(self.key) != self.token:
            self.lost.set()
            raise LeaseLostError(
                f"the lease {self.key} expired or another coordinator took it; this one stops "
                "and writes nothing more (the other's work stands)"
            )

    def _keep(self) -> None:
        interval_s = self.leases.ttl_ms / 3000
        while not self._done.wait(interval_s):
            try:
                if not self.leases.renew(self.key, self.token):
                    self.lost.set()
                    log.warning("lost the lease %s (it expired, or another holds it)", self.key)
                    return
            except RedisError as error:  # tried again; past its time the lease is lost anyway
                log.warning("cannot renew the lease %s: %s", self.key, error)
