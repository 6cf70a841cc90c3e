"""Deterministic fault injection for ``/generate``.

A fault is chosen from a uniform draw hashed from ``(rid, attempt)``: the same sequence of
requests meets the same faults on every run. ``attempt`` counts earlier faults on the same rid,
so a client that retries a failed rid gets a fresh draw instead of failing forever.
"""

from __future__ import annotations

import hashlib
from enum import StrEnum

from simulator.config import SimConfig

__all__ = ["Fault", "FaultPlanner"]

# Messages of the real scheduler aborts these faults stand for.
QUEUE_FULL_MESSAGE = "The request queue is full."


class Fault(StrEnum):
    UNAVAILABLE = "503"  # scheduler abort with 503, e.g. --max-queued-requests full
    INTERNAL = "500"  # scheduler abort with 500, e.g. out of memory after retracting
    ABORT = "abort"  # the request is aborted mid-generation: HTTP 200, partial output


def unit_interval(key: str) -> float:
    """A uniform number in [0, 1) that depends on ``key`` only."""
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


class FaultPlanner:
    """Chooses the fault (if any) of each request; remembers only rids that met one."""

    def __init__(self, config: SimConfig) -> None:
        self._bands = (
            (Fault.UNAVAILABLE, config.fail_503_rate),
            (Fault.INTERNAL, config.fail_500_rate),
            (Fault.ABORT, config.abort_rate),
        )
        self._enabled = any(rate > 0 for _, rate in self._bands)
        self._attempts: dict[str, int] = {}

    def choose(self, rid: str) -> Fault | None:
        if not self._enabled:
            return None
        draw = unit_interval(f"{rid}#{self._attempts.get(rid, 0)}")
        edge = 0.0
        for fault, rate in self._bands:
            edge += rate
            if draw < edge:
                self._attempts[rid] = self._attempts.get(rid, 0) + 1
                return fault
        return None

    def abort_point(self, rid: str, output_len: int) -> int:
        """How many tokens an ``ABORT`` request produces before it stops (always fewer than all)."""
        return int(unit_interval(f"{rid}#{self._attempts.get(rid, 0)}#abort-at") * output_len)
