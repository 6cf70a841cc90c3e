"""Which engine a server runs, asked of the server itself: :class:`DetectingEngine`, and the one
place that builds an engine's client (:func:`build_engine`), so that nothing above the seam imports
an engine.

The worker gives every server the :class:`DetectingEngine` of :func:`build_engine`. When the server
comes up (the health probe reads its facts) it asks the server which engine it is, builds that
engine's client and delegates everything to it from then on; a server restarted as the other engine
is noticed at its next come-up. How it tells them apart (``docs/reference/vllm-contract.md`` section 7):

1. ``GET /v1/models``: both engines serve it, with ``owned_by`` ``"sglang"`` or ``"vllm"``;
2. else ``GET /model_info`` answering 200 is SGLang (vLLM has no such route);
3. else ``GET /version`` answering ``{"version": ...}`` is vLLM.

A forced engine (``--engine``, ``DATAGEN_ENGINE``, or a ``vllm+http://`` URL) is checked the same
way: a server that is clearly the other engine is refused with a one-line reason; one that answers
neither way (a proxy hiding the routes) is taken at its word.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

import httpx
from pydantic import SecretStr

from datagen.errors import ConfigError, DatagenError, PreflightError, ServerError, ServerUnavailableError
from datagen.states import EngineChoice
from workers.engines.base import Engine, GenerateResult, KvSignals, ServerFacts, error_message
from workers.engines.http import DEFAULT_CONTROL_TIMEOUT_S, ClientTimeouts, PooledClient
from workers.engines.sglang import SGLangClient
from workers.engines.urls import shown_url
from workers.engines.vllm import VllmClient

__all__ = ["DetectingEngine", "EngineProbe", "build_engine", "detect_engine"]

log = logging.getLogger(__name__)

_OWNERS = {"sglang": EngineChoice.SGLANG, "vllm": EngineChoice.VLLM}


class EngineProbe(PooledClient):
    """The control pool alone, for ``/health`` and the detection routes before the engine is known."""

    kind = "inference"
    generate_path = ""  # never used: the probe sends no generation

    def _status_error(self, response: httpx.Response, *, what: str) -> DatagenError:
        said = f"{what} on server {self._label} got HTTP {response.status_code}: {error_message(response)}"
        if response.status_code in (401, 403):
            return ConfigError(
                f"{said}. The server wants an API key: set the one it was started with --api-key"
            )
        return ServerError(said)

    async def get_json(self, path: str) -> object | None:
        """The JSON body of a 200, None for any other status or a body that is not JSON; 401/403
        raise ConfigError (the key is wrong: detection cannot tell anything)."""
        timeout = self._control_timeout(DEFAULT_CONTROL_TIMEOUT_S)
        response = await self._send("GET", path, what=f"GET {path}", phase_timeouts=timeout)
        if response.status_code in (401, 403):
            raise self._status_error(response, what=f"GET {path}")
        if response.status_code != 200:
            return None
        try:
            return response.json()
        except ValueError:
            return None


async def detect_engine(probe: EngineProbe) -> EngineChoice | None:
    """The engine the server says it is, None when it answers like neither."""
    models = await probe.get_json("/v1/models")
    if isinstance(models, dict) and isinstance(models.get("data"), list) and models["data"]:
        card = models["data"][0]
        owner = card.get("owned_by") if isinstance(card, dict) else None
        if isinstance(owner, str) and owner in _OWNERS:
            return _OWNERS[owner]
    if await probe.get_json("/model_info") is not None:
        return EngineChoice.SGLANG
    version = await probe.get_json("/version")
    if isinstance(version, dict) and isinstance(version.get("version"), str):
        return EngineChoice.VLLM
    return None


class DetectingEngine:
    """An :class:`workers.engines.base.Engine` whose engine is learnt from the server when it comes up
    (or forced), then delegated to."""

    def __init__(
        self,
        name: str,
        *,
        choice: EngineChoice,
        build: Callable[[EngineChoice], Engine],
        probe: EngineProbe,
    ) -> None:
        self.name = name
        self.base_url = probe.base_url
        self.choice = choice
        self._build = build
        self._probe = probe
        self._client: Engine | None = None if choice is EngineChoice.AUTO else build(choice)

    def __repr__(self) -> str:
        return f"DetectingEngine({self.name!r}, {shown_url(self.base_url)!r}, {self.engine})"

    @property
    def engine(self) -> EngineChoice:
        """The engine in use; ``auto`` until the server has been asked."""
        return self._client.engine if self._client is not None else EngineChoice.AUTO

    def current(self) -> Engine:
        """The client this server's engine is delegated to; ServerUnavailableError until the
        server has said which engine it runs."""
        if self._client is None:
            raise ServerUnavailableError(
                f"server {self.name} ({shown_url(self.base_url)}) has not said which engine it runs "
                "yet; it is asked when its /health first answers 200"
            )
        return self._client

    async def start(self) -> None:
        if self._client is not None:
            await self._client.start()

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
        await self._probe.aclose()

    async def facts(self) -> ServerFacts:
        """Ask the server which engine it runs (every time it comes up), then its facts."""
        kind = await self._detect()
        if self._client is None or self._client.engine is not kind:
            old, self._client = self._client, self._build(kind)
            if old is not None:
                log.warning("server %s now runs %s, not %s", self.name, kind, old.engine)
                await old.aclose()
            else:
                log.info("server %s runs %s", self.name, kind)
        return await self._client.facts()

    async def _detect(self) -> EngineChoice:
        found = await detect_engine(self._probe)
        where = f"server {self.name} ({shown_url(self.base_url)})"
        if self.choice is EngineChoice.AUTO:
            if found is None:
                raise PreflightError(
                    f"{where} is neither an SGLang nor a vLLM server (/v1/models, /model_info and "
                    "/version answer like neither): check its URL, or name the engine with --engine "
                    "or a URL such as vllm+http://host:port"
                )
            return found
        if found is not None and found is not self.choice:
            raise PreflightError(
                f"{where} runs {found}, but this worker was told {self.choice} (--engine, "
                f"DATAGEN_ENGINE or a {self.choice}+http:// URL): give its right engine, or auto"
            )
        return self.choice

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: Mapping[str, object],
        *,
        rid: str,
        read_timeout_s: float | None = None,
    ) -> GenerateResult:
        return await self.current().generate(
            input_ids, sampling_params, rid=rid, read_timeout_s=read_timeout_s
        )

    async def health(self, *, timeout_s: float) -> bool:
        # Both engines answer /health alike, so the probe's control pool serves until one is known.
        if self._client is None:
            return await self._probe.health(timeout_s=timeout_s)
        return await self._client.health(timeout_s=timeout_s)

    async def kv_signals(self, *, timeout_s: float) -> KvSignals:
        return await self.current().kv_signals(timeout_s=timeout_s)


def build_engine(
    name: str,
    base_url: str,
    *,
    choice: EngineChoice,
    timeouts: ClientTimeouts,
    max_connections: int,
    api_key: str | SecretStr | None = None,
) -> DetectingEngine:
    """The engine of one server: ``choice`` forced, or ``auto`` to ask the server. Its client gets
    ``max_connections`` for generation; the probe, the control pool alone."""

    def build(engine: EngineChoice) -> Engine:
        client_class = VllmClient if engine is EngineChoice.VLLM else SGLangClient
        return client_class(
            name, base_url, timeouts=timeouts, max_connections=max_connections, api_key=api_key
        )

    probe = EngineProbe(name, base_url, timeouts=timeouts, max_connections=1, api_key=api_key)
    return DetectingEngine(name, choice=choice, build=build, probe=probe)
