"""The KV-pressure control loop of one server: :class:`KvControl`.

It runs in every worker and steps only in the one holding the server's controller lease: it reads
the server's ``/metrics``, runs :func:`workers.fleet.kv_policy.decide`, writes the shared target
(:class:`datagen.control.servers.ServerControl`) and applies it to its own worker's limits at once;
the other workers apply it at their next fleet sync. Before the worker's first claim it seeds a
server with no target yet with the slow-start window; it steps every
``controller_slow_start_interval_s`` during slow start, then every ``controller_interval_s``. A server
seen going down or restarting (its counters went back) starts slow start again.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

from redis import Redis, RedisError

from datagen.clock import now_ms
from datagen.control.keys import Keys
from datagen.control.redistext import as_text
from datagen.control.servers import ControllerPhase, ServerControl, read_control
from datagen.errors import DatagenError
from datagen.settings import DEFAULT_CONTROLLER_INITIAL_TARGET, DEFAULT_CONTROLLER_SLOW_START_INTERVAL_S
from workers.engines.base import KvSignals
from workers.fleet.kv_policy import decide, restarted
from workers.fleet.servers import Server
from workers.metrics import WorkerMetrics

__all__ = ["KvControl"]

log = logging.getLogger(__name__)

METRICS_TIMEOUT_S = 10.0
# The lease outlives this many controller intervals, so a holder that missed a step keeps it.
LEASE_INTERVALS = 3
# Consecutive unreadable /metrics pages before the controller says it is blind.
METRICS_MISSES_TO_WARN = 3
# How often the controller steps while this worker has no request on the server.
IDLE_STEP_S = 5.0


def _phase(slow_start: bool) -> ControllerPhase:
    return ControllerPhase.SLOW_START if slow_start else ControllerPhase.STEADY


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
        seed = ServerControl(
            target=initial, ceiling=ceiling, factor=initial / ceiling, phase=_phase(initial < ceiling)
        )
        key = self.keys.server_control(server.name)
        with self.redis.pipeline(transaction=True) as pipe:
            for field, value in seed.encode().items():
                pipe.hsetnx(key, field, value)
            pipe.hgetall(key)
            *_, raw = pipe.execute()
        control = ServerControl.decode(raw)
        self._slow_start = control.phase is ControllerPhase.SLOW_START
        factor = control.factor if control.factor is not None else initial / ceiling
        server.apply_target(factor, server.share)

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
        control = read_control(self.redis, self.keys, server.name)
        initial = self._initial(ceiling)
        if control.target is None:
            before, slow = initial, initial < ceiling
        else:
            before, slow = min(ceiling, control.target), control.phase is ControllerPhase.SLOW_START
        target, previous, note = before, self._previous, ""
        stored = KvSignals.from_json(control.signals) if control.signals is not None else None
        # The signals the last controller wrote also tell a restart that happened while none looked.
        if restarted(previous or stored, current):
            target, slow, previous = initial, initial < ceiling, None
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
        self._write(ceiling, decision.target, decision.slow_start, current, reason)
        server.apply_target(decision.target / ceiling, server.share)
        if reason is not None:
            self._changed(before, decision.target, reason)

    async def _read_signals(self) -> KvSignals | None:
        server = self.server
        try:
            current = await server.client.kv_signals(timeout_s=METRICS_TIMEOUT_S)
        except (DatagenError, ValueError) as exc:
            self._misses += 1
            if self._misses == METRICS_MISSES_TO_WARN:
                log.warning(
                    "server %s: no usable /metrics (%s); its in-flight target stays where it is, as if "
                    "the KV controller were off (start SGLang with --enable-metrics; vLLM always "
                    "serves them)",
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
        control = ServerControl(
            target=initial,
            ceiling=ceiling,
            factor=initial / ceiling,
            phase=_phase(self._slow_start),
            reason=f"{why}; in-flight target back to {initial}",
            changed_at_ms=now_ms(),
        )
        self.redis.hset(self.keys.server_control(self.server.name), mapping=control.encode())
        self.server.apply_target(initial / ceiling, self.server.share)
        log.info("server %s: %s; in-flight target back to %d (slow start)", self.server.name, why, initial)

    def _write(
        self, ceiling: int, target: int, slow_start: bool, signals: KvSignals, reason: str | None
    ) -> None:
        control = ServerControl(
            target=target,
            ceiling=ceiling,
            factor=target / ceiling,
            phase=_phase(slow_start),
            signals=signals.to_json(),
            controller=self.owner,
            # None is not written: the reason of the last change (and its time) stays shown.
            reason=reason,
            changed_at_ms=None if reason is None else now_ms(),
        )
        self.redis.hset(self.keys.server_control(self.server.name), mapping=control.encode())

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
