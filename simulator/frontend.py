"""What the SGLang and vLLM front ends share, so that each package holds only its own contract.

Both put the one engine and the one token model behind HTTP and differ in routes, bodies, error
shapes, metric names and which paths an API key guards. :class:`Frontend` is the state their routes
share (engine, metrics, tokenizer) and :func:`create_frontend_app` the app around it: the engine
runs inside the app's lifespan, ``app.state.sim`` is the front end (tests reach the engine through
it), and the bearer-token check is one middleware told which paths the server guards.

A simulator says what it serves: every ``report_interval_s`` in which requests came, one log line
counts them by route and status (:class:`RequestTally`), with the requests running and waiting.
With ``request_log`` set it also says what each generation request asked for (:class:`RequestLog`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import SecretStr
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from simulator.config import SimConfig
from simulator.model import SpecialIds, tool_call_ids_for
from simulator.scheduler import Engine, EngineMetrics

__all__ = [
    "ExceptionHandler",
    "Frontend",
    "RequestLog",
    "RequestTally",
    "ServedMetrics",
    "create_frontend_app",
]

log = logging.getLogger(__name__)

ExceptionHandler = Callable[[Request, Exception], Awaitable[Response]]


class ServedMetrics(EngineMetrics, Protocol):
    """The engine's series plus the text ``GET /metrics`` serves."""

    def exposition(self) -> bytes: ...


MetricsT = TypeVar("MetricsT", bound=ServedMetrics)


class Frontend(Generic[MetricsT]):
    """State shared by the routes of one app: config, engine, metrics and the tokenizer."""

    def __init__(self, config: SimConfig, metrics: MetricsT) -> None:
        self.config = config
        self.metrics = metrics
        self.engine = Engine(config, metrics)
        self.tokenizer: Any | None = None
        self.special = SpecialIds.deepseek_default()
        self.tally = RequestTally()
        self.request_log: RequestLog | None = None

    async def start(self) -> None:
        if self.config.tokenizer_path:
            self.tokenizer = await asyncio.to_thread(_load_tokenizer, self.config.tokenizer_path)
            self.special = SpecialIds.from_tokenizer(self.tokenizer)
        if self.config.request_log is not None:
            self.request_log = RequestLog(self.config.request_log)
        self.engine.start()

    async def close(self) -> None:
        await self.engine.close()
        if self.request_log is not None:
            self.request_log.close()

    def log_request(self, rid: str, input_ids: Sequence[int], sampling_params: Mapping[str, Any]) -> None:
        """Note an accepted generation request in the request log, if there is one."""
        if self.request_log is not None:
            self.request_log.write(
                api=self.config.api.value, rid=rid, input_ids=input_ids, sampling_params=sampling_params
            )

    def tokenize(self, text: str) -> list[int]:
        """The ids of ``text``, special tokens added as the tokenizer's call adds them."""
        assert self.tokenizer is not None
        return list(self.tokenizer(text)["input_ids"])

    def detokenize(
        self, ids: Sequence[int], *, skip_special_tokens: bool, spaces_between_special_tokens: bool
    ) -> str:
        if self.tokenizer is None:
            return _placeholder_text(ids, self.special, skip_special_tokens=skip_special_tokens)
        text: str = self.tokenizer.decode(
            ids,
            skip_special_tokens=skip_special_tokens,
            spaces_between_special_tokens=spaces_between_special_tokens,
        )
        return text

    def tool_call_ids(self, input_ids: list[int], *, seed: int | None) -> list[int]:
        """The call the simulated model makes for this prompt, if tool calls are on; else none."""
        fmt = self.config.tool_call_format
        if fmt is None or self.tokenizer is None:
            return []
        return tool_call_ids_for(input_ids, seed=seed, tokenizer=self.tokenizer, tool_call_format=fmt)


def create_frontend_app(
    frontend: Frontend[Any],
    *,
    title: str,
    guards: Callable[[str], bool],
    exception_handlers: Mapping[type[Exception], ExceptionHandler],
    routers: Sequence[APIRouter],
) -> FastAPI:
    """A FastAPI app serving ``frontend``; with an API key set, ``guards(path)`` says which paths need it."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await frontend.start()
        reporter = asyncio.create_task(_report(frontend), name="simulator-report")
        try:
            yield
        finally:
            reporter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reporter
            await frontend.close()

    app = FastAPI(title=title, lifespan=lifespan, openapi_url=None)
    app.state.sim = frontend
    api_key = frontend.config.api_key
    if api_key is not None:
        _require_api_key(app, api_key, guards)
    for exc_type, handler in exception_handlers.items():
        app.add_exception_handler(exc_type, handler)
    for router in routers:
        app.include_router(router)
    app.include_router(_metrics_route(frontend))
    app.add_middleware(_Counting, tally=frontend.tally)  # outermost: a 401 is counted too
    return app


class RequestLog:
    """One JSON line per accepted generation request, appended to ``SimConfig.request_log``.

    ``{"api", "rid", "prompt_tokens", "input_ids_sha256", "sampling_params", "at_ms"}``: the ids'
    hash is of their comma-joined decimal text; ``sampling_params`` are the fields the request
    carried, under its names; ``at_ms`` is wall-clock Unix time. Each line is one ``write`` on a
    descriptor opened with ``O_APPEND``: nothing is buffered (a test reads the file while the server
    runs) and lines never interleave, whether threads of one process or several simulators append to
    the file. Hashing and writing take about 0.1 ms for a 500-token prompt and 0.6 ms for an 8k one
    (measured), short enough to run on the event loop.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        # Keeps a short write's remainder next to its start (a full disk, a signal).
        self._lock = threading.Lock()

    def write(
        self, *, api: str, rid: str, input_ids: Sequence[int], sampling_params: Mapping[str, Any]
    ) -> None:
        ids_text = ",".join(map(str, input_ids))
        entry = {
            "api": api,
            "rid": rid,
            "prompt_tokens": len(input_ids),
            "input_ids_sha256": hashlib.sha256(ids_text.encode()).hexdigest(),
            "sampling_params": dict(sampling_params),
            "at_ms": int(time.time() * 1000),
        }
        line = memoryview((json.dumps(entry, separators=(",", ":")) + "\n").encode())
        with self._lock:
            if self._fd is None:  # a request that outlived the server's shutdown
                return
            while line:
                line = line[os.write(self._fd, line) :]

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


class RequestTally:
    """Requests answered since the last report, by method, route and status."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str, int]] = Counter()

    def take(self) -> Counter[tuple[str, str, int]]:
        """The counts so far; the tally starts again from none."""
        counts, self.counts = self.counts, Counter()
        return counts


class _Counting:
    """Pure ASGI (no per-request task, unlike ``@app.middleware``): counts each answered request."""

    def __init__(self, app: ASGIApp, tally: RequestTally) -> None:
        self.app = app
        self.tally = tally

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 0  # none sent: the request was dropped (a shutdown, a client gone)

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            self.tally.counts[(scope["method"], scope["path"], status)] += 1


async def _report(frontend: Frontend[Any]) -> None:
    interval_s = frontend.config.report_interval_s
    while True:
        await asyncio.sleep(interval_s)
        counts = frontend.tally.take()
        if not counts:
            continue
        by_route = ", ".join(
            f"{method} {path} {status or 'dropped'} x{n}"
            for (method, path, status), n in sorted(counts.items())
        )
        log.info(
            "served %d requests in the last %g s (%s); %d running, %d waiting",
            sum(counts.values()),
            interval_s,
            by_route,
            frontend.engine.num_running,
            frontend.engine.num_queued,
        )


def _require_api_key(app: FastAPI, api_key: SecretStr, guards: Callable[[str], bool]) -> None:
    # Both servers answer a missing or wrong bearer token with this 401; CORS preflights pass.
    expected = f"Bearer {api_key.get_secret_value()}".encode()

    @app.middleware("http")
    async def authenticate(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        if request.method == "OPTIONS" or not guards(request.url.path):
            return await call_next(request)
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        return await call_next(request)


def _metrics_route(frontend: Frontend[Any]) -> APIRouter:
    router = APIRouter()

    @router.get("/metrics")
    async def metrics() -> Response:
        return Response(frontend.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return router


def _load_tokenizer(path: str) -> Any:
    # Imported lazily: transformers is slow to import and most simulators never need it.
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _placeholder_text(ids: Sequence[int], special: SpecialIds, *, skip_special_tokens: bool) -> str:
    # Without a tokenizer: one readable piece per id, </think> kept as the marker it is.
    pieces = []
    for token in ids:
        if token == special.think_end_id:
            pieces.append("</think>")
        elif token in special.excluded_ids or token == special.eos_id:
            if not skip_special_tokens:
                pieces.append(f"<|special:{token}|>")
        else:
            pieces.append(f" t{token}")
    return "".join(pieces)
