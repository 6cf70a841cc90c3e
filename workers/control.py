"""The worker's background control: shared state in Redis, health probes, the KV controller.

- :class:`FleetSync` (every ``control_interval_s``): reads paused queues and servers and each
  server's shared in-flight factor, counts the live workers that list each server, applies
  that to the fleet's limits, and publishes this worker's view of each server (state, in flight,
  limits, the address of the worker's own metrics) for the coordinator's ``GET /servers``. A pause
  is therefore seen within about a second.
- :class:`HealthProbe` (per server): ``/health`` with a timeout. Refused connections and 503 mark
  the server down at once; ``health_timeouts_to_down`` timeouts in a row do too (SGLang's probe
  runs a one-token generation and is slow under load). A probe never cancels in-flight work.
  A server that comes up is read and checked first (:mod:`datagen.preflight`): an unknown context
  length, another model than the fleet's, or a 401/403 (the API key) keeps the worker off it,
  published as ``refused`` with the reason, until a later probe passes.
- :class:`KvControl` (per server, in the one worker holding the server's controller lease):
  reads ``/metrics``, runs :func:`workers.controller.decide`, writes the shared target.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from typing import cast

from redis import Redis, RedisError

from datagen.errors import (
    ConfigError,
    DatagenError,
    PreflightError,
    RequestTimeoutError,
    RetryableError,
)
from datagen.fleet import live_servers, publish_server, shares_server
from datagen.jobs import now_ms
from datagen.keys import Keys
from datagen.preflight import check_server_joins
from datagen.redistext import as_text, as_texts
from datagen.states import PromptClass, ServerState
from workers.controller import KvSignals, decide, parse_kv_signals
from workers.fleet import Fleet, Server
from workers.metrics import WorkerMetrics

__all__ = ["FleetSync", "HealthProbe", "KvControl"]

log = logging.getLogger(__name__)

# Entries of a server's worker hash vanish when every worker listing it is gone.
WORKERS_HASH_TTL_S = 300
DOWN_PROBE_INTERVAL_S = 1.0
METRICS_TIMEOUT_S = 10.0
LEASE_INTERVALS = 3
# Consecutive unreadable /metrics pages before the controller says it is blind.
METRICS_MISSES_TO_WARN = 3
API_KEY_HINT = (
    "Check the API key of server {name}: DATAGEN_SERVER_API_KEYS or DATAGEN_SERVER_API_KEYS_FILE "
    "(NAME=KEY), else DATAGEN_API_KEY, must be the server's --api-key"
)


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

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.sync_once()
            except RedisError as exc:
                log.warning("cannot sync fleet state with Redis: %s", exc)
            await self.fleet.changed()

    def sync_once(self) -> None:
        servers = self.fleet.servers
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.smembers(self.keys.paused_queues())
            pipe.smembers(self.keys.paused_servers())
            pipe.smembers(self.keys.aborting_jobs())
            for server in servers:
                pipe.hget(self.keys.server_control(server.name), "factor")
                pipe.hgetall(self.keys.server_workers(server.name))
            replies = pipe.execute()
        paused_queues, paused_servers = set(as_texts(replies[0])), set(as_texts(replies[1]))
        self.aborting_jobs = set(as_texts(replies[2]))
        self._set_paused_classes(paused_queues)
        now = now_ms()
        for i, server in enumerate(servers):
            raw_factor, raw_workers = replies[3 + 2 * i], replies[4 + 2 * i]
            factor = float(raw_factor) if raw_factor and self.shared_factor else 1.0
            others = sum(
                1
                for name, entry in cast(dict[bytes, bytes], raw_workers).items()
                # Another worker's live view makes it a sharer of the server's slots.
                if as_text(name) != self.worker_name and shares_server(json.loads(entry), now)
            )
            was_paused = server.paused
            server.paused = server.name in paused_servers
            if server.paused != was_paused:
                log.info("server %s %s", server.name, "paused" if server.paused else "resumed")
            server.apply_target(factor, 1 + others)
            self._update_metrics(server)
        self.publish()

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

    def publish(self) -> None:
        with self.redis.pipeline(transaction=False) as pipe:
            for server in self.fleet.servers:
                view = {
                    "state": ServerState.DRAINING if self.draining else server.state,
                    "in_flight": {cls.value: server.in_flight[cls] for cls in PromptClass},
                    "limits": {cls.value: server.limits[cls] for cls in PromptClass},
                    "factor": round(server.factor, 4),
                    "context_len": server.context_len,
                    **server.model(),
                    "refused": server.refused,
                    "metrics": self.metrics_address,
                    "seen_at_ms": now_ms(),
                }
                key = self.keys.server_workers(server.name)
                pipe.hset(key, self.worker_name, json.dumps(view, sort_keys=True))
                pipe.expire(key, WORKERS_HASH_TTL_S)
            pipe.execute()

    def withdraw(self) -> None:
        with self.redis.pipeline(transaction=False) as pipe:
            for server in self.fleet.servers:
                pipe.hdel(self.keys.server_workers(server.name), self.worker_name)
            pipe.execute()


class HealthProbe:
    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        fleet: Fleet,
        server: Server,
        *,
        interval_s: float,
        timeout_s: float,
        timeouts_to_down: int,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.fleet = fleet
        self.server = server
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.timeouts_to_down = timeouts_to_down

    async def run(self) -> None:
        while True:
            # A down server is probed often, so that dispatch resumes within seconds of its return;
            # a refused one waits for an operator, so it is probed at the normal pace.
            steady = self.server.up or self.server.refused is not None
            await asyncio.sleep(self.interval_s if steady else min(DOWN_PROBE_INTERVAL_S, self.interval_s))
            await self.probe()

    async def probe(self) -> None:
        server = self.server
        try:
            healthy = await server.client.health(timeout_s=self.timeout_s)
        except RequestTimeoutError:
            server.health_timeouts += 1
            if server.health_timeouts >= self.timeouts_to_down:
                await self.fleet.mark_down(
                    server, f"{server.health_timeouts} /health probes timed out in a row"
                )
            return
        except RetryableError as exc:
            await self.fleet.mark_down(server, str(exc))
            return
        server.health_timeouts = 0
        if not healthy:
            await self.fleet.mark_down(server, "/health answered 503 (starting, shutting down or unhealthy)")
            return
        if not server.up and not await self._learn(server):
            return
        await self.fleet.mark_up(server)

    async def _learn(self, server: Server) -> bool:
        """Read and check the context length and model of a server that comes up (again).

        A failed pre-flight check keeps the worker off the server until a later probe passes.
        """
        try:
            context_len = await server.client.context_len()
            info = await server.client.model_info()
        except ConfigError as exc:  # 401/403: the key is wrong; retrying cannot help until it changes
            await self.fleet.refuse(server, f"{exc}. {API_KEY_HINT.format(name=server.name)}")
            self._publish(server, {"seen_at_ms": now_ms()}, only_if_new=True)
            return False
        except DatagenError as exc:
            log.warning("server %s is healthy but its info is not readable: %s", server.name, exc)
            return False
        server.context_len = context_len
        server.model_path, server.weight_version = info.get("model_path"), info.get("weight_version")
        self._publish(server, {"context_len": context_len, **server.model(), "seen_at_ms": now_ms()})
        reason = self._refusal(server)
        if reason is not None:
            await self.fleet.refuse(server, reason)
            return False
        return True

    def _refusal(self, server: Server) -> str | None:
        """Why the worker must keep off ``server``: an unknown context length, or another model than
        the servers this worker accepted and those live workers use."""
        if server.context_len is None:
            return (
                f"server {server.name} reports no context length (neither /server_info context_length "
                "nor /v1/models max_model_len), so prompts cannot be sized to fit. Start SGLang with "
                "--context-length"
            )
        accepted = {
            s.name: s.model()
            for s in self.fleet.servers
            if s is not server and s.refused is None and s.model_path is not None
        }
        try:
            accepted = {**live_servers(self.redis, self.keys), **accepted}
        except RedisError as exc:
            log.warning("cannot read the fleet's servers from Redis: %s", exc)
        try:
            check_server_joins(server.name, server.model(), accepted)
        except PreflightError as exc:
            return str(exc)
        return None

    def _publish(self, server: Server, entry: dict[str, object], *, only_if_new: bool = False) -> None:
        try:
            publish_server(self.redis, self.keys, server.name, entry, only_if_new=only_if_new)
        except RedisError as exc:
            log.warning("cannot publish server %s: %s", server.name, exc)


class KvControl:
    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        server: Server,
        metrics: WorkerMetrics,
        *,
        owner: str,
        interval_s: float,
        floor_fraction: float,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.server = server
        self.metrics = metrics
        self.owner = owner
        self.interval_s = interval_s
        self.floor_fraction = floor_fraction
        self._previous: KvSignals | None = None
        self._misses = 0

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.step()
            except RedisError as exc:
                log.warning("KV controller for %s cannot reach Redis: %s", self.server.name, exc)

    def _hold_lease(self) -> bool:
        key = self.keys.server_controller_lease(self.server.name)
        ttl_ms = int(self.interval_s * LEASE_INTERVALS * 1000)
        if self.redis.set(key, self.owner, nx=True, px=ttl_ms):
            return True
        holder = self.redis.get(key)
        if holder is not None and as_text(holder) == self.owner:
            self.redis.pexpire(key, ttl_ms)
            return True
        return False

    async def step(self) -> None:
        server = self.server
        ceiling = sum(server.max_limits.values())
        if not server.up or ceiling == 0 or not self._hold_lease():
            self._previous = None
            return
        try:
            current = parse_kv_signals(await server.client.metrics_text(timeout_s=METRICS_TIMEOUT_S))
        except (DatagenError, ValueError) as exc:
            self._misses += 1
            if self._misses == METRICS_MISSES_TO_WARN:
                log.warning(
                    "server %s: no usable /metrics (%s); its in-flight target stays where it is, as if "
                    "the KV controller were off (start SGLang with --enable-metrics)",
                    server.name,
                    exc,
                )
            return
        if self._misses >= METRICS_MISSES_TO_WARN:
            log.info("server %s: /metrics readable again; KV control resumes", server.name)
        self._misses = 0
        self._observe(current)
        key = self.keys.server_control(server.name)
        raw_target = self.redis.hget(key, "target")
        target = min(ceiling, int(raw_target)) if raw_target else ceiling
        floor = max(1, math.ceil(ceiling * self.floor_fraction))
        decision = decide(target, self._previous, current, floor=floor, ceiling=ceiling)
        self._previous = current
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(
                key,
                mapping={
                    "target": decision.target,
                    "ceiling": ceiling,
                    "factor": decision.target / ceiling,
                    "signals": json.dumps(current.to_json(), sort_keys=True),
                    "controller": self.owner,
                },
            )
            if decision.reason is not None:
                pipe.hset(key, mapping={"reason": decision.reason, "changed_at_ms": now_ms()})
            pipe.execute()
        if decision.reason is not None:
            direction = "down" if decision.target < target else "up"
            self.metrics.controller_changes.labels(server.name, direction).inc()
            log.info(
                "server %s: in-flight target %d -> %d: %s",
                server.name,
                target,
                decision.target,
                decision.reason,
            )

    def _observe(self, signals: KvSignals) -> None:
        name = self.server.name
        if signals.token_usage is not None:
            self.metrics.kv_token_usage.labels(name).set(signals.token_usage)
        self.metrics.server_queue.labels(name).set(signals.num_queue_reqs)
        self.metrics.server_running.labels(name).set(signals.num_running_reqs)
        if signals.retracted_total is not None:
            self.metrics.server_retractions.labels(name).set(signals.retracted_total)
