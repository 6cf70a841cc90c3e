"""The simulated SGLang HTTP server: routes and error bodies, following the SGLang contract.

Not simulated, by choice: streaming (``stream: true`` gets a 400 saying so), logprobs, hidden
states, input embeddings, grammar constraints and stop strings (accepted, never matched: the
simulated text is random), the prefix cache (``cached_tokens`` is always 0) and pause/continue.

``/parse_function_call`` implements SGLang's qwen25 (alias qwen) and deepseekv3 parsers only; another
``tool_call_parser`` gets a 400 naming them, where SGLang's uncaught ValueError would be a bare 500.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from fastapi import APIRouter, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict

from simulator.config import SimConfig
from simulator.frontend import create_frontend_app
from simulator.sglang._protocol import GenerateReqInput, RequestError, ServerBug
from simulator.sglang._service import SimServer
from simulator.sglang.chaos import Chaos
from simulator.sglang.function_call import UnsupportedParserError, parse_function_call

__all__ = ["SGLANG_VERSION", "create_sglang_app"]

logger = logging.getLogger(__name__)

# The SGLang release whose contract the simulator follows.
SGLANG_VERSION = "0.5.15"
# Paths SGLang's --api-key leaves open (prefixes, so /health_generate and /metrics/... too).
_OPEN_PATH_PREFIXES = ("/health", "/metrics")
_FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)


class AbortReq(BaseModel):
    model_config = ConfigDict(extra="ignore")

    rid: str = ""
    abort_all: bool = False


class FunctionSpec(BaseModel):
    """SGLang's ``Function`` (of ``Tool``): only ``name`` is required."""

    model_config = ConfigDict(extra="ignore")

    name: str
    description: str | None = None
    parameters: object | None = None
    strict: bool = False


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str = "function"
    function: FunctionSpec


class ParseFunctionCallReq(BaseModel):
    model_config = ConfigDict(extra="ignore")

    text: str
    tools: list[ToolSpec] = []
    tool_call_parser: str | None = None


def create_sglang_app(config: SimConfig) -> FastAPI:
    """A FastAPI app simulating one SGLang server; its engine runs inside the app lifespan."""
    server = SimServer(config)
    return create_frontend_app(
        server,
        title="simulated SGLang",
        guards=_guarded,
        exception_handlers={RequestValidationError: _validation_error, HTTPException: _http_error},
        routers=[
            _generation_routes(server),
            _parsing_routes(),
            _info_routes(server),
            _control_routes(server),
        ],
    )


def _guarded(path: str) -> bool:
    # SGLang's add_api_key_middleware: a bearer token on every path but /health* and /metrics*.
    return not path.startswith(_OPEN_PATH_PREFIXES)


# -- error bodies (SGLang's http_server exception handlers) ----------------------------------


def _error_body(message: str, *, type_: str, code: int) -> dict[str, Any]:
    return {"object": "error", "message": message, "type": type_, "param": None, "code": code}


async def _validation_error(request: Request, exc: Exception) -> Response:
    # SGLang overrides FastAPI's 422 with a 400 carrying both renderings of the error.
    assert isinstance(exc, RequestValidationError)
    exc_str, errors_str = str(exc), str(exc.errors())
    message = f"{exc_str} {errors_str}" if errors_str and errors_str != exc_str else exc_str
    return JSONResponse(_error_body(message, type_="Bad Request", code=400), status_code=400)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    body = _error_body(str(exc.detail), type_=str(exc.status_code), code=exc.status_code)
    return JSONResponse(body, status_code=exc.status_code)


def _bad_request(message: str) -> Response:
    return JSONResponse({"error": {"message": message}}, status_code=400)


# -- routes ------------------------------------------------------------------------------------


def _generation_routes(server: SimServer) -> APIRouter:
    router = APIRouter()

    @router.api_route("/generate", methods=["POST", "PUT"])
    async def generate(obj: GenerateReqInput, request: Request) -> Response:
        try:
            body = await server.generate(obj, request)
        except RequestError as exc:
            return _bad_request(str(exc))
        except ServerBug as exc:
            # What an uncaught TypeError inside SGLang turns into (Starlette's default 500).
            logger.error("simulated server error on /generate: %s", exc)
            return PlainTextResponse("Internal Server Error", status_code=500)
        return JSONResponse(body)

    @router.get("/health")
    @router.get("/health_generate")
    async def health() -> Response:
        chaos = server.chaos
        if chaos.health_delay_s:
            await asyncio.sleep(chaos.health_delay_s)
        if chaos.health_status is not None:
            return Response(status_code=chaos.health_status)
        return Response(status_code=200 if server.is_ready else 503)

    return router


def _parsing_routes() -> APIRouter:
    router = APIRouter()

    @router.post("/parse_function_call")
    async def parse_function_call_request(obj: ParseFunctionCallReq) -> Response:
        names = [tool.function.name for tool in obj.tools]
        try:
            result = parse_function_call(obj.text, names, obj.tool_call_parser)
        except UnsupportedParserError as exc:
            return _bad_request(str(exc))
        calls = [
            {"tool_index": call.tool_index, "name": call.name, "parameters": call.parameters}
            for call in result.calls
        ]
        return JSONResponse({"normal_text": result.normal_text, "calls": calls})

    return router


def _info_routes(server: SimServer) -> APIRouter:
    router = APIRouter()
    cfg = server.config
    created = int(time.time())

    @router.get("/model_info")
    @router.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return {
            "model_path": cfg.served_model_name,
            "tokenizer_path": cfg.tokenizer_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": cfg.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": "deepseek_v3",
            "architectures": ["DeepseekV3ForCausalLM"],
        }

    @router.get("/server_info")
    @router.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        engine = server.engine
        return {
            # A subset of ServerArgs; SGLang returns every field.
            "model_path": cfg.served_model_name,
            "tokenizer_path": cfg.tokenizer_path,
            "served_model_name": cfg.served_model_name,
            "host": cfg.host,
            "port": cfg.port,
            "context_length": None if server.chaos.hide_context_len else cfg.context_len,
            "max_running_requests": cfg.max_running_requests,
            "max_total_tokens": cfg.max_total_num_tokens,
            "max_prefill_tokens": cfg.max_prefill_tokens,
            "skip_tokenizer_init": cfg.tokenizer_path is None,
            "enable_metrics": True,
            "weight_version": cfg.weight_version,
            "status": "ready",
            "max_total_num_tokens": cfg.max_total_num_tokens,
            "max_req_input_len": cfg.max_req_input_len,
            "internal_states": [
                {
                    "last_gen_throughput": engine.gen_throughput,
                    "memory_usage": {
                        "weight": 0.0,
                        "kvcache": 0.0,
                        "token_capacity": engine.capacity_tokens,
                        "graph": 0.0,
                    },
                    "effective_max_running_requests_per_dp": cfg.max_running_requests,
                }
            ],
            "version": SGLANG_VERSION,
            "kv_events": None,
        }

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": cfg.served_model_name,
            "object": "model",
            "created": created,
            "owned_by": "sglang",
            "root": cfg.served_model_name,
            "parent": None,
            "max_model_len": cfg.context_len,
        }
        if server.chaos.hide_context_len:
            del card["max_model_len"]
        return {"object": "list", "data": [card]}

    return router


def _control_routes(server: SimServer) -> APIRouter:
    router = APIRouter()

    @router.post("/_sim/chaos")
    async def set_chaos(chaos: Chaos) -> dict[str, Any]:
        server.chaos = chaos
        return chaos.model_dump()

    @router.get("/_sim/chaos")
    async def get_chaos() -> dict[str, Any]:
        return server.chaos.model_dump()

    @router.post("/abort_request")
    async def abort_request(obj: AbortReq) -> Response:
        server.engine.abort(obj.rid, abort_all=obj.abort_all)
        return Response(status_code=200)

    @router.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        engine = server.engine
        if engine.num_running or engine.num_queued:
            message = (
                "Cache not flushed because there are pending requests. "
                f"#queue-req: {engine.num_queued}, #running-req: {engine.num_running}\n"
            )
            return PlainTextResponse(message, status_code=400)
        return PlainTextResponse(_FLUSHED, status_code=200)

    return router
