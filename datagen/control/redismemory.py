"""Redis out of memory: telling a refusal at ``maxmemory`` from other Redis errors, and saying what
to change.

With ``maxmemory`` set and ``maxmemory-policy noeviction`` (the policy this project needs: an evicting
Redis drops queued prompts and job state without a word), a Redis over its limit refuses every
command that could add data ("OOM command not allowed when used memory > 'maxmemory'"), reads and
deletes still pass. redis-py raises that as ``OutOfMemoryError``, or, from inside a script on
Redis 6, as a ``ResponseError`` quoting it. :func:`is_out_of_memory` tells both apart from an
outage; :func:`out_of_memory_error` is the one translation into
:class:`datagen.errors.RedisOutOfMemoryError`, whose message names the limit and what to change.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from redis import Redis
from redis.exceptions import OutOfMemoryError, RedisError, ResponseError

from datagen.clock import now_ms
from datagen.control.redistext import as_text
from datagen.errors import RedisOutOfMemoryError

__all__ = [
    "RECENT_REFUSAL_S",
    "REQUIRED_POLICY",
    "RedisMemory",
    "RefusedWrites",
    "health_json",
    "is_out_of_memory",
    "out_of_memory_error",
    "out_of_memory_message",
    "read_memory",
]

# What Redis says when it refuses a command at maxmemory (its error code, OOM, is stripped by
# redis-py; a script's error on Redis 6 quotes it after its own prefix).
OOM_REFUSAL = "command not allowed when used memory > 'maxmemory'"
REQUIRED_POLICY = "noeviction"
_MIB = 1024 * 1024
# `/healthz` says Redis is out of memory while a write it refused at maxmemory is this recent, even
# when its memory at rest is under the limit again: the refused write was never stored, so INFO shows
# room while every write of that size (an ingestion chunk, a submit) is still refused. Twice the
# longest wait of an ingestion between tries (30 s), so a refusal that goes on never drops out.
RECENT_REFUSAL_S = 60.0


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether a Redis error is a refusal at ``maxmemory`` (not an outage, not a bug)."""
    return isinstance(exc, OutOfMemoryError) or (isinstance(exc, ResponseError) and OOM_REFUSAL in str(exc))


@dataclass(frozen=True)
class RedisMemory:
    """Redis's ``INFO memory``: what counts against ``maxmemory`` (0: no limit) and the policy."""

    used_bytes: int
    max_bytes: int
    policy: str

    @classmethod
    def from_info(cls, info: dict[str, Any]) -> RedisMemory:
        # Replication and AOF buffers are not counted against the limit (Redis's own rule).
        used = int(info.get("used_memory", 0)) - int(info.get("mem_not_counted_for_evict", 0))
        return cls(used, int(info.get("maxmemory", 0)), as_text(info.get("maxmemory_policy", "")))

    @property
    def out_of_memory(self) -> bool:
        """Over the limit: with ``noeviction`` Redis refuses writes until memory is freed."""
        return 0 < self.max_bytes < self.used_bytes

    def problems(self) -> list[str]:
        """What an operator must change, in words (empty when nothing)."""
        found = []
        if self.out_of_memory:
            found.append(out_of_memory_message(self))
        if self.max_bytes and self.policy != REQUIRED_POLICY:
            found.append(
                f"Redis evicts keys at maxmemory (maxmemory-policy {self.policy}): queued prompts and "
                f"job state can vanish; set maxmemory-policy {REQUIRED_POLICY}"
            )
        return found

    def to_json(self) -> dict[str, Any]:
        return {
            "used_memory_bytes": self.used_bytes,
            "maxmemory_bytes": self.max_bytes,
            "maxmemory_policy": self.policy,
            "out_of_memory": self.out_of_memory,
            "problems": self.problems(),
        }


class RefusedWrites:
    """The writes one process saw Redis refuse at ``maxmemory``: how many, and when the last was."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0
        self.last_at_ms: int | None = None

    def note(self) -> None:
        with self._lock:
            self.count += 1
            self.last_at_ms = now_ms()

    def recent_s(self, now_ms: int) -> float | None:
        """Seconds since the last refusal if it is within `RECENT_REFUSAL_S`, else None."""
        last = self.last_at_ms
        if last is None:
            return None
        age_s = max(0.0, (now_ms - last) / 1000)
        return age_s if age_s <= RECENT_REFUSAL_S else None


def health_json(memory: RedisMemory, refused: RefusedWrites, now_ms: int) -> dict[str, Any]:
    """What `/healthz` says of Redis's memory: at rest (``INFO``), and the writes refused of late.
    ``out_of_memory`` is true while Redis is over its limit, or has one and refused a write within
    `RECENT_REFUSAL_S`; ``refused_writes`` counts the refusals since the process started and
    ``last_refused_write_at_ms`` says when the last was."""
    body = memory.to_json()
    age_s = refused.recent_s(now_ms)
    # Without a limit now (it was lifted) Redis refuses nothing, however recent the last refusal.
    if age_s is not None and memory.max_bytes and not memory.out_of_memory:
        body["out_of_memory"] = True
        body["problems"].insert(0, f"{out_of_memory_message(memory)} (a write was refused {age_s:.0f} s ago)")
    body["refused_writes"] = refused.count
    body["last_refused_write_at_ms"] = refused.last_at_ms
    return body


def read_memory(redis: Redis) -> RedisMemory | None:
    """Redis's memory now; None when it cannot tell (unreachable, or INFO not allowed)."""
    try:
        return RedisMemory.from_info(redis.info("memory"))
    except RedisError:
        return None


def out_of_memory_message(memory: RedisMemory | None) -> str:
    if memory is not None and memory.max_bytes:
        limit = f"maxmemory {memory.max_bytes / _MIB:.1f} MiB, {memory.used_bytes / _MIB:.1f} MiB used"
    else:
        limit = "maxmemory reached"
    return (
        f"Redis is out of memory ({limit}) and refuses writes: raise maxmemory, or lower "
        "DATAGEN_MAX_QUEUED_PER_CLASS"
    )


def out_of_memory_error(redis: Redis, exc: RedisError) -> RedisOutOfMemoryError:
    """The project's error for a refusal at ``maxmemory``, naming the limit (read from Redis)."""
    error = RedisOutOfMemoryError(out_of_memory_message(read_memory(redis)))
    error.__cause__ = exc
    return error
