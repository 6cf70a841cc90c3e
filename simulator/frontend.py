"""What the SGLang and vLLM front ends share, so that each package holds only its own contract.

Both put the one engine and the one token model behind HTTP and differ in routes, bodies, error
shapes, metric names and which paths an API key guards. :class:`Frontend` is the state their routes
share (engine, metrics, tokenizer) and :func:`create_frontend_app` the app around it: the engine
runs inside the app's lifespan, ``app.state.sim`` is the front end (tests reach the engine through
it), and the bearer-token check is one middleware told which paths the server guards.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, Generic, Protocol, TypeVar

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import SecretStr

from simulator.config import SimConfig
from simulator.model import SpecialIds, tool_call_ids_for
from simulator.scheduler import Engine, EngineMetrics

__all__ = ["ExceptionHandler", "Frontend", "ServedMetrics", "create_frontend_app"]

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

    async def start(self) -> None:
        if self.config.tokenizer_path:
            self.tokenizer = await asyncio.to_thread(_load_tokenizer, self.config.tokenizer_path)
            self.special = SpecialIds.from_tokenizer(self.tokenizer)
        self.engine.start()

    async def close(self) -> None:
        await self.engine.close()

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
        try:
            yield
        finally:
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
    return app


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
