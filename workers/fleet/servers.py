"""The inference servers (SGLang or vLLM) one worker sends to: slots per server and class, state, routing.

A prompt goes to a server with a free slot for its class among those that are up and not paused:
the fastest by measured speed (seconds per output token of its recent requests), and among
servers about as fast, the one with the most free slots (least outstanding), never a blind round
robin. While every server is full this is the one that frees a slot; what speed changes is the
choice when several have room (the backlog is draining, or a limit just grew): the last prompts
go to the fast servers instead of being spread over slow ones, and near the end of the backlog
a clearly slower server starts nothing new (:meth:`Fleet.held_back`). A server not measured yet comes
after measured ones (while none is measured, free slots alone decide); it gets work, and a
measurement, once the others are full. A server's slots per class are its configured
maximum scaled by the shared in-flight factor (the KV controller's) and divided among the
workers that list the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, cast
from urllib.parse import urlsplit

from pydantic import SecretStr

from datagen.errors import ConfigError
from datagen.states import EngineChoice, PromptClass, ServerRole, ServerState
from workers.engines.base import Engine
from workers.engines.urls import default_name, engine_prefix, shown_url, url_secret
from workers.metrics import WorkerMetrics

__all__ = ["CAPTURE_CLASS", "CaptureShape", "Fleet", "Server", "ServerSpec", "with_api_keys"]

log = logging.getLogger(__name__)

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
# How long a sample waits for the server that serves its prompt's other samples.
AFFINITY_WAIT_S = 2.0
# Prompts remembered for affinity (their samples are enqueued together, so recent ones suffice).
AFFINITY_MEMORY = 10_000
# Weight of the newest request in a server's measured speed (EWMAs of wall time and output tokens).
SPEED_EWMA_ALPHA = 0.1
# Servers whose seconds per token are within this factor of the fastest's count as equally fast
# (chosen among by free slots): measurement noise must not pile everything on one server.
SAME_SPEED_FACTOR = 1.15
# A capture server's slots are one pool: captures take this class's, and the other class has none.
CAPTURE_CLASS = PromptClass.SHORT


@dataclass(frozen=True)
class CaptureShape:
    """What a capture server writes, read from the file of its start-up probe: layers per token,
    hidden size and the stored dtype (``BF16``, ``F16``, ``F8_E4M3``)."""

    layers: int
    hidden_size: int
    dtype: str
    engine_version: str | None = None
    # The ids it was launched with, where the worker's --capture-layers declares them (vLLM does not
    # report them); None: only their count is known.
    layer_ids: tuple[int, ...] | None = None


@dataclass(eq=False)
class Server:
    name: str
    client: Engine  # SGLang or vLLM: nothing here asks which
    max_limits: dict[PromptClass, int]
    in_flight: dict[PromptClass, int] = field(default_factory=lambda: dict.fromkeys(PromptClass, 0))
    up: bool = True
    paused: bool = False
    context_len: int | None = None
    # What /model_info said when the server was last accepted or refused.
    model_path: str | None = None
    weight_version: str | None = None
    # Why a pre-flight check keeps the worker off this server (None: accepted or not yet checked).
    refused: str | None = None
    health_timeouts: int = 0
    # Whether the server was ever up for this worker: its first contact is "up", not "healthy again".
    was_up: bool = False
    factor: float = 1.0
    share: int = 1
    role: ServerRole = ServerRole.GENERATE
    # A capture server's shape, learnt by its probe (None before, and on generation servers).
    capture: CaptureShape | None = None
    limits: dict[PromptClass, int] = field(init=False)
    # Measured speed: EWMAs of a successful request's wall seconds and output tokens (None until
    # the first one). Their ratio is the server's seconds per output token under its recent load.
    latency_ewma_s: float | None = None
    tokens_ewma: float | None = None
    # Set when a health probe finds the server unreachable or hung: its requests in flight will
    # not answer, so they are abandoned and sent elsewhere (see :meth:`Fleet.mark_down`).
    _lost: asyncio.Event | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.limits = dict(self.max_limits)

    def lost(self) -> asyncio.Event:
        """Set once the requests in flight here now are abandoned (a probe found the server hung)."""
        if self._lost is None:
            self._lost = asyncio.Event()
        return self._lost

    def abandon(self) -> None:
        """Give up the requests in flight here now; requests sent later wait on a new event."""
        if self._lost is not None:
            self._lost.set()
            self._lost = None

    @property
    def accepting(self) -> bool:
        return self.up and not self.paused

    @property
    def state(self) -> ServerState:
        """What the server is, a pause aside: the pause is the coordinator's (its set in Redis, which
        ``GET /servers`` reads), so a view published before the worker saw a resume already says
        whether the server is up."""
        if self.refused is not None:
            return ServerState.REFUSED
        return ServerState.UP if self.up else ServerState.DOWN

    def model(self) -> dict[str, Any]:
        """What the server runs, in the shape of its published entry."""
        return {"model_path": self.model_path, "weight_version": self.weight_version}

    def free(self, cls: PromptClass) -> int:
        return max(0, self.limits[cls] - self.in_flight[cls]) if self.accepting else 0

    @property
    def s_per_token(self) -> float | None:
        """Seconds per output token of this server's recent requests; None until measured."""
        if self.latency_ewma_s is None or not self.tokens_ewma:
            return None
        return self.latency_ewma_s / self.tokens_ewma

    def observe(self, latency_s: float, output_tokens: int) -> None:
        """A request finished here in ``latency_s`` with ``output_tokens``: update the speed."""
        if self.latency_ewma_s is None or self.tokens_ewma is None:
            self.latency_ewma_s, self.tokens_ewma = latency_s, float(output_tokens)
            return
        a = SPEED_EWMA_ALPHA
        self.latency_ewma_s += a * (latency_s - self.latency_ewma_s)
        self.tokens_ewma += a * (output_tokens - self.tokens_ewma)

    def apply_target(self, factor: float, share: int) -> None:
        """Scale the configured maximum by ``factor`` and split it among ``share`` workers."""
        self.factor, self.share = factor, max(1, share)
        for cls, maximum in self.max_limits.items():
            self.limits[cls] = 0 if maximum == 0 else max(1, math.ceil(maximum * factor / self.share))


class Fleet:
    def __init__(self, servers: list[Server], metrics: WorkerMetrics) -> None:
        if not any(s.role is ServerRole.GENERATE for s in servers):
            raise ValueError("a worker needs at least one server")
        # Every server: health, publishing, pause and the KV controller treat both roles alike.
        self.servers = servers
        # Where prompts generate; capture servers only take `acquire(role=CAPTURE)`.
        self.generators = [s for s in servers if s.role is ServerRole.GENERATE]
        self.capturers = [s for s in servers if s.role is ServerRole.CAPTURE]
        self.metrics = metrics
        self._changed = asyncio.Condition()
        self._sticky: OrderedDict[str, Server] = OrderedDict()
        for server in servers:
            metrics.server_up.labels(server.name).set(1 if server.up else 0)

    def capacity(self, cls: PromptClass) -> int:
        """Slots of the servers taking requests; what one worker may have in flight for ``cls``."""
        return sum(s.limits[cls] for s in self.generators if s.accepting)

    def free_slots(self, cls: PromptClass, role: ServerRole = ServerRole.GENERATE) -> int:
        return sum(s.free(cls) for s in self._of(role))

    def _of(self, role: ServerRole) -> list[Server]:
        return self.generators if role is ServerRole.GENERATE else self.capturers

    def typical_latency_s(self) -> float | None:
        """The shortest measured wall time of a request (EWMA) among the servers taking requests;
        None before any has answered."""
        measured = [v for s in self.generators if s.accepting and (v := s.latency_ewma_s) is not None]
        return min(measured) if measured else None

    def mixed_speeds(self) -> bool:
        """Whether a server taking requests is measured clearly slower than the fastest: the only
        case where :meth:`held_back` can hold anything (so the backlog it needs is read only then)."""
        speeds = [v for s in self.generators if s.accepting and (v := s.s_per_token) is not None]
        return len(speeds) >= 2 and max(speeds) > min(speeds) * SAME_SPEED_FACTOR

    def held_back(self, cls: PromptClass, backlog: int) -> list[Server]:
        """The servers that should start no new prompt of ``cls`` while ``backlog`` prompts are
        left to dispatch fleet-wide: the end of a run.

        With ``T`` the output tokens of a typical request here, a prompt sent to server S now
        ends in about ``T * S.s_per_token``. Held back, it waits for the servers clearly faster
        than S to take the backlog ahead of it (by Little's law they end ``slots / (T * s_per_token)``
        requests a second, counting every worker's slots) and then takes ``T`` times the fastest
        one's seconds per token. When that is sooner, S gets nothing new: the last prompts go to
        the fast servers instead of starting on a slow one and ending after everything else.
        S's slots count again as soon as the backlog is larger (a new job) or the faster servers
        stop taking requests.
        """
        measured = [s for s in self.generators if s.accepting and s.s_per_token is not None]
        tokens = [s.tokens_ewma for s in measured if s.tokens_ewma]
        if len(measured) < 2 or not tokens:
            return []
        typical_tokens = sum(tokens) / len(tokens)
        held = []
        for server in measured:
            own = cast(float, server.s_per_token)
            faster = [f for f in measured if cast(float, f.s_per_token) * SAME_SPEED_FACTOR < own]
            rate = sum(
                f.limits[cls] * f.share / (typical_tokens * cast(float, f.s_per_token)) for f in faster
            )
            if rate <= 0:
                continue
            fastest = min(cast(float, f.s_per_token) for f in faster)
            if backlog / rate + typical_tokens * fastest < typical_tokens * own:
                held.append(server)
        return held

    async def acquire(
        self,
        cls: PromptClass,
        *,
        affinity: str | None = None,
        avoid: frozenset[str] = frozenset(),
        role: ServerRole = ServerRole.GENERATE,
        fits: Callable[[Server], bool] | None = None,
    ) -> Server:
        """A slot on the fastest server with room (least loaded among equally fast ones).

        ``avoid`` names servers where this prompt already failed (a timeout, a 5xx, an abort):
        others are preferred while they have room, so a retry does not go back to a wedged server
        whose ``/health`` still answers. Ties are broken at random, not by listing order.

        With ``affinity`` (the samples of one prompt), the server that took the first request of
        that key is preferred: the request waits up to ``AFFINITY_WAIT_S`` for a slot there, so
        the server's prefix cache serves every sample, and then goes wherever there is room.

        ``role`` CAPTURE takes a capture server's slot instead, among those ``fits`` accepts.
        """
        deadline = time.monotonic() + AFFINITY_WAIT_S
        async with self._changed:
            while True:
                # Read at every wake-up: a sibling sample placed while this one waited for a slot
                # names the server this one should follow.
                preferred = self._sticky.get(affinity) if affinity is not None else None
                if preferred is not None and preferred.free(cls) > 0:
                    server = preferred
                    break
                waiting_for_preferred = (
                    preferred is not None and preferred.accepting and time.monotonic() < deadline
                )
                if not waiting_for_preferred and (picked := self._pick(cls, avoid, role, fits)) is not None:
                    server = picked
                    break
                timeout_s = max(0.0, deadline - time.monotonic()) if waiting_for_preferred else None
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), timeout_s)
            server.in_flight[cls] += 1
        if affinity is not None:
            self._remember(affinity, server)
        self.metrics.in_flight.labels(server.name, cls.value).inc()
        return server

    def try_acquire(self, server: Server, cls: PromptClass) -> bool:
        """A slot on ``server`` now if it has one (for work that must not wait: backup requests);
        give it back with :meth:`release`."""
        if server.free(cls) <= 0:
            return False
        server.in_flight[cls] += 1
        self.metrics.in_flight.labels(server.name, cls.value).inc()
        return True

    def _pick(
        self,
        cls: PromptClass,
        avoid: frozenset[str],
        role: ServerRole = ServerRole.GENERATE,
        fits: Callable[[Server], bool] | None = None,
    ) -> Server | None:
        with_room = [s for s in self._of(role) if s.free(cls) > 0 and (fits is None or fits(s))]
        if not with_room:
            return None
        pool = [s for s in with_room if s.name not in avoid] or with_room
        measured = [v for s in pool if (v := s.s_per_token) is not None]
        if measured:
            limit = min(measured) * SAME_SPEED_FACTOR
            pool = [s for s in pool if (v := s.s_per_token) is not None and v <= limit]
        most = max(s.free(cls) for s in pool)
        return random.choice([s for s in pool if s.free(cls) == most])

    def _remember(self, affinity: str, server: Server) -> None:
        self._sticky[affinity] = server
        self._sticky.move_to_end(affinity)
        while len(self._sticky) > AFFINITY_MEMORY:
            self._sticky.popitem(last=False)

    async def release(self, server: Server, cls: PromptClass) -> None:
        server.in_flight[cls] -= 1
        self.metrics.in_flight.labels(server.name, cls.value).dec()
        await self._notify()

    async def mark_down(self, server: Server, reason: str, *, abandon: bool = False) -> None:
        """Send ``server`` nothing new; with ``abandon`` (a probe found it unreachable or hung), its
        requests in flight are given up too, to be sent elsewhere instead of waiting for their
        read timeout."""
        if server.up:
            log.warning("server %s marked down: %s", server.name, reason)
        server.up = False
        self.metrics.server_up.labels(server.name).set(0)
        if abandon:
            if in_flight := sum(server.in_flight.values()):
                log.warning("abandoning %d requests in flight on server %s", in_flight, server.name)
            server.abandon()

    async def refuse(self, server: Server, reason: str) -> None:
        """Keep off ``server`` until a later probe accepts it; the reason is logged once."""
        if reason != server.refused:
            log.error("server %s refused: %s", server.name, reason)
        server.refused = reason
        server.up = False
        self.metrics.server_up.labels(server.name).set(0)

    async def mark_up(self, server: Server) -> None:
        if server.refused is not None:
            log.info("server %s accepted: its pre-flight checks pass now", server.name)
            server.refused = None
        if not server.up and server.was_up:
            log.info("server %s is healthy again", server.name)
        elif not server.up:
            log.info(
                "server %s is up: %s at %s, model %s, context length %s",
                server.name,
                server.client.engine.value,
                shown_url(server.client.base_url),
                server.model_path,
                server.context_len,
            )
        server.up = server.was_up = True
        self.metrics.server_up.labels(server.name).set(1)
        await self._notify()

    async def changed(self) -> None:
        """Limits or pauses changed: wake anyone waiting for a slot."""
        await self._notify()

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()


@dataclass(frozen=True)
class ServerSpec:
    name: str
    url: str
    # This server's --api-key; None: the worker's default (DATAGEN_API_KEY).
    api_key: SecretStr | None = field(default=None, repr=False, compare=False)
    # From a URL such as vllm+http://host:port; auto: the worker's --engine decides.
    engine: EngineChoice = EngineChoice.AUTO

    @classmethod
    def parse(cls, value: str) -> ServerSpec:
        """``NAME=URL`` or a bare URL, which is named ``host-port``. The URL's scheme may name the
        engine, as in ``vllm+http://host:port`` or ``sglang+https://host``. A URL with credentials,
        a query string or a fragment is refused (:func:`url_secret`)."""
        _refuse_secret(value)
        name, sep, url = value.partition("=")
        if not sep:
            url, name = value, ""
        url = url.strip().rstrip("/")
        engine, url = engine_prefix(url)
        default = default_name(url)
        if default is None:
            raise ValueError(
                f"server {shown_url(value)!r}: expected NAME=http://host:port or http://host:port (the "
                "scheme may name the engine: vllm+http://, sglang+http://)"
            )
        name = name or default
        if not _NAME.match(name):
            raise ValueError(f"server name {name!r}: use letters, digits, '.', '_' or '-'")
        return cls(name, url, engine=engine)

    @classmethod
    def parse_many(cls, values: list[str]) -> list[ServerSpec]:
        pieces = [v for item in values for v in item.split(",") if v.strip()]
        # Every piece is checked before any is parsed: a password or query holding ',' is split
        # into pieces, and the one with the '@' or '?' must be refused before a piece of the secret
        # is quoted in another message.
        for piece in pieces:
            _refuse_secret(piece)
        specs = [cls.parse(v) for v in pieces]
        names = [s.name for s in specs]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"server names must be unique; repeated: {', '.join(duplicates)}")
        _refuse_second_names(specs)
        return specs


def _refuse_second_names(specs: list[ServerSpec]) -> None:
    """ValueError when two names are given for one URL: one server would be published, counted and
    paused twice, and the second name would linger in ``GET /servers``."""
    named: dict[str, str] = {}
    for spec in specs:
        parts = urlsplit(spec.url)  # scheme and host are case-blind; the path is not
        key = f"{parts.scheme.lower()}://{parts.netloc.lower()}{parts.path}"
        if key in named:
            raise ValueError(
                f"servers {named[key]} and {spec.name} are one server ({shown_url(spec.url)}): give each "
                f"URL once, as --server {named[key]}={shown_url(spec.url)}"
            )
        named[key] = spec.name


def _refuse_secret(value: str) -> None:
    """ValueError (:func:`url_secret`'s message) when ``NAME=URL`` or a bare URL carries a secret."""
    name, sep, url = value.partition("=")
    # A part before '=' that is no name belongs to a bare URL (a password or query holding '=').
    named = bool(sep) and _NAME.match(name) is not None
    secret = url_secret(url if named else value, name=name if named else "")
    if secret is not None:
        raise ValueError(secret)


def with_api_keys(specs: list[ServerSpec], keys: Mapping[str, SecretStr]) -> list[ServerSpec]:
    """The specs with their per-server API keys; a key for a name not in ``specs`` is refused."""
    names = {spec.name for spec in specs}
    unknown = sorted(set(keys) - names)
    if unknown:
        raise ConfigError(
            f"an API key is given for unknown server(s) {', '.join(unknown)}; this worker's servers are "
            f"{', '.join(sorted(names))}. Make the names in DATAGEN_SERVER_API_KEYS (or the file of "
            "DATAGEN_SERVER_API_KEYS_FILE) match those of --server NAME=URL"
        )
    return [replace(spec, api_key=keys[spec.name]) if spec.name in keys else spec for spec in specs]
