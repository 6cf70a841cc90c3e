"""What workers publish about the SGLang servers they use, read by the coordinator.

Two records per server, both written by workers:

- ``servers_index`` (one hash, one JSON entry per server name): what the server said about
  itself when a worker last accepted or refused it (``context_len``, ``model_path``,
  ``weight_version``, ``seen_at_ms``). Entries are never deleted, so a server that no worker
  uses any more keeps its entry.
- ``server_workers(name)`` (one hash per server): each worker's view of it (state, in flight,
  limits), refreshed every ``control_interval_s``; a view whose ``state`` is ``refused`` says why
  in ``refused``.

:func:`live_servers` is what the pre-flight checks and the context length use: the servers that
a live worker uses and has not refused, so a stale entry never refuses a job.
"""

from __future__ import annotations

import json
import time
from typing import Any, cast

from redis import Redis

from datagen.keys import Keys

__all__ = [
    "DEFAULT_LIVE_WINDOW_S",
    "SERVER_REFUSED",
    "fleet_context_len",
    "live_servers",
    "publish_server",
    "read_servers",
]

# A worker's view older than this no longer makes its server live (workers refresh about every second).
DEFAULT_LIVE_WINDOW_S = 30.0
# The state a worker publishes for a server it keeps off after a failed pre-flight check.
SERVER_REFUSED = "refused"


def publish_server(
    redis: Redis, keys: Keys, name: str, info: dict[str, Any], *, only_if_new: bool = False
) -> None:
    """Write a server's entry; with ``only_if_new``, only if there is none yet (a name to show)."""
    value = json.dumps(info, sort_keys=True)
    if only_if_new:
        redis.hsetnx(keys.servers_index(), name, value)
    else:
        redis.hset(keys.servers_index(), name, value)


def read_servers(redis: Redis, keys: Keys) -> dict[str, dict[str, Any]]:
    raw = cast(dict[bytes, bytes], redis.hgetall(keys.servers_index()))
    return {k.decode(): json.loads(v) for k, v in raw.items()}


def live_servers(
    redis: Redis, keys: Keys, *, max_age_s: float = DEFAULT_LIVE_WINDOW_S
) -> dict[str, dict[str, Any]]:
    """The entries of servers that some worker has listed in the last ``max_age_s`` without
    refusing them (a server that is down but still listed counts: it will be back)."""
    servers = read_servers(redis, keys)
    names = sorted(servers)
    with redis.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.hgetall(keys.server_workers(name))
        replies = pipe.execute()
    oldest_ms = int(time.time() * 1000 - max_age_s * 1000)
    live = {}
    for name, raw in zip(names, replies, strict=True):
        views = [json.loads(entry) for entry in cast(dict[bytes, bytes], raw).values()]
        if any(v.get("seen_at_ms", 0) >= oldest_ms and v.get("state") != SERVER_REFUSED for v in views):
            live[name] = servers[name]
    return live


def fleet_context_len(redis: Redis, keys: Keys) -> int | None:
    lengths = [int(s["context_len"]) for s in read_servers(redis, keys).values() if s.get("context_len")]
    return min(lengths) if lengths else None
