"""Queues and servers as operators see them, and pausing them.

Pauses live in Redis sets that workers read every ``control_interval_s`` (about a second), so a
pause takes effect within two seconds and survives a coordinator restart. What the coordinator
shows about a server is what the workers that list it published: their state, in flight and
limits, plus the shared controller target and the KV signals it last read. A server that every
live worker keeps off after a failed pre-flight check is ``refused``, with each worker's reason.
"""

from __future__ import annotations

import json
from typing import Any, cast

from redis import Redis
from rq import Queue

from datagen.control.dispatch import Dispatch
from datagen.control.jobs import now_ms
from datagen.control.keys import Keys
from datagen.control.redistext import as_text, as_texts
from datagen.control.servers import read_servers, seen_recently
from datagen.errors import UnknownServerError
from datagen.states import PromptClass, ServerState

__all__ = ["FleetView"]


class FleetView:
    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self.dispatch = Dispatch(redis, keys)

    # Queues -------------------------------------------------------------------------------------
    def queues(self) -> list[dict[str, Any]]:
        paused = set(as_texts(self.redis.smembers(self.keys.paused_queues())))
        rows = []
        for cls in PromptClass:
            queue = Queue(self.keys.queue_name(cls), connection=self.redis)
            rows.append(
                {
                    "name": cls.value,
                    "rq_queue": queue.name,
                    "paused": cls.value in paused,
                    # RQ's list holds only handed-back prompts; the rest wait in job backlogs.
                    "queued": queue.count + self.dispatch.depth(cls),
                    # Without cleanup: RQ's cleanup would fail a dead worker's prompts that the
                    # workers' reaper is about to hand back.
                    "started": queue.started_job_registry.get_job_count(cleanup=False),
                    "failed": queue.failed_job_registry.get_job_count(cleanup=False),
                }
            )
        return rows

    def set_queue_paused(self, name: str, paused: bool) -> dict[str, Any]:
        cls = PromptClass(name)
        key = self.keys.paused_queues()
        if paused:
            self.redis.sadd(key, cls.value)
        else:
            self.redis.srem(key, cls.value)
        return next(q for q in self.queues() if q["name"] == cls.value)

    # Servers ------------------------------------------------------------------------------------
    def server_names(self) -> list[str]:
        known = set(read_servers(self.redis, self.keys))
        known |= set(as_texts(self.redis.smembers(self.keys.paused_servers())))
        return sorted(known)

    def servers(self) -> list[dict[str, Any]]:
        return [self.server(name) for name in self.server_names()]

    def server(self, name: str) -> dict[str, Any]:
        info = read_servers(self.redis, self.keys).get(name)
        paused = bool(self.redis.sismember(self.keys.paused_servers(), name))
        if info is None and not paused:
            known = ", ".join(self.server_names()) or "none"
            raise UnknownServerError(f"no worker has reported a server named {name!r}; known: {known}")
        workers = self._workers(name)
        live = [w for w in workers if not w["stale"]]
        control = {
            as_text(k): as_text(v)
            for k, v in cast(dict[bytes, bytes], self.redis.hgetall(self.keys.server_control(name))).items()
        }
        return {
            "name": name,
            "state": _state(paused, live),
            "paused": paused,
            "in_flight": {c.value: sum(w["in_flight"].get(c.value, 0) for w in live) for c in PromptClass},
            "limits": {c.value: sum(w["limits"].get(c.value, 0) for w in live) for c in PromptClass},
            "target": int(control["target"]) if "target" in control else None,
            "target_reason": control.get("reason"),
            "kv": json.loads(control["signals"]) if "signals" in control else None,
            "context_len": (info or {}).get("context_len"),
            "model_path": (info or {}).get("model_path"),
            "weight_version": (info or {}).get("weight_version"),
            # Why live workers keep off the server (pre-flight checks), by worker.
            "refused": {w["worker"]: w["refused"] for w in live if w.get("refused")},
            "workers": workers,
        }

    def _workers(self, name: str) -> list[dict[str, Any]]:
        raw = cast(dict[bytes, bytes], self.redis.hgetall(self.keys.server_workers(name)))
        now = now_ms()
        views = []
        for worker, entry in sorted(raw.items()):
            view = json.loads(entry)
            view["worker"] = as_text(worker)
            # A stale view is shown but does not count towards totals (datagen.control.servers.LIVE_WINDOW_S).
            view["stale"] = not seen_recently(view, now)
            views.append(view)
        return views

    def set_server_paused(self, name: str, paused: bool) -> dict[str, Any]:
        if paused:
            self.server(name)  # 404 for a name no worker knows: a typo must not pause nothing
            self.redis.sadd(self.keys.paused_servers(), name)
        else:
            self.redis.srem(self.keys.paused_servers(), name)
        return self.server(name) if name in self.server_names() else {"name": name, "paused": False}


# A server's state over its live workers' views: the first of these that any view has.
_STATE_PRECEDENCE = (ServerState.UP, ServerState.DRAINING, ServerState.DOWN, ServerState.REFUSED)


def _state(paused: bool, live: list[dict[str, Any]]) -> ServerState:
    if paused:
        return ServerState.PAUSED
    states = {w["state"] for w in live}
    return next((state for state in _STATE_PRECEDENCE if state in states), ServerState.UNKNOWN)
