"""vLLM's routes and error bodies, as vLLM 0.33.0 has them, so a client can tell the engines apart.

The routes: ``POST /v1/completions``, ``GET /v1/models``, ``/health``, ``/version`` and
``/metrics``. Every other path, SGLang's ``/generate``, ``/server_info`` and ``/model_info``
included, answers FastAPI's 404 ``{"detail": "Not Found"}`` as a real vLLM does. Errors have vLLM's shape
``{"error": {"message", "type", "param", "code"}}``; a client that disconnects aborts its
requests at once (vLLM's ``with_cancellation``).

With ``capture_dir`` set, ``/v1/completions`` also captures hidden states as vLLM's
``extract_hidden_states`` method with ``ExampleHiddenStatesConnector`` does (``simulator.vllm.capture``).

Not simulated, by choice: streaming, ``echo``, logprobs, beam search, ``suffix`` and
``min_tokens`` (each refused with a 400 naming it), stop strings (accepted, never matched), chat
completions, LoRA, the prefix cache, and the fault and warmup options of the SGLang mode.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from http import HTTPStatus
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from simulator.config import SimConfig
from simulator.frontend import create_frontend_app
from simulator.vllm._protocol import CompletionRequest, VllmError
from simulator.vllm._service import VllmServer

__all__ = ["VLLM_VERSION", "create_vllm_app"]

# The vLLM release whose contract this mode follows.
VLLM_VERSION = "0.33.0"
# vLLM's --api-key guards only these prefixes (GUARDED_PREFIX in serve/middleware/authenticate.py).
_GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")
_MAX_REPORTED_ERRORS = 10
_MAX_ERROR_INPUT_CHARS = 200
_RANDOM_ID_HEX = 16  # vLLM's random_uuid(): the base of a request id given neither header nor body id


def create_vllm_app(config: SimConfig) -> FastAPI:
    """A FastAPI app simulating one vLLM server; its engine runs inside the app lifespan."""
    server = VllmServer(config)
    return create_frontend_app(
        server,
        title="simulated vLLM",
        guards=_guarded,
        exception_handlers={RequestValidationError: _validation_error, VllmError: _vllm_error},
        routers=[_completion_routes(server), _info_routes(server)],
    )


def _guarded(path: str) -> bool:
    # vLLM's --api-key guards only its API prefixes, /health and /metrics left open.
    return path.startswith(_GUARDED_PREFIXES)


# -- error bodies (vllm/entrypoints/serve/exception_handling) -----------------------------------


async def _vllm_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, VllmError)
    return JSONResponse(exc.body(), status_code=exc.status)


async def _validation_error(request: Request, exc: Exception) -> Response:
    # validation_exception_handler: a 400 (not FastAPI's 422) listing the errors, with the first
    # error's location as ``param``.
    assert isinstance(exc, RequestValidationError)
    errors = list(exc.errors())
    param = None
    if errors and isinstance(errors[0], dict) and errors[0].get("loc"):
        param = _clean_loc(tuple(errors[0]["loc"]))
    if errors:
        label = "error" if len(errors) == 1 else "errors"
        lines = "".join(f"  {_format_error(err)}\n" for err in errors[:_MAX_REPORTED_ERRORS])
        message = f"{len(errors)} validation {label}:\n{lines}".rstrip()
    else:
        message = "Validation error"
    body = VllmError(message, err_type=HTTPStatus.BAD_REQUEST.phrase, param=param).body()
    return JSONResponse(body, status_code=HTTPStatus.BAD_REQUEST)


def _format_error(err: Any) -> str:
    if not isinstance(err, dict):
        return str(err)
    err = dict(err)
    value = err.get("input")
    if isinstance(value, list | tuple | dict | set):
        err["input"] = f"<{type(value).__name__} of {len(value)} items>"
    elif isinstance(value, str) and len(value) > _MAX_ERROR_INPUT_CHARS:
        err["input"] = value[:_MAX_ERROR_INPUT_CHARS] + "...[truncated]"
    if isinstance(err.get("loc"), tuple | list):
        err["loc"] = _clean_loc(tuple(err["loc"]))
    return str(err)


def _clean_loc(loc: tuple[Any, ...]) -> str:
    # Drops pydantic's union-branch markers ("list[constrained-int]", "function-wrap[...]").
    parts = [str(p) for p in loc if not any(c in str(p) for c in "[]{}()")]
    return ".".join(parts or [str(p) for p in loc])


async def _require_json(request: Request) -> None:
    # validate_json_request (vllm/entrypoints/serve/utils/api_utils.py).
    media_type = request.headers.get("content-type", "").lower().split(";", maxsplit=1)[0]
    if media_type != "application/json":
        raise RequestValidationError(errors=["Unsupported Media Type: Only 'application/json' is allowed"])


# -- routes ------------------------------------------------------------------------------------


def _completion_routes(server: VllmServer) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/completions", dependencies=[Depends(_require_json)])
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        base = (
            raw_request.headers.get("x-request-id") or request.request_id or uuid.uuid4().hex[:_RANDOM_ID_HEX]
        )
        work = asyncio.create_task(server.complete(request, f"cmpl-{base}"))
        gone = asyncio.create_task(_wait_for_disconnect(raw_request))
        done, pending = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        if work not in done:
            # The client is gone; cancelling ``work`` aborted its requests in the engine.
            return Response()
        return JSONResponse(work.result())

    return router


async def _wait_for_disconnect(request: Request) -> None:
    # with_cancellation: the body is already read, so the next message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _info_routes(server: VllmServer) -> APIRouter:
    router = APIRouter()
    cfg = server.config
    created = int(time.time())

    @router.get("/health")
    async def health() -> Response:
        # AsyncLLM.check_health only asks whether the engine process died; no probe request.
        return Response(status_code=200)

    @router.get("/version")
    async def version() -> dict[str, Any]:
        return {"version": VLLM_VERSION}

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        permission = {
            "id": f"modelperm-{uuid.uuid4().hex}",
            "object": "model_permission",
            "created": created,
            "allow_create_engine": False,
            "allow_sampling": True,
            "allow_logprobs": True,
            "allow_search_indices": False,
            "allow_view": True,
            "allow_fine_tuning": False,
            "organization": "*",
            "group": None,
            "is_blocking": False,
        }
        card = {
            "id": cfg.served_model_name,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": cfg.served_model_name,
            "parent": None,
            "max_model_len": cfg.context_len,
            "permission": [permission],
        }
        return {"object": "list", "data": [card]}

    return router
