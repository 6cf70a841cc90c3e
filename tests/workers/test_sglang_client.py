"""SGLangClient over httpx.MockTransport.

Reply and error bodies are transcribed from shared/reference/sglang-contract.md (sections 2 and 3).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from datagen.errors import (
    BadRequestError,
    ConfigError,
    DuplicateRequestError,
    FatalError,
    GenerationAbortedError,
    RequestTimeoutError,
    RetryableError,
    ServerError,
    ServerUnavailableError,
)
from datagen.states import FinishType
from workers.engines.base import Finish, GenerateResult
from workers.engines.http import ClientTimeouts, _split
from workers.engines.sglang import SGLangClient
from workers.engines.sglang_replies import parse_finish, parse_generate_response

Handler = Callable[[httpx.Request], httpx.Response]

SERVER_NAME = "gpu-0"
BASE_URL = "http://sglang-0:30000"
API_KEY = "sk-test-key"
RID = "job-1:prompt-7:attempt-0"
PROMPT_IDS = [151644, 872, 198, 3838, 374, 279, 6722, 315, 9625, 30, 151645, 198, 151644, 77091, 198]
SAMPLING = {"max_new_tokens": 64, "temperature": 0.0}

# -- 200 bodies (contract section 2 and the abort rows of section 3) -------------------------------

STOP_TOKEN_BODY: dict[str, Any] = {
    "text": "Paris.",
    "output_ids": [59604, 13, 151645],
    "meta_info": {
        "id": RID,
        "finish_reason": {"type": "stop", "matched": 151645},
        "prompt_tokens": 15,
        "completion_tokens": 3,
        "cached_tokens": 0,
        "cached_tokens_details": None,
        "reasoning_tokens": 0,
        "weight_version": "default",
        "num_retractions": 0,
        "e2e_latency": 0.412,
        "response_sent_to_client_ts": 1784563200.25,
    },
}

# An older server: "total_retractions" instead of "num_retractions"; text trimmed, output_ids not.
STOP_STRING_BODY: dict[str, Any] = {
    "text": "The capital of France is Paris.",
    "output_ids": [785, 6722, 315, 9625, 374, 12095, 13, 271],
    "meta_info": {
        "id": RID,
        "finish_reason": {"type": "stop", "matched": "\n\n"},
        "prompt_tokens": 15,
        "completion_tokens": 8,
        "cached_tokens": 12,
        "weight_version": "default",
        "total_retractions": 1,
        "e2e_latency": 0.9,
    },
}

# --skip-tokenizer-init: no "text" key.
LENGTH_BODY: dict[str, Any] = {
    "output_ids": [785, 6722, 315, 9625, 374, 12095, 13, 576],
    "meta_info": {
        "id": RID,
        "finish_reason": {"type": "length", "length": 8},
        "prompt_tokens": 15,
        "completion_tokens": 8,
        "cached_tokens": 15,
        "weight_version": "default",
        "num_retractions": 2,
        "e2e_latency": 1.5,
    },
}

ABORT_RUNNING_BODY: dict[str, Any] = {
    "text": "The capital",
    "output_ids": [785, 6722],
    "meta_info": {
        "id": RID,
        "finish_reason": {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None},
        "prompt_tokens": 15,
        "completion_tokens": 2,
        "cached_tokens": 0,
        "weight_version": "default",
        "num_retractions": 0,
        "e2e_latency": 2.0,
    },
}

# Aborted while waiting: no prompt_tokens, no cached_tokens.
ABORT_WAITING_BODY: dict[str, Any] = {
    "text": "",
    "output_ids": [],
    "meta_info": {
        "id": RID,
        "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
        "weight_version": "default",
        "e2e_latency": 3.07,
        "completion_tokens": 0,
    },
}


def with_finish(body: dict[str, Any], finish: dict[str, Any]) -> dict[str, Any]:
    return {**body, "meta_info": {**body["meta_info"], "finish_reason": finish}}


ABORT_OOM_BODY = with_finish(
    ABORT_RUNNING_BODY,
    {
        "type": "abort",
        "message": "Out of memory even after retracting…",
        "status_code": 500,
        "err_type": None,
    },
)
MAX_REQ_INPUT_MESSAGE = (
    "Input length (40000 tokens) exceeds the maximum allowed length (32757 tokens). "
    "Use a shorter input or enable --allow-auto-truncate."
)
ABORT_VALIDATION_BODY = with_finish(
    ABORT_WAITING_BODY,
    {"type": "abort", "message": MAX_REQ_INPUT_MESSAGE, "status_code": 400, "err_type": "BadRequestError"},
)

# -- error bodies (contract section 3) -------------------------------------------------------------

CONTEXT_MESSAGE = "The input (40000 tokens) is longer than the model's context length (32768 tokens)."
CONTEXT_TOO_LONG_400 = {"error": {"message": CONTEXT_MESSAGE}}
PYDANTIC_MESSAGE = (
    "1 validation error for GenerateReqInput\ninput_ids\n  Value error, expected int64 integers "
    "[type=value_error, input_value=[1.5, 2.0], input_type=list]"
)
PYDANTIC_400 = {
    "object": "error",
    "message": PYDANTIC_MESSAGE,
    "type": "Bad Request",
    "param": None,
    "code": 400,
}
DUPLICATE_400 = {"error": {"message": f"Duplicate request ID detected: {RID}"}}
QUEUE_FULL_503 = {
    "object": "error",
    "message": "The request queue is full.",
    "type": "503",
    "param": None,
    "code": 503,
}
OOM_500 = {
    "object": "error",
    "message": "Out of memory even after retracting…",
    "type": "500",
    "param": None,
    "code": 500,
}

MODEL_INFO = {
    "model_path": "Qwen/Qwen3-8B",
    "tokenizer_path": "Qwen/Qwen3-8B",
    "is_generation": True,
    "preferred_sampling_params": None,
    "weight_version": "default",
    "has_image_understanding": False,
    "has_audio_understanding": False,
    "model_type": "qwen3",
    "architectures": ["Qwen3ForCausalLM"],
}
OLD_MODEL_INFO = {
    "model_path": "Qwen/Qwen3-8B",
    "tokenizer_path": "Qwen/Qwen3-8B",
    "is_generation": True,
    "preferred_sampling_params": None,
}
SERVER_INFO = {
    "model_path": "Qwen/Qwen3-8B",
    "context_length": None,
    "skip_tokenizer_init": False,
    "status": "ready",
    "max_total_num_tokens": 500000,
    "max_req_input_len": 40954,
    "internal_states": [{"last_gen_throughput": 0.0, "effective_max_running_requests_per_dp": 256}],
    "version": "0.5.15",
}
V1_MODELS = {
    "object": "list",
    "data": [
        {
            "id": "Qwen/Qwen3-8B",
            "object": "model",
            "created": 1784563200,
            "owned_by": "sglang",
            "root": "Qwen/Qwen3-8B",
            "parent": None,
            "max_model_len": 40960,
        }
    ],
}
NOT_FOUND = {"detail": "Not Found"}


# -- helpers ---------------------------------------------------------------------------------------


def make_client(
    handler: Handler, *, api_key: str | None = None, transport: httpx.AsyncBaseTransport | None = None
) -> SGLangClient:
    return SGLangClient(
        SERVER_NAME,
        BASE_URL,
        timeouts=ClientTimeouts(),
        max_connections=4,
        api_key=api_key,
        transport=transport or httpx.MockTransport(handler),
    )


def answer(status: int, body: object) -> Handler:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, json=body)

    return handler


def routes(table: dict[str, httpx.Response], seen: list[str]) -> Handler:
    """Answer by path from ``table``, 404 for anything else, and record the paths asked."""

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        return table.get(request.url.path, httpx.Response(404, json=NOT_FOUND))

    return handler


def raising(exc_type: type[httpx.TransportError], message: str) -> Handler:
    def handler(request: httpx.Request) -> httpx.Response:
        raise exc_type(message, request=request)

    return handler


async def generate_with(handler: Handler, **kwargs: Any) -> GenerateResult:
    async with make_client(handler, **kwargs) as client:
        return await client.generate(PROMPT_IDS, SAMPLING, rid=RID)


# -- Finish ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ({"type": "stop", "matched": 151645}, Finish(FinishType.STOP, matched=151645)),
        ({"type": "stop", "matched": "\n\n"}, Finish(FinishType.STOP, matched="\n\n")),
        ({"type": "stop", "matched": "NaN happened"}, Finish(FinishType.STOP, matched="NaN happened")),
        ({"type": "stop", "matched": [151645]}, Finish(FinishType.STOP, matched=151645)),
        ({"type": "stop", "matched": [151645, 151643]}, Finish(FinishType.STOP, matched=151645)),
        ({"type": "length", "length": 8}, Finish(FinishType.LENGTH, length=8)),
        (
            {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None},
            Finish(FinishType.ABORT, message="Aborted"),
        ),
        (
            {"type": "abort", "message": "Abort in waiting queue"},
            Finish(FinishType.ABORT, message="Abort in waiting queue"),
        ),
        (
            {
                "type": "abort",
                "message": MAX_REQ_INPUT_MESSAGE,
                "status_code": 400,
                "err_type": "BadRequestError",
            },
            Finish(
                FinishType.ABORT, message=MAX_REQ_INPUT_MESSAGE, status_code=400, err_type="BadRequestError"
            ),
        ),
        (
            {"type": "abort", "message": "The request queue is full.", "status_code": 503},
            Finish(FinishType.ABORT, message="The request queue is full.", status_code=503),
        ),
    ],
)
def test_finish_parses_every_shape_of_the_contract(raw: object, expected: Finish) -> None:
    assert parse_finish(raw) == expected


@pytest.mark.parametrize(
    "raw",
    [
        {"type": "stop", "matched": 151645},
        {"type": "stop", "matched": "\n\n"},
        {"type": "length", "length": 8},
        {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None},
        {
            "type": "abort",
            "message": MAX_REQ_INPUT_MESSAGE,
            "status_code": 400,
            "err_type": "BadRequestError",
        },
    ],
)
def test_finish_to_json_gives_back_the_sglang_shape(raw: dict[str, object]) -> None:
    assert parse_finish(raw).to_json() == raw


def test_finish_to_json_of_a_waiting_queue_abort_has_the_full_abort_shape() -> None:
    finish = parse_finish({"type": "abort", "message": "Abort in waiting queue"})
    assert finish.to_json() == {
        "type": "abort",
        "message": "Abort in waiting queue",
        "status_code": None,
        "err_type": None,
    }


@pytest.mark.parametrize(
    "raw",
    [
        None,  # a streaming chunk before the last one
        "stop",
        [{"type": "stop", "matched": 2}],
        {},
        {"type": None},
        {"type": "finished"},
        {"type": "stop"},
        {"type": "stop", "matched": None},
        {"type": "stop", "matched": True},
        {"type": "stop", "matched": []},
        {"type": "stop", "matched": [2, "x"]},
        {"type": "stop", "matched": 1.5},
        {"type": "length"},
        {"type": "length", "length": "8"},
        {"type": "length", "matched": 8},
        {"type": "abort", "message": 7},
        {"type": "abort", "message": "queue full", "status_code": "503"},
    ],
)
def test_finish_rejects_anything_else(raw: object) -> None:
    with pytest.raises(ServerError):
        parse_finish(raw)


# -- parse_generate_response -----------------------------------------------------------------------


def test_parse_stop_on_token() -> None:
    result = parse_generate_response(STOP_TOKEN_BODY, rid=RID)
    assert result == GenerateResult(
        rid=RID,
        output_ids=[59604, 13, 151645],
        finish=Finish(FinishType.STOP, matched=151645),
        prompt_tokens=15,
        completion_tokens=3,
        cached_tokens=0,
        e2e_latency_s=0.412,
        num_retractions=0,
        weight_version="default",
    )


def test_parse_stop_on_string_reads_the_old_retraction_key() -> None:
    result = parse_generate_response(STOP_STRING_BODY, rid=RID)
    assert result.finish == Finish(FinishType.STOP, matched="\n\n")
    assert result.output_ids == [785, 6722, 315, 9625, 374, 12095, 13, 271]
    assert result.num_retractions == 1
    assert result.cached_tokens == 12


def test_parse_length_without_text_key() -> None:
    result = parse_generate_response(LENGTH_BODY, rid=RID)
    assert result.finish == Finish(FinishType.LENGTH, length=8)
    assert len(result.output_ids) == 8
    assert result.num_retractions == 2


def test_parse_returns_a_running_abort_with_its_partial_output() -> None:
    result = parse_generate_response(ABORT_RUNNING_BODY, rid=RID)
    assert result.finish == Finish(FinishType.ABORT, message="Aborted")
    assert result.output_ids == [785, 6722]


def test_parse_waiting_queue_abort_has_no_prompt_or_cached_tokens() -> None:
    result = parse_generate_response(ABORT_WAITING_BODY, rid=RID)
    assert result.finish == Finish(FinishType.ABORT, message="Abort in waiting queue")
    assert result.prompt_tokens is None
    assert result.cached_tokens == 0
    assert result.num_retractions == 0
    assert result.output_ids == []
    assert result.e2e_latency_s == 3.07


def test_parse_optional_meta_keys_may_be_absent() -> None:
    meta = {"id": RID, "finish_reason": {"type": "stop", "matched": 151645}, "completion_tokens": 3}
    result = parse_generate_response({"output_ids": [59604, 13, 151645], "meta_info": meta}, rid=RID)
    assert (result.prompt_tokens, result.cached_tokens, result.e2e_latency_s) == (None, 0, None)
    assert (result.num_retractions, result.weight_version) == (0, None)


def test_parse_missing_output_ids_says_to_upgrade_or_skip_tokenizer_init() -> None:
    old_server_body = {"text": "Paris.", "meta_info": STOP_TOKEN_BODY["meta_info"]}
    with pytest.raises(ServerError, match=r"0\.5.*--skip-tokenizer-init"):
        parse_generate_response(old_server_body, rid=RID)


@pytest.mark.parametrize(
    "body",
    [
        [STOP_TOKEN_BODY, STOP_TOKEN_BODY],  # a list answers a batch or n > 1, never one prompt
        "Paris.",
        None,
        {**STOP_TOKEN_BODY, "output_ids": [59604, "13"]},
        {**STOP_TOKEN_BODY, "output_ids": [59604, True]},
        {**STOP_TOKEN_BODY, "output_ids": "59604"},
        {"text": "Paris.", "output_ids": [59604]},
        with_finish(STOP_TOKEN_BODY, None),  # type: ignore[arg-type]
        {**STOP_TOKEN_BODY, "meta_info": {**STOP_TOKEN_BODY["meta_info"], "completion_tokens": None}},
        {**STOP_TOKEN_BODY, "meta_info": {**STOP_TOKEN_BODY["meta_info"], "prompt_tokens": "15"}},
        {**STOP_TOKEN_BODY, "meta_info": {**STOP_TOKEN_BODY["meta_info"], "e2e_latency": "fast"}},
    ],
)
def test_parse_rejects_unusable_bodies(body: object) -> None:
    with pytest.raises(ServerError):
        parse_generate_response(body, rid=RID)


def test_parse_warns_but_keeps_going_when_the_rid_differs(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="workers.engines.sglang"):
        result = parse_generate_response(STOP_TOKEN_BODY, rid="another-rid")
    assert result.rid == "another-rid"
    assert [record.levelno for record in caplog.records] == [logging.WARNING]
    assert "another-rid" in caplog.text


def test_parse_notes_a_completion_token_mismatch_only_in_debug(caplog: pytest.LogCaptureFixture) -> None:
    body = {**ABORT_WAITING_BODY, "output_ids": [785, 6722]}  # completion_tokens says 0
    with caplog.at_level(logging.DEBUG, logger="workers.engines.sglang_replies"):
        result = parse_generate_response(body, rid=RID)
    assert result.completion_tokens == 0
    assert {record.levelno for record in caplog.records} == {logging.DEBUG}


# -- generate: the request -------------------------------------------------------------------------


async def test_generate_sends_only_rid_input_ids_sampling_params_and_stream_false() -> None:
    sent: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(200, json=STOP_TOKEN_BODY)

    result = await generate_with(handler, api_key=API_KEY)

    assert result.output_ids == [59604, 13, 151645]
    [request] = sent
    assert request.method == "POST"
    assert str(request.url) == f"{BASE_URL}/generate"
    body = json.loads(request.content)
    assert body == {"rid": RID, "input_ids": PROMPT_IDS, "sampling_params": SAMPLING, "stream": False}
    assert list(body) == ["rid", "input_ids", "sampling_params", "stream"]
    assert request.headers["Authorization"] == f"Bearer {API_KEY}"
    assert request.headers["Content-Type"] == "application/json"


async def test_generate_without_api_key_sends_no_authorization_header() -> None:
    sent: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(200, json=STOP_TOKEN_BODY)

    await generate_with(handler)
    assert "Authorization" not in sent[0].headers


async def test_generate_uses_the_configured_timeouts_and_a_per_call_read_timeout() -> None:
    sent: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(200, json=STOP_TOKEN_BODY)

    timeouts = ClientTimeouts(connect_s=3.0, read_s=900.0, write_s=20.0, pool_s=900.0)
    client = SGLangClient(
        SERVER_NAME, BASE_URL, timeouts=timeouts, max_connections=2, transport=httpx.MockTransport(handler)
    )
    async with client:
        await client.generate(PROMPT_IDS, SAMPLING, rid=RID)
        await client.generate(PROMPT_IDS, SAMPLING, rid=RID, read_timeout_s=42.0)

    assert sent[0].extensions["timeout"] == {"connect": 3.0, "read": 900.0, "write": 20.0, "pool": 900.0}
    assert sent[1].extensions["timeout"] == {"connect": 3.0, "read": 42.0, "write": 20.0, "pool": 900.0}


# -- generate: replies -----------------------------------------------------------------------------


@pytest.mark.parametrize("body", [STOP_TOKEN_BODY, STOP_STRING_BODY, LENGTH_BODY])
async def test_generate_returns_finished_results(body: dict[str, Any]) -> None:
    result = await generate_with(answer(200, body))
    assert result == parse_generate_response(body, rid=RID)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (ABORT_RUNNING_BODY, GenerationAbortedError),  # /abort_request or a disconnect while running
        (ABORT_WAITING_BODY, GenerationAbortedError),
        (ABORT_OOM_BODY, GenerationAbortedError),  # out of memory after retracting everything
        (ABORT_VALIDATION_BODY, BadRequestError),  # scheduler-side validation
    ],
)
async def test_generate_raises_on_abort_finish(body: dict[str, Any], expected: type[Exception]) -> None:
    with pytest.raises(expected) as caught:
        await generate_with(answer(200, body))
    message = body["meta_info"]["finish_reason"]["message"]
    assert message in str(caught.value)
    assert SERVER_NAME in str(caught.value)


@pytest.mark.parametrize(
    ("response", "expected", "text"),
    [
        (httpx.Response(400, json=CONTEXT_TOO_LONG_400), BadRequestError, CONTEXT_MESSAGE),
        (httpx.Response(400, json=PYDANTIC_400), BadRequestError, PYDANTIC_MESSAGE),
        (
            httpx.Response(400, json=DUPLICATE_400),
            DuplicateRequestError,
            f"Duplicate request ID detected: {RID}",
        ),
        (httpx.Response(503, json=QUEUE_FULL_503), ServerUnavailableError, "The request queue is full."),
        (httpx.Response(503), ServerUnavailableError, "503"),
        (httpx.Response(500, text="Internal Server Error"), ServerError, "Internal Server Error"),
        (httpx.Response(500, json=OOM_500), ServerError, "Out of memory even after retracting"),
        (httpx.Response(502, text="<html>Bad Gateway</html>"), ServerError, "Bad Gateway"),
        (httpx.Response(401, json={"error": "Unauthorized"}), ConfigError, "API key"),
        (httpx.Response(403, json={"error": "Forbidden"}), ConfigError, "API key"),
        (httpx.Response(404, json=NOT_FOUND), ServerError, "not an SGLang server"),
        (httpx.Response(422, json={"detail": "unprocessable"}), BadRequestError, "unprocessable"),
        (httpx.Response(429, text="slow down"), ServerUnavailableError, "slow down"),
        (httpx.Response(408, text="Request Timeout"), RequestTimeoutError, "Request Timeout"),
        (httpx.Response(307, headers={"Location": "/elsewhere"}), ServerError, "307"),
    ],
)
async def test_generate_translates_http_errors(
    response: httpx.Response, expected: type[Exception], text: str
) -> None:
    with pytest.raises(expected) as caught:
        await generate_with(lambda request: response)
    assert type(caught.value) is expected
    assert text in str(caught.value)
    assert SERVER_NAME in str(caught.value)


async def test_bad_request_carries_the_server_message_verbatim_and_is_fatal() -> None:
    with pytest.raises(BadRequestError) as caught:
        await generate_with(answer(400, CONTEXT_TOO_LONG_400))
    assert isinstance(caught.value, FatalError)
    assert CONTEXT_MESSAGE in str(caught.value)


async def test_missing_api_key_is_fatal_not_retryable() -> None:
    with pytest.raises(FatalError):
        await generate_with(answer(401, {"error": "Unauthorized"}))


@pytest.mark.parametrize(
    ("response", "text"),
    [
        (
            httpx.Response(200, content=b'{"text": "Par', headers={"Content-Type": "application/json"}),
            "not JSON",
        ),
        (httpx.Response(200, content=b""), "not JSON"),
        (httpx.Response(200, json=[STOP_TOKEN_BODY, STOP_TOKEN_BODY]), "list"),
        (
            httpx.Response(200, json={"text": "Paris.", "meta_info": STOP_TOKEN_BODY["meta_info"]}),
            "--skip-tokenizer-init",
        ),
        (httpx.Response(200, json=with_finish(STOP_TOKEN_BODY, None)), "null"),  # type: ignore[arg-type]
        (httpx.Response(200, json={"error": {"message": "boom"}}), "boom"),
    ],
)
async def test_generate_rejects_unusable_200_replies(response: httpx.Response, text: str) -> None:
    with pytest.raises(ServerError) as caught:
        await generate_with(lambda request: response)
    assert text in str(caught.value)
    assert SERVER_NAME in str(caught.value)


# -- generate: transport failures ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("exc_type", "message", "expected"),
    [
        (httpx.ConnectError, "[Errno 111] Connection refused", ServerUnavailableError),
        (
            httpx.RemoteProtocolError,
            "Server disconnected without sending a response.",
            ServerUnavailableError,
        ),
        (httpx.ReadError, "[Errno 104] Connection reset by peer", ServerUnavailableError),
        (httpx.WriteError, "[Errno 32] Broken pipe", ServerUnavailableError),
        (httpx.ReadTimeout, "timed out", RequestTimeoutError),
        (httpx.ConnectTimeout, "timed out", RequestTimeoutError),
        (httpx.WriteTimeout, "timed out", RequestTimeoutError),
        (httpx.PoolTimeout, "timed out", RequestTimeoutError),
    ],
)
async def test_generate_translates_transport_errors(
    exc_type: type[httpx.TransportError], message: str, expected: type[RetryableError]
) -> None:
    with pytest.raises(expected) as caught:
        await generate_with(raising(exc_type, message))
    assert type(caught.value) is expected
    assert isinstance(caught.value.__cause__, exc_type)
    assert SERVER_NAME in str(caught.value)


async def test_generate_translates_an_undecodable_body() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.DecodingError("Error -3 while decompressing data", request=request)

    with pytest.raises(ServerError, match="DecodingError"):
        await generate_with(handler)


async def test_unavailable_server_is_a_server_fault() -> None:
    with pytest.raises(ServerUnavailableError) as caught:
        await generate_with(raising(httpx.ConnectError, "[Errno 111] Connection refused"))
    assert caught.value.server_fault


# -- health ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("status", "healthy"), [(200, True), (503, False)])
async def test_health_is_true_only_on_200(status: int, healthy: bool) -> None:
    sent: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(status)  # both with an empty body, as SGLang sends them

    async with make_client(handler) as client:
        assert await client.health(timeout_s=5.0) is healthy
    assert sent[0].method == "GET"
    assert sent[0].url.path == "/health"
    assert sent[0].extensions["timeout"] == {"connect": 5.0, "read": 5.0, "write": 5.0, "pool": 5.0}


async def test_health_timeout_raises_request_timeout() -> None:
    async with make_client(raising(httpx.ReadTimeout, "timed out")) as client:
        with pytest.raises(RequestTimeoutError):
            await client.health(timeout_s=5.0)


async def test_health_on_a_closed_port_raises_server_unavailable() -> None:
    async with make_client(raising(httpx.ConnectError, "[Errno 111] Connection refused")) as client:
        with pytest.raises(ServerUnavailableError):
            await client.health(timeout_s=5.0)


# -- model_info, server_info, context_len, metrics -------------------------------------------------


async def test_model_info_on_a_current_server_asks_once() -> None:
    seen: list[str] = []
    async with make_client(routes({"/model_info": httpx.Response(200, json=MODEL_INFO)}, seen)) as client:
        assert await client.model_info() == MODEL_INFO
    assert seen == ["/model_info"]


async def test_model_info_falls_back_to_get_model_info_on_404() -> None:
    seen: list[str] = []
    async with make_client(
        routes({"/get_model_info": httpx.Response(200, json=OLD_MODEL_INFO)}, seen)
    ) as client:
        assert await client.model_info() == OLD_MODEL_INFO
    assert seen == ["/model_info", "/get_model_info"]


async def test_model_info_when_neither_path_exists_is_a_server_error() -> None:
    seen: list[str] = []
    async with make_client(routes({}, seen)) as client:
        with pytest.raises(ServerError, match="not an SGLang server"):
            await client.model_info()
    assert seen == ["/model_info", "/get_model_info"]


async def test_model_info_that_is_not_an_object_is_a_server_error() -> None:
    async with make_client(answer(200, ["Qwen/Qwen3-8B"])) as client:
        with pytest.raises(ServerError):
            await client.model_info()


async def test_server_info_falls_back_to_get_server_info_on_404() -> None:
    seen: list[str] = []
    async with make_client(
        routes({"/get_server_info": httpx.Response(200, json=SERVER_INFO)}, seen)
    ) as client:
        assert await client.server_info() == SERVER_INFO
    assert seen == ["/server_info", "/get_server_info"]


async def test_context_len_from_server_info_when_configured() -> None:
    seen: list[str] = []
    table = {"/server_info": httpx.Response(200, json={**SERVER_INFO, "context_length": 32768})}
    async with make_client(routes(table, seen)) as client:
        assert await client.context_len() == 32768
    assert seen == ["/server_info"]


async def test_context_len_from_v1_models_when_server_info_has_none() -> None:
    seen: list[str] = []
    table = {
        "/server_info": httpx.Response(200, json=SERVER_INFO),
        "/v1/models": httpx.Response(200, json=V1_MODELS),
    }
    async with make_client(routes(table, seen)) as client:
        assert await client.context_len() == 40960
    assert seen == ["/server_info", "/v1/models"]


async def test_context_len_is_none_when_no_endpoint_says() -> None:
    table = {
        "/server_info": httpx.Response(200, json=SERVER_INFO),
        "/v1/models": httpx.Response(200, json={"object": "list", "data": []}),
    }
    async with make_client(routes(table, [])) as client:
        assert await client.context_len() is None


async def test_metrics_text() -> None:
    text = '# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs{model_name="Qwen/Qwen3-8B"} 3.0\n'
    async with make_client(routes({"/metrics": httpx.Response(200, text=text)}, [])) as client:
        assert await client.metrics_text() == text


async def test_metrics_500_is_a_server_error() -> None:
    async with make_client(answer(500, OOM_500)) as client:
        with pytest.raises(ServerError, match="Out of memory"):
            await client.metrics_text()


async def test_metrics_404_says_to_enable_metrics() -> None:
    async with make_client(routes({}, [])) as client:
        with pytest.raises(ServerError, match="--enable-metrics"):
            await client.metrics_text()


async def test_control_endpoints_send_the_api_key() -> None:
    sent: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(200, json=MODEL_INFO)

    async with make_client(handler, api_key=API_KEY) as client:
        await client.model_info()
    assert sent[0].headers["Authorization"] == f"Bearer {API_KEY}"


# -- lifecycle -------------------------------------------------------------------------------------


class CountingTransport(httpx.MockTransport):
    def __init__(self, handler: Handler) -> None:
        super().__init__(handler)
        self.closed = 0

    async def aclose(self) -> None:
        self.closed += 1


async def test_one_async_client_is_reused_across_calls_and_closed_once() -> None:
    transport = CountingTransport(answer(200, STOP_TOKEN_BODY))
    client = make_client(answer(200, STOP_TOKEN_BODY), transport=transport)
    await client.start()
    opened = list(client._pools)
    assert len(opened) == 1

    for attempt in range(3):
        await client.generate(PROMPT_IDS, SAMPLING, rid=f"{RID}-{attempt}")
    await client.health(timeout_s=1.0)

    assert client._pools == opened
    control = client._control_http  # /health went to the small control pool, not the /generate one
    assert control is not None and control not in opened
    await client.health(timeout_s=1.0)
    assert client._control_http is control
    assert transport.closed == 0
    await client.aclose()
    assert transport.closed == 2  # each pool closed once (the test shares one transport)
    await client.aclose()  # closing twice is harmless
    assert transport.closed == 2


async def test_first_call_opens_the_client_without_start() -> None:
    client = make_client(answer(200, STOP_TOKEN_BODY))
    try:
        result = await client.generate(PROMPT_IDS, SAMPLING, rid=RID)
    finally:
        await client.aclose()
    assert result.finish.type is FinishType.STOP


async def test_a_closed_client_cannot_be_used() -> None:
    client = make_client(answer(200, STOP_TOKEN_BODY))
    async with client:
        pass
    with pytest.raises(RuntimeError, match="closed"):
        await client.generate(PROMPT_IDS, SAMPLING, rid=RID)


async def test_base_url_path_prefix_is_kept() -> None:
    sent: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(200, json=STOP_TOKEN_BODY)

    client = SGLangClient(
        SERVER_NAME,
        "http://router:8000/sglang-0/",
        timeouts=ClientTimeouts(),
        max_connections=1,
        transport=httpx.MockTransport(handler),
    )
    async with client:
        await client.generate(PROMPT_IDS, SAMPLING, rid=RID)
    assert str(sent[0].url) == "http://router:8000/sglang-0/generate"


@pytest.mark.parametrize(
    "base_url", ["sglang-0:30000", "ftp://sglang-0", "http://", "not a url", "http://[::1"]
)
def test_bad_base_url_is_a_config_error(base_url: str) -> None:
    with pytest.raises(ConfigError):
        SGLangClient(SERVER_NAME, base_url, timeouts=ClientTimeouts(), max_connections=1)


def test_max_connections_must_be_positive() -> None:
    with pytest.raises(ConfigError):
        SGLangClient(SERVER_NAME, BASE_URL, timeouts=ClientTimeouts(), max_connections=0)


def test_generate_connections_are_split_into_pools_of_at_most_32() -> None:
    assert _split(1, 32) == [1]
    assert _split(32, 32) == [32]
    assert _split(64, 32) == [32, 32]
    assert _split(65, 32) == [22, 22, 21]
    assert _split(100, 32) == [25, 25, 25, 25]


class HeldRequests:
    """A client whose ``/generate`` requests stay open until :attr:`release` is set, to look at the
    pools while they wait."""

    def __init__(self, max_connections: int) -> None:
        self.release = asyncio.Event()
        self.entered = 0
        self.client = SGLangClient(
            SERVER_NAME,
            BASE_URL,
            timeouts=ClientTimeouts(),
            max_connections=max_connections,
            transport=httpx.MockTransport(self._handler),
        )

    async def _handler(self, request: httpx.Request) -> httpx.Response:
        self.entered += 1
        await self.release.wait()
        return httpx.Response(200, json=STOP_TOKEN_BODY)

    async def open(self, n: int) -> list[asyncio.Task[GenerateResult]]:
        """Start ``n`` requests and return once all of them reached the server."""
        started = self.entered
        calls = [
            asyncio.create_task(self.client.generate(PROMPT_IDS, SAMPLING, rid=f"{RID}-{started + i}"))
            for i in range(n)
        ]
        while self.entered < started + n:
            await asyncio.sleep(0.01)
        return calls


async def test_a_pool_is_opened_only_when_the_open_ones_are_full() -> None:
    held = HeldRequests(512)
    client = held.client
    try:
        await client.start()
        assert len(client._pools) == 1  # of the 16 pools of 32, one is open
        calls = await held.open(33)
        assert client._pool_open[:2] == [32, 1]
        assert len(client._pools) == 2
        held.release.set()
        await asyncio.gather(*calls)
        assert sum(client._pool_open) == 0
        await client.generate(PROMPT_IDS, SAMPLING, rid=f"{RID}-after")
        assert len(client._pools) == 2  # free connections in the open pools: nothing new opened
    finally:
        await client.aclose()


async def test_requests_in_flight_fill_every_generate_pool_to_its_size() -> None:
    held = HeldRequests(70)
    client = held.client
    try:
        calls = await held.open(70)
        # 70 connections are 3 pools of 24, 23 and 23, each opened once the open ones were full:
        # with 70 requests open each pool is exactly full.
        assert client._pool_sizes == [24, 23, 23]
        assert client._pool_open == [24, 23, 23]
        assert len(client._pools) == 3
        held.release.set()
        results = await asyncio.gather(*calls)
        assert len(results) == 70
        assert client._pool_open == [0, 0, 0]
    finally:
        await client.aclose()
