"""What workers publish about the SGLang servers they use, read by the coordinator.

Two records per server, both written by workers:

- ``servers_index`` (one hash, one JSON entry per server name): what the server said about
  itself when a worker last accepted or refused it (``context_len``, ``model_path``,
  ``weight_version``, ``seen_at_ms``). Entries are never deleted, so a server that no worker
  uses any more keeps its entry.
- ``server_workers(name)`` (one hash per server): each worker's view of it (state, in flight,
  limits), refreshed every ``control_interval_s``; a view whose ``state`` is ``refused`` says why
  in ``refused``. A view older than ``LIVE_WINDOW_S`` is stale (:func:`seen_recently`).

:func:`live_servers` is what the pre-flight checks and the context length use: the servers that
a live worker uses and has not refused, so a stale entry never refuses a job.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any, cast

from redis import Redis

from datagen.control.keys import Keys
from datagen.states import ServerState

__all__ = [
    "LIVE_WINDOW_S",
    "fleet_context_len",
    "live_servers",
    "publish_server",
    "read_servers",
    "seen_recently",
    "shares_server",
]

# How long a worker's view of a server counts as live: five refreshes at the slowest interval a
# worker may use (``control_interval_s`` is at most 2 s). A reader cannot know the writer's interval,
# so the window is set by the slowest one: a late refresh or two (a busy event loop) never drops a
# live worker, and a dead worker's share of a server's slots goes to the others within 10 s. One
# rule for every reader: the workers sharing slots, the coordinator's ``GET /servers`` and the
# pre-flight checks' live servers.
LIVE_WINDOW_S = 10.0


def seen_recently(view: Mapping[str, Any], now_ms: int, *, max_age_s: float = LIVE_WINDOW_S) -> bool:
    """Whether a worker's view of a server was refreshed within ``max_age_s``."""
    seen_at_ms = view.get("seen_at_ms")
    return isinstance(seen_at_ms, int) and seen_at_ms >= now_ms - int(max_age_s * 1000)


def shares_server(view: Mapping[str, Any], now_ms: int, *, max_age_s: float = LIVE_WINDOW_S) -> bool:
    """Whether a worker's view says it uses the server: live, and not refused (a server that is down
    but still listed counts: it will be back)."""
    return seen_recently(view, now_ms, max_age_s=max_age_s) and view.get("state") != ServerState.REFUSED


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


def live_servers(redis: Redis, keys: Keys, *, max_age_s: float = LIVE_WINDOW_S) -> dict[str, dict[str, Any]]:
    """The entries of servers that some worker has listed in the last ``max_age_s`` without
    refusing them (a server that is down but still listed counts: it will be back)."""
    servers = read_servers(redis, keys)
    names = sorted(servers)
    with redis.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.hgetall(keys.server_workers(name))
        replies = pipe.execute()
    now_ms = int(time.time() * 1000)
    live = {}
    for name, raw in zip(names, replies, strict=True):
        views = [json.loads(entry) for entry in cast(dict[bytes, bytes], raw).values()]
        if any(shares_server(v, now_ms, max_age_s=max_age_s) for v in views):
            live[name] = servers[name]
    return live


def fleet_context_len(redis: Redis, keys: Keys) -> int | None:
    lengths = [int(s["context_len"]) for s in read_servers(redis, keys).values() if s.get("context_len")]
    return min(lengths) if lengths else None
