"""What workers publish about the SGLang servers they use, read by the coordinator.

Workers write one JSON entry per server name into a hash (context length, model path, last
seen time); the coordinator uses the smallest context length of the fleet to reject prompts
that cannot fit before they reach a queue.
"""

from __future__ import annotations

import json
from typing import Any, cast

from redis import Redis

from datagen.keys import Keys

__all__ = ["fleet_context_len", "publish_server", "read_servers"]


def publish_server(redis: Redis, keys: Keys, name: str, info: dict[str, Any]) -> None:
    redis.hset(keys.servers_index(), name, json.dumps(info, sort_keys=True))


def read_servers(redis: Redis, keys: Keys) -> dict[str, dict[str, Any]]:
    raw = cast(dict[bytes, bytes], redis.hgetall(keys.servers_index()))
    return {k.decode(): json.loads(v) for k, v in raw.items()}


def fleet_context_len(redis: Redis, keys: Keys) -> int | None:
    lengths = [int(s["context_len"]) for s in read_servers(redis, keys).values() if s.get("context_len")]
    return min(lengths) if lengths else None
