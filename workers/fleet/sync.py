"""Keeping this worker in step with the fleet's shared state in Redis, every ``control_interval_s``.

:class:`FleetSync` reads paused queues and servers, cancelled jobs to abort and each server's shared
in-flight factor; counts the live workers that list each server and applies that to the server's
limits; and publishes this worker's view of each server (:class:`datagen.control.servers.ServerView`:
state, in flight, limits, the address of the worker's own metrics) for the coordinator's
``GET /servers`` and the other workers' counts. A pause is therefore seen within about a second.

It also watches Redis's epoch (:mod:`datagen.control.epoch`): when Redis lost its data it publishes
this worker's servers again, so the coordinator accepts submits once more.
"""

from __future__ import annotations

import asyncio
import logging
import time

from redis import Redis, RedisError

from datagen.clock import now_ms
from datagen.control.epoch import EpochChange, EpochWatch
from datagen.control.keys import Keys
from datagen.control.redistext import as_texts
from datagen.control.servers import (
    VIEWS_TTL_S,
    ServerControl,
    ServerInfo,
    ServerView,
    decode_views,
    publish_server,
    shares_server,
)
from datagen.states import PromptClass, ServerState
from workers.fleet.servers import Fleet, Server
from workers.metrics import WorkerMetrics

__all__ = ["FleetSync"]

log = logging.getLogger(__name__)

# Entries of a server's worker hash vanish when every worker listing it is gone.
WORKERS_HASH_TTL_S = VIEWS_TTL_S
# An unchanged view is published again this often (the live window, LIVE_WINDOW_S, is 10 s).
REPUBLISH_S = 3.0


class FleetSync:
    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        fleet: Fleet,
        metrics: WorkerMetrics,
        *,
        worker_name: str,
        interval_s: float,
        shared_factor: bool,
        metrics_address: str | None = None,
        epoch: EpochWatch | None = None,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.fleet = fleet
        self.metrics = metrics
        self.worker_name = worker_name
        # HOST:PORT of this worker's Prometheus metrics (None: off), shown in GET /servers.
        self.metrics_address = metrics_address
        self.interval_s = interval_s
        self.shared_factor = shared_factor
        self.paused_classes: set[PromptClass] = set()
        # Cancelled jobs whose in-flight prompts this worker must abort.
        self.aborting_jobs: set[str] = set()
        self.draining = False
        self._published: dict[str, ServerView] = {}
        self._published_at = 0.0
        self._read_at = 0.0
        # Shared with the claim script's caller (`datagen.control.dispatch.Dispatch`), which reads its floor.
        self.epoch = epoch or EpochWatch(redis, keys)
        self._rolled_back = False

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.sync_once(lazy=True)
            except RedisError as exc:
                log.warning("cannot sync fleet state with Redis: %s", exc)
            await self.fleet.changed()

    def sync_once(self, *, lazy: bool = False) -> None:
        """Read the pauses (every time: a pause takes effect within 2 s) and each server's shared
        factor and sharers (``lazy``, as the background loop does: only while this worker has
        requests in flight, else every ``REPUBLISH_S``); apply them and publish this worker's
        views (``lazy``: an unchanged view only every ``REPUBLISH_S``)."""
        servers = self.fleet.servers
        idle = not any(any(server.in_flight.values()) for server in servers)
        full = not lazy or not idle or time.monotonic() - self._read_at >= REPUBLISH_S
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.smembers(self.keys.paused_queues())
            pipe.smembers(self.keys.paused_servers())
            pipe.smembers(self.keys.aborting_jobs())
            pipe.hmget(self.keys.epoch(), ["id", "seq"])
            if full:
                for server in servers:
                    pipe.hgetall(self.keys.server_control(server.name))
                    pipe.hgetall(self.keys.server_workers(server.name))
            replies = pipe.execute()
        epoch_id, epoch_seq = replies.pop(3)
        paused_queues, paused_servers = set(as_texts(replies[0])), set(as_texts(replies[1]))
        self.aborting_jobs = set(as_texts(replies[2]))
        if self._saw_epoch(epoch_id, epoch_seq):
            lazy = False
        self._set_paused_classes(paused_queues)
        if full:
            self._read_at = time.monotonic()
        now = now_ms()
        for i, server in enumerate(servers):
            was_paused = server.paused
            server.paused = server.name in paused_servers
            if server.paused != was_paused:
                log.info("server %s %s", server.name, "paused" if server.paused else "resumed")
            if full:
                self._apply_shared(server, ServerControl.decode(replies[3 + 2 * i]), replies[4 + 2 * i], now)
            self._update_metrics(server)
        self.publish(force=not lazy)

    def _saw_epoch(self, epoch_id: bytes | None, epoch_seq: bytes | None) -> bool:
        """Act on a change of Redis's epoch; True when this worker's servers were published again."""
        # None: this worker's first look found no epoch (a new Redis, before any coordinator started).
        known = self.epoch.id
        change = self.epoch.saw(epoch_id, epoch_seq)
        lost = change is EpochChange.LOST
        if lost and known is None:
            # A coordinator gave a new Redis its epoch: no loss to report, but what this worker
            # published is written again all the same (Redis may have been emptied meanwhile).
            log.info("Redis has an epoch now (a coordinator set it); publishing this worker's servers")
            self.publish_servers()
        elif lost:
            # Redis lost its data (or is another one): what this worker published is gone with it,
            # and the coordinator refuses submits until some worker publishes its servers again.
            log.warning("Redis lost its data (its epoch changed); publishing this worker's servers again")
            self.publish_servers()
        elif change is EpochChange.ROLLED_BACK and not self._rolled_back:
            log.warning(
                "Redis went back to an older snapshot; claiming nothing until the coordinator has "
                "rebuilt its jobs from storage"
            )
        self._rolled_back = change is EpochChange.ROLLED_BACK
        return lost

    def _apply_shared(self, server: Server, control: ServerControl, raw_views: object, now: int) -> None:
        """Scale the server's limits by its shared factor, split among the live workers listing it."""
        factor = control.factor if control.factor is not None and self.shared_factor else 1.0
        others = sum(
            1
            for name, view in decode_views(raw_views).items()
            # Another worker's live view makes it a sharer of the server's slots.
            if name != self.worker_name and shares_server(view, now)
        )
        server.apply_target(factor, 1 + others)

    def _set_paused_classes(self, names: set[str]) -> None:
        paused = {cls for cls in PromptClass if cls.value in names}
        for cls in paused ^ self.paused_classes:
            log.info("queue %s %s", cls.value, "paused" if cls in paused else "resumed")
        self.paused_classes = paused
        for cls in PromptClass:
            self.metrics.queue_paused.labels(cls.value).set(1 if cls in paused else 0)

    def _update_metrics(self, server: Server) -> None:
        self.metrics.server_paused.labels(server.name).set(1 if server.paused else 0)
        for cls in PromptClass:
            self.metrics.in_flight_target.labels(server.name, cls.value).set(server.limits[cls])

    def publish(self, *, force: bool = True) -> None:
        """Publish this worker's view of each server; unless ``force``, a view that did not change
        is republished only every ``REPUBLISH_S`` (well within the live window), so an idle worker
        costs Redis little."""
        views = {server.name: self._view(server) for server in self.fleet.servers}
        now = time.monotonic()
        if not force and views == self._published and now - self._published_at < REPUBLISH_S:
            return
        with self.redis.pipeline(transaction=False) as pipe:
            for server in self.fleet.servers:
                view = views[server.name].model_copy(update={"seen_at_ms": now_ms()})
                key = self.keys.server_workers(server.name)
                pipe.hset(key, self.worker_name, view.encode())
                pipe.expire(key, WORKERS_HASH_TTL_S)
            pipe.execute()
        self._published, self._published_at = views, now

    def publish_servers(self) -> None:
        """What this worker learned of each server it accepted (`datagen.control.servers.publish_server`,
        as the health probe wrote it when the server came up), written again."""
        for server in self.fleet.servers:
            if server.context_len is None or server.refused is not None:
                continue
            info = ServerInfo(
                context_len=server.context_len,
                model_path=server.model_path,
                weight_version=server.weight_version,
                seen_at_ms=now_ms(),
            )
            publish_server(self.redis, self.keys, server.name, info)

    def _view(self, server: Server) -> ServerView:
        """This worker's view of ``server``, stamped with ``seen_at_ms`` when it is published."""
        return ServerView(
            state=ServerState.DRAINING if self.draining else server.state,
            in_flight={cls.value: server.in_flight[cls] for cls in PromptClass},
            limits={cls.value: server.limits[cls] for cls in PromptClass},
            factor=round(server.factor, 4),
            context_len=server.context_len,
            model_path=server.model_path,
            weight_version=server.weight_version,
            refused=server.refused,
            metrics=self.metrics_address,
        )

    def withdraw(self) -> None:
        with self.redis.pipeline(transaction=False) as pipe:
            for server in self.fleet.servers:
                pipe.hdel(self.keys.server_workers(server.name), self.worker_name)
            pipe.execute()
