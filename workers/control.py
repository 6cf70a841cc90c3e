"""The worker's background control: shared state in Redis, health probes, the KV controller.

- :class:`FleetSync` (every ``control_interval_s``): reads paused queues and servers and each
  server's shared in-flight factor, counts the live workers that list each server, applies
  that to the fleet's limits, and publishes this worker's view of each server (state, in flight,
  limits, the address of the worker's own metrics) for the coordinator's ``GET /servers``. A pause
  is therefore seen within about a second.
- :class:`HealthProbe` (per server): ``/health`` with a timeout. Refused connections and 503 mark
  the server down at once; ``health_timeouts_to_down`` timeouts in a row do too (SGLang's probe
  runs a one-token generation and is slow under load). A server marked down so (unreachable or
  hung, e.g. SIGSTOPped) has its requests in flight abandoned: they are sent elsewhere at once,
  without charging an attempt, instead of waiting for their read timeout. A 503 cancels nothing.
  A server that comes up is read and checked first (:mod:`datagen.prompts.preflight`): an unknown context
  length, another model than the fleet's, or a 401/403 (the API key) keeps the worker off it,
  published as ``refused`` with the reason, until a later probe passes.
- :class:`KvControl` (per server, in the one worker holding the server's controller lease):
  reads ``/metrics``, runs :func:`workers.controller.decide`, writes the shared target and applies
  it to its own worker's limits at once. Before the worker's first claim it seeds a server with no
  target yet with the slow-start window; it steps every ``controller_slow_start_interval_s`` during
  slow start, then every ``controller_interval_s``. A server seen going down or restarting (its
  counters went back) starts slow start again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from typing import cast

from redis import Redis, RedisError

from datagen.control.epoch import EpochChange, EpochWatch
from datagen.control.jobs import now_ms
from datagen.control.keys import Keys
from datagen.control.redistext import as_text, as_texts
from datagen.control.servers import live_servers, publish_server, shares_server
from datagen.errors import (
    ConfigError,
    DatagenError,
    PreflightError,
    RequestTimeoutError,
    RetryableError,
)
from datagen.prompts.preflight import check_server_joins
from datagen.settings import DEFAULT_CONTROLLER_INITIAL_TARGET, DEFAULT_CONTROLLER_SLOW_START_INTERVAL_S
from datagen.states import PromptClass, ServerState
from workers.controller import KvSignals, decide, parse_kv_signals, restarted
from workers.fleet import Fleet, Server
from workers.metrics import WorkerMetrics

__all__ = ["FleetSync", "HealthProbe", "KvControl"]

log = logging.getLogger(__name__)

# Entries of a server's worker hash vanish when every worker listing it is gone.
WORKERS_HASH_TTL_S = 300
# An unchanged view is published again this often (the live window, LIVE_WINDOW_S, is 10 s).
REPUBLISH_S = 3.0
DOWN_PROBE_INTERVAL_S = 1.0
METRICS_TIMEOUT_S = 10.0
LEASE_INTERVALS = 3
# Consecutive unreadable /metrics pages before the controller says it is blind.
METRICS_MISSES_TO_WARN = 3
# How often the controller steps while this worker has no request on the server.
IDLE_STEP_S = 5.0
# The controller's phases, stored in the server's control hash.
SLOW_START = "slow_start"
STEADY = "steady"
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
        self._published: dict[str, dict[str, object]] = {}
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
                    pipe.hget(self.keys.server_control(server.name), "factor")
                    pipe.hgetall(self.keys.server_workers(server.name))
            replies = pipe.execute()
        epoch_id, epoch_seq = replies.pop(3)
        paused_queues, paused_servers = set(as_texts(replies[0])), set(as_texts(replies[1]))
        self.aborting_jobs = set(as_texts(replies[2]))
        change = self.epoch.saw(epoch_id, epoch_seq)
        if change is EpochChange.LOST:
            # Redis lost its data (or is another one): what this worker published is gone with it,
            # and the coordinator refuses submits until some worker publishes its servers again.
            log.warning("Redis lost its data (its epoch changed); publishing this worker's servers again")
            self.publish_servers()
            lazy = False
        elif change is EpochChange.ROLLED_BACK and not self._rolled_back:
            log.warning(
                "Redis went back to an older snapshot; claiming nothing until the coordinator has "
                "rebuilt its jobs from storage"
            )
        self._rolled_back = change is EpochChange.ROLLED_BACK
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
                raw_factor, raw_workers = replies[3 + 2 * i], replies[4 + 2 * i]
                factor = float(raw_factor) if raw_factor and self.shared_factor else 1.0
                others = sum(
                    1
                    for name, entry in cast(dict[bytes, bytes], raw_workers).items()
                    # Another worker's live view makes it a sharer of the server's slots.
                    if as_text(name) != self.worker_name and shares_server(json.loads(entry), now)
                )
                server.apply_target(factor, 1 + others)
            self._update_metrics(server)
        self.publish(force=not lazy)

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
        views = {}
        for server in self.fleet.servers:
            views[server.name] = self._view(server)
        now = time.monotonic()
        if not force and views == self._published and now - self._published_at < REPUBLISH_S:
            return
        with self.redis.pipeline(transaction=False) as pipe:
            for server in self.fleet.servers:
                view = {**views[server.name], "seen_at_ms": now_ms()}
                key = self.keys.server_workers(server.name)
                pipe.hset(key, self.worker_name, json.dumps(view, sort_keys=True))
                pipe.expire(key, WORKERS_HASH_TTL_S)
            pipe.execute()
        self._published, self._published_at = views, now

    def publish_servers(self) -> None:
        """What this worker learned of each server it accepted (`datagen.control.servers.publish_server`,
        as the health probe wrote it when the server came up), written again."""
        for server in self.fleet.servers:
            if server.context_len is None or server.refused is not None:
                continue
            entry = {"context_len": server.context_len, **server.model(), "seen_at_ms": now_ms()}
            publish_server(self.redis, self.keys, server.name, entry)

    def _view(self, server: Server) -> dict[str, object]:
        return {
            "state": ServerState.DRAINING if self.draining else server.state,
            "in_flight": {cls.value: server.in_flight[cls] for cls in PromptClass},
            "limits": {cls.value: server.limits[cls] for cls in PromptClass},
            "factor": round(server.factor, 4),
            "context_len": server.context_len,
            **server.model(),
            "refused": server.refused,
            "metrics": self.metrics_address,
        }

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
                    server, f"{server.health_timeouts} /health probes timed out in a row", abandon=True
                )
            return
        except RetryableError as exc:
            await self.fleet.mark_down(server, str(exc), abandon=True)
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
    """The KV controller of one server; only the worker holding the server's controller lease
    steps it (any worker may seed or reset the shared target, see :meth:`prime` and :meth:`step`).

    The phase (``slow_start`` or ``steady``) lives in the server's control hash beside the target,
    so a worker that takes the lease over carries on where the previous holder was.
    """

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
        initial_target: int = DEFAULT_CONTROLLER_INITIAL_TARGET,
        slow_start_interval_s: float = DEFAULT_CONTROLLER_SLOW_START_INTERVAL_S,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.server = server
        self.metrics = metrics
        self.owner = owner
        self.interval_s = interval_s
        self.floor_fraction = floor_fraction
        self.initial_target = initial_target
        self.slow_start_interval_s = slow_start_interval_s
        self._previous: KvSignals | None = None
        self._misses = 0
        # This worker's last view of the phase; it sets the pace of the loop.
        self._slow_start = True
        self._was_up = server.up
        # Whether this worker had requests on the server at the last step.
        self._last_busy = False

    async def run(self) -> None:
        # `Worker.start` primed it before admission began; again here for a controller started
        # on its own (HSETNX: a target learnt meanwhile is kept).
        try:
            self.prime()
        except RedisError as exc:
            log.warning("KV controller for %s cannot reach Redis: %s", self.server.name, exc)
        last_step = 0.0
        while True:
            await asyncio.sleep(self._pause_s())
            idle = not self._last_busy and not any(self.server.in_flight.values())
            if idle and time.monotonic() - last_step < IDLE_STEP_S:
                # Nothing of this worker's ran there since the last step: little to decide, so an
                # idle worker steps (and spends Redis commands) rarely; demand resumes the pace.
                continue
            last_step = time.monotonic()
            try:
                await self.step()
            except RedisError as exc:
                log.warning("KV controller for %s cannot reach Redis: %s", self.server.name, exc)

    def _pause_s(self) -> float:
        if self._slow_start:
            return min(self.interval_s, self.slow_start_interval_s)
        return self.interval_s

    def _ceiling(self) -> int:
        return sum(self.server.max_limits.values())

    def _initial(self, ceiling: int) -> int:
        """The slow-start window, within the floor and the ceiling (0: the ceiling, no slow start)."""
        if self.initial_target == 0:
            return ceiling
        return min(ceiling, max(self._floor(ceiling), self.initial_target))

    def prime(self) -> None:
        """Seed a server that has no shared target yet with the slow-start window (atomically: the
        first worker wins), and apply the shared target to this worker's limits now rather than at
        the next fleet sync."""
        server, ceiling = self.server, self._ceiling()
        if ceiling == 0:
            return
        initial = self._initial(ceiling)
        key = self.keys.server_control(server.name)
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.hsetnx(key, "target", initial)
            pipe.hsetnx(key, "ceiling", ceiling)
            pipe.hsetnx(key, "factor", initial / ceiling)
            pipe.hsetnx(key, "phase", SLOW_START if initial < ceiling else STEADY)
            pipe.hget(key, "factor")
            pipe.hget(key, "phase")
            *_, raw_factor, raw_phase = pipe.execute()
        self._slow_start = raw_phase is not None and as_text(raw_phase) == SLOW_START
        server.apply_target(float(raw_factor), server.share)

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
        ceiling = self._ceiling()
        if not server.up:
            if self._was_up and ceiling:
                # Whatever the server held is gone; when it is back it starts from slow start.
                self._restart(ceiling, "the server went down")
            self._was_up = False
            self._previous = None
            return
        self._was_up = True
        self._last_busy = any(server.in_flight.values())
        if ceiling == 0 or not self._hold_lease():
            self._previous = None
            self._slow_start = False  # another worker steps it: look at the lease at the usual pace
            return
        current = await self._read_signals()
        if current is None:
            return
        self._observe(current)
        key = self.keys.server_control(server.name)
        state = {as_text(k): as_text(v) for k, v in cast(dict[bytes, bytes], self.redis.hgetall(key)).items()}
        before = min(ceiling, int(state["target"])) if "target" in state else self._initial(ceiling)
        target, slow, previous, note = before, state.get("phase", STEADY) == SLOW_START, self._previous, ""
        if "target" not in state:
            slow = self._initial(ceiling) < ceiling
        # The signals the last controller wrote also tell a restart that happened while none looked.
        if restarted(previous or _stored_signals(state), current):
            target, slow, previous = self._initial(ceiling), self._initial(ceiling) < ceiling, None
            note = "the server restarted"
        decision = decide(
            target,
            previous,
            current,
            floor=self._floor(ceiling),
            ceiling=ceiling,
            slow_start=slow,
            usable=self._usable(),
        )
        self._previous = current
        self._slow_start = decision.slow_start
        reason = "; ".join(r for r in (note, decision.reason) if r) or None
        self._write(key, ceiling, decision.target, decision.slow_start, current, reason)
        server.apply_target(decision.target / ceiling, server.share)
        if reason is not None:
            self._changed(before, decision.target, reason)

    async def _read_signals(self) -> KvSignals | None:
        server = self.server
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
            return None
        if self._misses >= METRICS_MISSES_TO_WARN:
            log.info("server %s: /metrics readable again; KV control resumes", server.name)
        self._misses = 0
        return current

    def _floor(self, ceiling: int) -> int:
        return max(1, math.ceil(ceiling * self.floor_fraction))

    def _usable(self) -> int | None:
        """The server's slots of the classes this worker has in flight there (its limits times the
        workers sharing the server): a job of one class cannot fill the other class's share. None
        when this worker has nothing there (other workers may): the whole target."""
        server = self.server
        used = sum(limit for cls, limit in server.limits.items() if server.in_flight[cls] > 0)
        return server.share * used if used else None

    def _restart(self, ceiling: int, why: str) -> None:
        initial = self._initial(ceiling)
        self._slow_start = initial < ceiling
        key = self.keys.server_control(self.server.name)
        self.redis.hset(
            key,
            mapping={
                "target": initial,
                "ceiling": ceiling,
                "factor": initial / ceiling,
                "phase": SLOW_START if self._slow_start else STEADY,
                "reason": f"{why}; in-flight target back to {initial}",
                "changed_at_ms": now_ms(),
            },
        )
        self.server.apply_target(initial / ceiling, self.server.share)
        log.info("server %s: %s; in-flight target back to %d (slow start)", self.server.name, why, initial)

    def _write(
        self, key: str, ceiling: int, target: int, slow_start: bool, signals: KvSignals, reason: str | None
    ) -> None:
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(
                key,
                mapping={
                    "target": target,
                    "ceiling": ceiling,
                    "factor": target / ceiling,
                    "phase": SLOW_START if slow_start else STEADY,
                    "signals": json.dumps(signals.to_json(), sort_keys=True),
                    "controller": self.owner,
                },
            )
            if reason is not None:
                pipe.hset(key, mapping={"reason": reason, "changed_at_ms": now_ms()})
            pipe.execute()

    def _changed(self, before: int, after: int, reason: str) -> None:
        if after != before:
            direction = "down" if after < before else "up"
            self.metrics.controller_changes.labels(self.server.name, direction).inc()
        log.info("server %s: in-flight target %d -> %d: %s", self.server.name, before, after, reason)

    def _observe(self, signals: KvSignals) -> None:
        name = self.server.name
        if signals.token_usage is not None:
            self.metrics.kv_token_usage.labels(name).set(signals.token_usage)
        self.metrics.server_queue.labels(name).set(signals.num_queue_reqs)
        self.metrics.server_running.labels(name).set(signals.num_running_reqs)
        if signals.retracted_total is not None:
            self.metrics.server_retractions.labels(name).set(signals.retracted_total)


def _stored_signals(state: dict[str, str]) -> KvSignals | None:
    try:
        return KvSignals.from_json(json.loads(state["signals"])) if "signals" in state else None
    except (ValueError, TypeError):
        return None
