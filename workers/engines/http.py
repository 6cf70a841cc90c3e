"""Long-lived HTTP connection pools to one inference server, shared by both engines' clients.

:class:`PooledClient` owns the connections (the generation route's, split into pools of at most
``GENERATE_POOL_CONNECTIONS``, and a small control pool) and the translation of httpx's transport
errors into the project's errors; :class:`workers.engines.sglang.SGLangClient` and
:class:`workers.engines.vllm.VllmClient` add their engine's routes and reply parsing on top.
"""

from __future__ import annotations

import json
import logging
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, ClassVar, Self

import httpx
from pydantic import SecretStr

from datagen.errors import (
    ConfigError,
    DatagenError,
    RequestTimeoutError,
    ServerError,
    ServerUnavailableError,
)
from datagen.settings import DEFAULT_CONNECT_TIMEOUT_S
from workers.engines.base import ERROR_TEXT_MAX_CHARS
from workers.engines.urls import shown_url, url_secret

__all__ = [
    "CONTROL_CONNECTIONS",
    "DEFAULT_CONTROL_TIMEOUT_S",
    "DEFAULT_POOL_TIMEOUT_S",
    "DEFAULT_READ_TIMEOUT_S",
    "DEFAULT_WRITE_TIMEOUT_S",
    "GENERATE_POOL_CONNECTIONS",
    "ClientTimeouts",
    "PooledClient",
]

logger = logging.getLogger(__name__)

# A non-streaming generation (/generate, /v1/completions) answers only when it is all done; long
# outputs on a busy server take many minutes.
DEFAULT_READ_TIMEOUT_S = 1800.0
# A 100k-token prompt is about 1 MB of JSON.
DEFAULT_WRITE_TIMEOUT_S = 60.0
# Callers bound their concurrency by max_connections; if they do not, a request waits for a pooled
# connection as long as another generation runs, so this must not be shorter than the read timeout.
DEFAULT_POOL_TIMEOUT_S = DEFAULT_READ_TIMEOUT_S
# /health, /metrics and the info routes answer in seconds even under load.
DEFAULT_CONTROL_TIMEOUT_S = 30.0

# Connections of the control pool (health, metrics, info); generation has its own pools.
CONTROL_CONNECTIONS = 2
# Generation's connections are split into pools of at most this many: httpcore walks every queued
# request and connection of a pool when a request starts or ends, so its CPU per request grows with
# the pool (at 256 connections a request cost 2x the client CPU of one over 8 pools of 32 here).
GENERATE_POOL_CONNECTIONS = 32


@dataclass(frozen=True)
class ClientTimeouts:
    """httpx's four timeouts, for generation; control endpoints use a short one of their own."""

    connect_s: float = DEFAULT_CONNECT_TIMEOUT_S
    read_s: float = DEFAULT_READ_TIMEOUT_S
    write_s: float = DEFAULT_WRITE_TIMEOUT_S
    pool_s: float = DEFAULT_POOL_TIMEOUT_S

    def to_httpx(self, *, read_s: float | None = None) -> httpx.Timeout:
        return httpx.Timeout(
            connect=self.connect_s,
            read=self.read_s if read_s is None else read_s,
            write=self.write_s,
            pool=self.pool_s,
        )


def _check_base_url(name: str, base_url: str, kind: str) -> httpx.URL:
    # Credentials in the URL would reach the server as basic auth in place of its API key, and be
    # shown wherever the URL is: refused, as at the command line (ServerSpec.parse).
    secret = url_secret(base_url, name=name)
    if secret is not None:
        raise ConfigError(secret)
    try:
        url = httpx.URL(base_url)
    except httpx.InvalidURL as exc:
        raise ConfigError(f"{kind} base URL {shown_url(base_url)!r} is not a URL: {exc}") from exc
    if url.scheme not in ("http", "https") or not url.host:
        raise ConfigError(f"{kind} base URL {shown_url(base_url)!r} must look like http://host:port")
    return url


def _split(total: int, most: int) -> list[int]:
    """``total`` connections in as few pools of at most ``most`` as can hold them, sizes within one."""
    count = max(1, -(-total // most))
    return [total // count + (1 if i < total % count else 0) for i in range(count)]


class PooledClient:
    """Long-lived connection pools to one server: ``max_connections`` for the generation route,
    split into pools of at most ``GENERATE_POOL_CONNECTIONS``, and a small one for the control routes.

    Open it with ``start()`` or ``async with``; the first call opens it too if nobody did. After
    ``aclose()`` it cannot be used again (RuntimeError), so a closed worker cannot leak a new pool.
    """

    # The engine's name in messages, and the route whose requests take the large pools.
    kind: ClassVar[str]
    generate_path: ClassVar[str]
    health_path: ClassVar[str] = "/health"

    def __init__(
        self,
        name: str,
        base_url: str,
        *,
        timeouts: ClientTimeouts,
        max_connections: int,
        api_key: str | SecretStr | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if max_connections < 1:
            raise ConfigError(
                f"max_connections for {self.kind} server {name!r} must be >= 1, got {max_connections}"
            )
        self.name = name
        self.base_url = str(_check_base_url(name, base_url, self.kind))
        self.timeouts = timeouts
        key = api_key.get_secret_value() if isinstance(api_key, SecretStr) else api_key
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._transport = transport
        self._control_http: httpx.AsyncClient | None = None
        # The generation route's pools (GENERATE_POOL_CONNECTIONS each at most, opened as the open ones fill
        # up), their sizes and the requests each one has open.
        self._pools: list[httpx.AsyncClient] = []
        self._pool_sizes = _split(max_connections, GENERATE_POOL_CONNECTIONS)
        self._pool_open = [0] * len(self._pool_sizes)
        # Built once and shared by every pool: httpx would build one per client, about 70 ms each
        # (it loads the CA bundle).
        self._ssl_context: ssl.SSLContext | None = None
        self._closed = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {shown_url(self.base_url)!r})"

    @property
    def _label(self) -> str:
        return f"{self.name!r} ({shown_url(self.base_url)})"

    def current(self) -> Self:
        """This client answers for its server itself (:meth:`workers.engines.base.Engine.current`)."""
        return self

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        self._generate_pool()

    async def aclose(self) -> None:
        self._closed = True
        pools, self._pools = self._pools, []
        for pool in pools:
            await pool.aclose()
        if self._control_http is not None:
            control, self._control_http = self._control_http, None
            await control.aclose()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def _control(self) -> httpx.AsyncClient:
        """A second, small pool for /health, /metrics and the info routes.

        They must not queue behind hundreds of long generations in the main pools: a health
        probe or a metrics read that waits for a free connection is late exactly when it matters.
        """
        if self._control_http is None:
            self._control_http = self._open(CONTROL_CONNECTIONS)
        return self._control_http

    def _generate_pool(self) -> int:
        """The generation pool with the most free connections; the next one is opened only when
        every open one is full."""
        pools, sizes = self._pools, self._pool_sizes
        best = max(range(len(pools)), key=lambda i: sizes[i] - self._pool_open[i], default=None)
        if best is None or (sizes[best] <= self._pool_open[best] and len(pools) < len(sizes)):
            pools.append(self._open(sizes[len(pools)]))
            return len(pools) - 1
        return best

    def _open(self, connections: int) -> httpx.AsyncClient:
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")
        if self._ssl_context is None:
            self._ssl_context = httpx.create_ssl_context()
        return httpx.AsyncClient(
            base_url=self.base_url,
            verify=self._ssl_context,
            headers=self._headers,
            timeout=self.timeouts.to_httpx(),
            limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
            transport=self._transport,
            follow_redirects=False,
        )

    # -- transport ---------------------------------------------------------------------------------

    async def _send(
        self,
        method: str,
        path: str,
        *,
        what: str,
        phase_timeouts: httpx.Timeout,
        body: Mapping[str, object] | None = None,
    ) -> httpx.Response:
        pool = None
        if path == self.generate_path:
            pool = self._generate_pool()
            client = self._pools[pool]
            self._pool_open[pool] += 1
        else:
            client = self._control()
        try:
            return await client.request(method, path, json=body, timeout=phase_timeouts)
        except httpx.TimeoutException as exc:
            raise RequestTimeoutError(
                f"{what} on {self.kind} server {self._label} timed out ({type(exc).__name__}); "
                "it may be overloaded or hung: retry, and check its /health"
            ) from exc
        except httpx.TransportError as exc:
            raise ServerUnavailableError(
                f"{what} could not reach {self.kind} server {self._label}: {type(exc).__name__}: {exc}. "
                "It may be starting, restarting or down; retry once /health answers 200"
            ) from exc
        except httpx.RequestError as exc:
            raise ServerError(
                f"{what} on {self.kind} server {self._label} failed: {type(exc).__name__}: {exc}"
            ) from exc
        finally:
            if pool is not None:
                self._pool_open[pool] -= 1

    def _json(self, response: httpx.Response, *, what: str) -> object:
        try:
            return response.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ServerError(
                f"{what} on {self.kind} server {self._label} answered 200 with a body that is not JSON: "
                f"{response.text[:ERROR_TEXT_MAX_CHARS]!r}"
            ) from exc

    def _control_timeout(self, timeout_s: float) -> httpx.Timeout:
        return httpx.Timeout(timeout_s, connect=min(timeout_s, self.timeouts.connect_s))

    async def _get_ok(self, path: str, *, timeout_s: float, legacy_path: str | None = None) -> httpx.Response:
        """GET that must answer 200; on 404 it tries ``legacy_path``, the pre-0.5.6 name."""
        timeout = self._control_timeout(timeout_s)
        response = await self._send("GET", path, what=f"GET {path}", phase_timeouts=timeout)
        if response.status_code == 404 and legacy_path is not None:
            logger.debug("%s: %s is 404, trying %s", self.name, path, legacy_path)
            path = legacy_path
            response = await self._send("GET", path, what=f"GET {path}", phase_timeouts=timeout)
        if response.status_code != 200:
            raise self._status_error(response, what=f"GET {path}")
        return response

    async def _get_object(
        self, path: str, *, timeout_s: float, legacy_path: str | None = None
    ) -> dict[str, Any]:
        response = await self._get_ok(path, timeout_s=timeout_s, legacy_path=legacy_path)
        body = self._json(response, what=f"GET {path}")
        if not isinstance(body, dict):
            raise ServerError(
                f"GET {path} on {self.kind} server {self._label} answered {type(body).__name__}, "
                "not an object"
            )
        return body

    def _status_error(self, response: httpx.Response, *, what: str) -> DatagenError:
        raise NotImplementedError

    async def health(self, *, timeout_s: float) -> bool:
        """True only on 200; 503 (starting, shutting down, unhealthy) and anything else is False.
        Both engines serve ``/health`` this way (SGLang probes its scheduler with a one-token
        generation first; vLLM answers 200 unless its engine process died).

        Timeouts raise RequestTimeoutError and refused connections ServerUnavailableError, so a caller can
        tell a hung server from one that is down.
        """
        response = await self._send(
            "GET", self.health_path, what=f"GET {self.health_path}", phase_timeouts=httpx.Timeout(timeout_s)
        )
        if response.status_code != 200:
            logger.debug("%s: /health answered %d", self.name, response.status_code)
            return False
        return True
