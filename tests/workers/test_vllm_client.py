"""VllmClient over httpx.MockTransport: the ``/v1/completions`` body it sends, how it reads
replies (finish rules, vLLM's silent lowering of ``max_tokens``), errors, facts and metrics.
Replies are shaped as ``docs/reference/vllm-contract.md`` describes vLLM 0.33.0's."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from datagen.errors import (
    BadRequestError,
    ConfigError,
    GenerationAbortedError,
    RequestTimeoutError,
    RetryableError,
    ServerError,
    ServerUnavailableError,
)
from datagen.states import FinishType, PromptClass
from workers.engines.base import ToolCallParsing
from workers.engines.http import ClientTimeouts
from workers.engines.vllm import VllmClient, vllm_request
from workers.fleet.servers import Server
from workers.run.conversation import tool_call_parsing

BASE_URL = "http://vllm:8000"
RID = "eng-j-abc-t0-g0.a1.tag"
EOS = 1
PARAMS: dict[str, Any] = {
    "temperature": 0.6,
    "top_p": 0.95,
    "top_k": -1,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "sampling_seed": 3,
    "stop_token_ids": [1],
    "max_new_tokens": 4,
}
Handler = Callable[[httpx.Request], httpx.Response]


def completion(
    token_ids: list[int] | None, finish: str, stop_reason: int | str | None = None
) -> dict[str, Any]:
    return {
        "id": f"cmpl-{RID}",
        "object": "text_completion",
        "created": 1796197764,
        "model": "sim/deepseek-r1",
        "choices": [
            {
                "index": 0,
                "text": "...",
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": stop_reason,
                "token_ids": token_ids,
                "prompt_logprobs": None,
                "prompt_token_ids": [5, 6, 7],
            }
        ],
        "usage": {
            "prompt_tokens": 3,
            "total_tokens": 7,
            "completion_tokens": 4,
            "prompt_tokens_details": None,
        },
    }


def client_for(handler: Handler) -> VllmClient:
    return VllmClient(
        "v", BASE_URL, timeouts=ClientTimeouts(), max_connections=2, transport=httpx.MockTransport(handler)
    )


def answering(status: int, body: object) -> Handler:
    return lambda request: httpx.Response(status, json=body)


async def generate(handler: Handler, params: dict[str, Any] | None = None) -> Any:
    async with client_for(handler) as client:
        return await client.generate([5, 6, 7], params or PARAMS, rid=RID)


# -- the request -----------------------------------------------------------------------------------


async def test_the_request_sends_token_ids_and_every_sampling_field_explicitly() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=completion([9, 8, 7, 6], "length"))

    await generate(handler)
    [request] = seen
    assert (request.method, request.url.path) == ("POST", "/v1/completions")
    assert json.loads(request.content) == {
        "prompt": [5, 6, 7],
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": -1,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "seed": 3,
        "max_tokens": 4,
        "stop_token_ids": [1],
        "n": 1,
        "return_token_ids": True,
        "skip_special_tokens": False,
        "ignore_eos": False,
        "stream": False,
        "request_id": RID,
    }


def test_an_unset_seed_is_sent_as_null_and_the_served_model_by_name() -> None:
    params = {k: v for k, v in PARAMS.items() if k not in ("sampling_seed", "stop_token_ids")}
    body = vllm_request([5], params, rid=RID, model="sim/deepseek-r1")
    assert (body["seed"], body["stop_token_ids"], body["model"]) == (None, [], "sim/deepseek-r1")


def test_a_sampling_field_vllm_has_no_name_for_is_refused() -> None:
    with pytest.raises(BadRequestError, match="frequency_penalty have no vLLM equivalent"):
        vllm_request([5], {**PARAMS, "frequency_penalty": 0.5}, rid=RID, model=None)
    with pytest.raises(BadRequestError, match="max_new_tokens must be set"):
        vllm_request([5], {"temperature": 0.6}, rid=RID, model=None)


# -- finishes --------------------------------------------------------------------------------------


async def test_an_eos_exactly_at_the_cap_is_a_stop_on_the_eos() -> None:
    # vLLM checks the EOS before the length cap: the 4th of 4 tokens is the EOS, stop_reason null.
    result = await generate(answering(200, completion([9, 8, 7, EOS], "stop")))
    assert result.output_ids == [9, 8, 7, EOS]
    assert (result.finish.type, result.finish.matched, result.finish.length) == (FinishType.STOP, EOS, None)


async def test_a_stop_token_id_is_the_matched_id() -> None:
    result = await generate(answering(200, completion([9, 42], "stop", stop_reason=42)))
    assert (result.finish.type, result.finish.matched) == (FinishType.STOP, 42)


async def test_a_length_finish_at_max_tokens_is_length() -> None:
    result = await generate(answering(200, completion([9, 8, 7, 6], "length")))
    assert (result.finish.type, result.finish.length, result.completion_tokens) == (FinishType.LENGTH, 4, 4)
    assert (result.prompt_tokens, result.num_retractions, result.e2e_latency_s) == (3, 0, None)


async def test_a_length_finish_short_of_max_tokens_is_a_loud_server_error() -> None:
    # vLLM lowered max_tokens to what its context left: not the record the worker asked for.
    with pytest.raises(ServerError, match="after 2 tokens, but max_tokens was 4: the server lowered it"):
        await generate(answering(200, completion([9, 8], "length")))


async def test_an_abort_finish_is_retryable() -> None:
    with pytest.raises(GenerationAbortedError, match="aborted request"):
        await generate(answering(200, completion([9], "abort")))


async def test_a_reply_without_token_ids_says_to_upgrade() -> None:
    with pytest.raises(ServerError, match=r"before 0\.10\.2 ignores return_token_ids"):
        await generate(answering(200, completion(None, "stop")))


# -- errors ----------------------------------------------------------------------------------------

CONTEXT_400 = {
    "error": {
        "message": "This model's maximum context length is 256 tokens. However, your prompt contains "
        "400 input tokens, which exceeds this limit even without any output tokens. Please reduce "
        "the length of the input prompt.",
        "type": "BadRequestError",
        "param": "input_tokens",
        "code": 400,
    }
}


async def test_a_400_is_fatal_with_vllms_message() -> None:
    with pytest.raises(BadRequestError) as caught:
        await generate(answering(400, CONTEXT_400))
    message = str(caught.value)
    assert (
        "on vLLM server 'v' (http://vllm:8000) got HTTP 400: This model's maximum context length" in message
    )
    assert message.endswith("The request must change; retrying it cannot succeed")


@pytest.mark.parametrize(
    ("status", "error"),
    [(500, ServerError), (503, ServerUnavailableError), (429, ServerUnavailableError), (401, ConfigError)],
)
async def test_statuses_are_classified(status: int, error: type[Exception]) -> None:
    body = {"error": {"message": "boom", "type": "X", "param": None, "code": status}}
    with pytest.raises(error, match="boom"):
        await generate(answering(status, body))


async def test_refused_connections_and_timeouts_are_retryable() -> None:
    def refused(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    def slow(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("slow", request=request)

    with pytest.raises(ServerUnavailableError, match="could not reach vLLM server"):
        await generate(refused)
    with pytest.raises(RequestTimeoutError, match="on vLLM server 'v'"):
        await generate(slow)
    assert issubclass(ServerUnavailableError, RetryableError)


# -- facts and metrics -----------------------------------------------------------------------------

MODELS = {
    "object": "list",
    "data": [
        {
            "id": "r1",
            "object": "model",
            "created": 1,
            "owned_by": "vllm",
            "root": "/models/DeepSeek-R1",
            "parent": None,
            "max_model_len": 32768,
        }
    ],
}


async def test_facts_come_from_v1_models_and_the_served_name_is_sent_after() -> None:
    bodies: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json=MODELS)
        bodies.append(json.loads(request.content))
        return httpx.Response(200, json=completion([9, 8, 7, 6], "length"))

    async with client_for(handler) as client:
        facts = await client.facts()
        await client.generate([5], PARAMS, rid=RID)
    assert (facts.context_len, facts.model_path, facts.weight_version) == (32768, "/models/DeepSeek-R1", None)
    assert bodies[0]["model"] == "r1"


METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="r1"} 10.0
vllm:num_requests_running{engine="1",model_name="r1"} 6.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="r1"} 2.0
vllm:num_requests_waiting{engine="1",model_name="r1"} 1.0
# HELP vllm:num_requests_waiting_by_reason Requests waiting, by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="r1",reason="capacity"} 99.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="r1"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="r1"} 0.75
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="r1"} 3.0
vllm:num_preemptions_total{engine="1",model_name="r1"} 4.0
vllm:num_preemptions_created{engine="0",model_name="r1"} 1.7e+09
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="r1"} 100.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="r1"} 20.0
vllm:request_success_total{engine="1",finished_reason="stop",model_name="r1"} 5.0
"""


async def test_kv_signals_sum_vllms_gauges_over_engines() -> None:
    async with client_for(lambda request: httpx.Response(200, text=METRICS)) as client:
        signals = await client.kv_signals(timeout_s=5)
    assert signals.num_running_reqs == 16
    assert signals.num_queue_reqs == 3  # not the by-reason series
    assert signals.token_usage == 0.75  # a fraction per engine: the fullest one
    assert signals.retracted_total == 7  # preemptions are the controller's retractions
    assert signals.requests_total == 125
    assert signals.max_total_num_tokens is None


async def test_tool_call_parsing_is_left_to_sglang_servers() -> None:
    async with client_for(answering(404, {"detail": "Not Found"})) as client:
        assert not isinstance(client, ToolCallParsing)
        server = Server("v0", client, max_limits=dict.fromkeys(PromptClass, 1))
        with pytest.raises(ServerError, match="needs an SGLang server in the fleet"):
            tool_call_parsing(server)
