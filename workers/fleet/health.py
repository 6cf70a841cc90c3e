"""Health probes: whether the worker may send work to a server, one :class:`HealthProbe` per server.

A probe asks ``/health`` with a timeout. Refused connections and 503 mark the server down at once;
``health_timeouts_to_down`` timeouts in a row do too (SGLang's probe runs a one-token generation and
is slow under load). vLLM's ``/health`` sends no probe request: it is 200 until the engine process
dies (then 503), so a vLLM scheduler that hangs without dying is not seen here, only by its
requests' read timeouts (which keep the prompt off that server at its next attempt). A server
marked down so (unreachable or hung, e.g. SIGSTOPped) has its requests in flight abandoned: they
are sent elsewhere at once, without charging an attempt, instead of waiting for their read
timeout. A 503 cancels nothing.

A server that comes up is read and checked first (:mod:`datagen.prompts.preflight`): which engine
it runs (:mod:`workers.engines.detect`: neither, or not the forced one, is refused), an unknown
context length, another model than the fleet's, or a 401/403 (the API key) keeps the worker off it,
published as ``refused`` with the reason, until a later probe passes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable

from redis import Redis, RedisError

from datagen.clock import now_ms
from datagen.control.keys import Keys
from datagen.control.servers import ServerInfo, live_servers, publish_server
from datagen.errors import ConfigError, DatagenError, PreflightError, RequestTimeoutError, RetryableError
from datagen.prompts.preflight import check_server_joins
from datagen.states import ServerRole
from workers.fleet.servers import Fleet, Server

# A capture server's probe (`workers.run.capture`): None once it captured and its file's shape is
# learnt, else why the worker keeps off the server.
CaptureProbe = Callable[[Server], Awaitable[str | None]]

__all__ = ["API_KEY_HINT", "HealthProbe"]

log = logging.getLogger(__name__)

DOWN_PROBE_INTERVAL_S = 1.0
API_KEY_HINT = (
    "Check the API key of server {name}: DATAGEN_SERVER_API_KEYS or DATAGEN_SERVER_API_KEYS_FILE "
    "(NAME=KEY), else DATAGEN_API_KEY, must be the server's --api-key"
)


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
        capture_probe: CaptureProbe | None = None,
    ) -> None:
        self.capture_probe = capture_probe
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
            facts = await server.client.facts()
        except ConfigError as exc:  # 401/403: the key is wrong; retrying cannot help until it changes
            await self.fleet.refuse(server, f"{exc}. {API_KEY_HINT.format(name=server.name)}")
            # Nothing was read: the name alone, so that GET /servers shows the refused server.
            self._publish(server, ServerInfo(seen_at_ms=now_ms()), only_if_new=True)
            return False
        except PreflightError as exc:  # neither engine, or not the engine it was forced to be
            await self.fleet.refuse(server, str(exc))
            self._publish(server, ServerInfo(seen_at_ms=now_ms()), only_if_new=True)
            return False
        except DatagenError as exc:
            log.warning("server %s is healthy but its info is not readable: %s", server.name, exc)
            return False
        server.context_len = context_len = facts.context_len
        server.model_path, server.weight_version = facts.model_path, facts.weight_version
        learnt = ServerInfo(
            context_len=context_len,
            model_path=server.model_path,
            weight_version=server.weight_version,
            seen_at_ms=now_ms(),
            role=None if server.role is ServerRole.GENERATE else server.role.value,
        )
        self._publish(server, learnt)
        reason = self._refusal(server)
        if reason is None and server.role is ServerRole.CAPTURE:
            # Every time it comes up: a restarted server may have been launched with other layers.
            server.capture = None
            reason = await self.capture_probe(server) if self.capture_probe is not None else None
            if reason is None and server.capture is not None:
                self._publish(
                    server, learnt.model_copy(update={"capture": dataclasses.asdict(server.capture)})
                )
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

    def _publish(self, server: Server, info: ServerInfo, *, only_if_new: bool = False) -> None:
        try:
            publish_server(self.redis, self.keys, server.name, info, only_if_new=only_if_new)
        except RedisError as exc:
            log.warning("cannot publish server %s: %s", server.name, exc)
