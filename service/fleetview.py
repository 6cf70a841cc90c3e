"""Queues and servers as operators see them, and pausing them.

Pauses live in Redis sets that workers read every ``control_interval_s`` (about a second), so a
pause takes effect within two seconds and survives a coordinator restart. What the coordinator
shows about a server is what the workers that list it published: their state, in flight and
limits, plus the shared controller target and the KV signals it last read. A server that every
live worker keeps off after a failed pre-flight check is ``refused``, with each worker's reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from redis import Redis
from rq import Queue

from datagen.clock import now_ms
from datagen.control.dispatch import Dispatch
from datagen.control.keys import Keys
from datagen.control.redistext import as_texts
from datagen.control.servers import (
    ServerView,
    published_names,
    read_control,
    read_servers,
    read_views,
    remembered,
    seen_recently,
)
from datagen.errors import UnknownServerError
from datagen.states import PromptClass, ServerState

__all__ = ["FleetView"]


@dataclass(frozen=True)
class _WorkerView:
    """One worker's view of a server as ``GET /servers`` shows it: what the worker published, with
    its name and whether the view is stale."""

    worker: str
    view: ServerView
    stale: bool

    def to_json(self) -> dict[str, Any]:
        return {**self.view.to_json(), "worker": self.worker, "stale": self.stale}


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
        """The servers some worker published a view of within ``VIEWS_TTL_S``, and paused ones."""
        known = published_names(self.redis, self.keys, sorted(read_servers(self.redis, self.keys)))
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
        # A name some worker reported once is answered when asked for, with the workers that still
        # publish it (none: its state is unknown), though the list (`server_names`) leaves it out.
        workers = self._workers(name)
        live = [w.view for w in workers if not w.stale]
        control = read_control(self.redis, self.keys, name)
        return {
            "name": name,
            "state": _state(paused, live),
            "paused": paused,
            "in_flight": {c.value: sum(v.in_flight.get(c.value, 0) for v in live) for c in PromptClass},
            "limits": {c.value: sum(v.limits.get(c.value, 0) for v in live) for c in PromptClass},
            "target": control.target,
            "target_reason": control.reason,
            "kv": control.signals,
            "context_len": info.context_len if info else None,
            "model_path": info.model_path if info else None,
            "weight_version": info.weight_version if info else None,
            # "capture" for a capture server (jobs with features), with what its probe's file held.
            "role": (info.role if info else None) or "generate",
            "capture": info.capture if info else None,
            # Why live workers keep off the server (pre-flight checks), by worker.
            "refused": {w.worker: w.view.refused for w in workers if not w.stale and w.view.refused},
            "workers": [w.to_json() for w in workers],
        }

    def _workers(self, name: str) -> list[_WorkerView]:
        now = now_ms()
        return [
            # A stale view is shown but does not count towards totals (datagen.control.servers.LIVE_WINDOW_S);
            # one past VIEWS_TTL_S (a worker that died long ago) is not shown.
            _WorkerView(worker, view, stale=not seen_recently(view, now))
            for worker, view in sorted(read_views(self.redis, self.keys, name).items())
            if remembered(view, now)
        ]

    def set_server_paused(self, name: str, paused: bool) -> dict[str, Any]:
        if paused:
            self.server(name)  # 404 for a name no worker knows: a typo must not pause nothing
            self.redis.sadd(self.keys.paused_servers(), name)
        else:
            self.redis.srem(self.keys.paused_servers(), name)
        return self.server(name) if name in self.server_names() else {"name": name, "paused": False}


# A server's state over its live workers' views: the first of these that any view has.
_STATE_PRECEDENCE = (ServerState.UP, ServerState.DRAINING, ServerState.DOWN, ServerState.REFUSED)


def _state(paused: bool, live: list[ServerView]) -> ServerState:
    if paused:
        return ServerState.PAUSED
    states = {view.state for view in live}
    return next((state for state in _STATE_PRECEDENCE if state in states), ServerState.UNKNOWN)
