"""The HTTP contract of the simulator, checked in-process over ASGI."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from simulator import SpecialIds, expected_output
from tests.support.metrics import metric, metric_labels
from tests.support.sim import NOT_REACHED, WAIT_POLL_S, WAIT_S, SimFactory, deepseek_tokenizer_dir
from tests.support.wait import wait_until_async

SPECIAL = SpecialIds.deepseek_default()
EOS = SPECIAL.eos_id
META_KEYS = {
    "id",
    "finish_reason",
    "prompt_tokens",
    "weight_version",
    "num_retractions",
    "reasoning_tokens",
    "completion_tokens",
    "cached_tokens",
    "e2e_latency",
    "response_sent_to_client_ts",
}
# Slow enough to catch a request in flight: 20 ms per decode step.
SLOW = {"time_scale": 1.0, "decode_step_base_s": 0.02}


def expected(prompt: list[int], max_new_tokens: int = 128, seed: int | None = None, **kw: Any) -> Any:
    return expected_output(prompt, max_new_tokens=max_new_tokens, seed=seed, special=SPECIAL, **kw)


def long_prompt(min_len: int) -> list[int]:
    """A prompt whose natural output is longer than ``min_len``."""
    for i in range(10_000):
        if len(expected([i, 7], max_new_tokens=100_000).output_ids) > min_len:
            return [i, 7]
    raise AssertionError("no such prompt")


async def generate(client: httpx.AsyncClient, body: dict[str, Any]) -> httpx.Response:
    return await client.post("/generate", json=body)


# -- successful generation -----------------------------------------------------------------


async def test_single_request_has_sglangs_shape(sim: SimFactory) -> None:
    async with sim() as (client, _):
        body = {"rid": "abc", "input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4000}}
        resp = await generate(client, body)
    assert resp.status_code == 200
    data = resp.json()
    assert set(data) == {"text", "output_ids", "meta_info"}
    want = expected([5, 6, 7], 4000)
    assert data["output_ids"] == want.output_ids
    assert data["output_ids"][-1] == EOS
    meta = data["meta_info"]
    assert set(meta) == META_KEYS
    assert meta["id"] == "abc"
    assert meta["finish_reason"] == {"type": "stop", "matched": EOS}
    assert meta["prompt_tokens"] == 3
    assert meta["completion_tokens"] == len(want.output_ids)
    assert (meta["cached_tokens"], meta["num_retractions"], meta["reasoning_tokens"]) == (0, 0, 0)
    assert meta["weight_version"] == "default"
    assert meta["e2e_latency"] >= 0
    # The placeholder text has one piece per ordinary token and drops the matched EOS.
    assert data["text"].count("</think>") == 1
    assert data["text"].count(" t") == len(want.output_ids) - 2


async def test_put_is_accepted_and_max_new_tokens_defaults_to_128(sim: SimFactory) -> None:
    prompt = long_prompt(200)
    async with sim() as (client, _):
        resp = await client.put("/generate", json={"input_ids": prompt})
    data = resp.json()
    assert data["output_ids"] == expected(prompt, 128).output_ids
    assert len(data["output_ids"]) == 128
    assert data["meta_info"]["finish_reason"] == {"type": "length", "length": 128}
    assert len(data["meta_info"]["id"]) == 32  # a uuid hex when no rid is sent


async def test_sampling_seed_selects_the_output(sim: SimFactory) -> None:
    async with sim() as (client, _):
        resp = await generate(client, {"input_ids": [1, 2], "sampling_params": {"sampling_seed": 9}})
    assert resp.json()["output_ids"] == expected([1, 2], seed=9).output_ids


async def test_batch_answers_in_input_order_with_suffixed_rids(sim: SimFactory) -> None:
    prompts = [[1, 2, 3], [4, 5], [6]]
    async with sim() as (client, _):
        resp = await generate(
            client, {"rid": "job", "input_ids": prompts, "sampling_params": {"max_new_tokens": 50}}
        )
    data = resp.json()
    assert isinstance(data, list) and len(data) == 3
    assert [d["meta_info"]["id"] for d in data] == ["job_0", "job_1", "job_2"]
    assert [d["output_ids"] for d in data] == [expected(p, 50).output_ids for p in prompts]


async def test_batch_takes_rid_lists_and_per_item_sampling_params(sim: SimFactory) -> None:
    body = {
        "rid": ["a", "b"],
        "input_ids": [[1, 2], [3, 4]],
        "sampling_params": [{"max_new_tokens": 3}, {"max_new_tokens": 5, "sampling_seed": 1}],
    }
    async with sim() as (client, _):
        data = (await generate(client, body)).json()
    assert [d["meta_info"]["id"] for d in data] == ["a", "b"]
    assert data[0]["output_ids"] == expected([1, 2], 3).output_ids
    assert data[1]["output_ids"] == expected([3, 4], 5, seed=1).output_ids


async def test_parallel_sampling_is_prompt_major_with_fresh_rids(sim: SimFactory) -> None:
    body = {"rid": "p", "input_ids": [[1], [2]], "sampling_params": {"n": 2, "max_new_tokens": 20}}
    async with sim() as (client, _):
        data = (await generate(client, body)).json()
        single = (await generate(client, {"input_ids": [3], "sampling_params": {"n": 3}})).json()
        once = (await generate(client, {"input_ids": [3], "sampling_params": {"n": 0}})).json()
    assert [d["output_ids"] for d in data] == [expected([p], 20).output_ids for p in (1, 1, 2, 2)]
    rids = [d["meta_info"]["id"] for d in data]
    assert len(set(rids)) == 4 and not any(r.startswith("p") for r in rids)
    assert isinstance(single, list) and len(single) == 3
    assert isinstance(once, dict)  # n <= 1 runs the prompt once, unexpanded


async def test_stop_token_ids_ignore_eos_and_text_options(sim: SimFactory) -> None:
    full = expected([9, 9], 4000).output_ids
    stop_id = full[3]
    async with sim() as (client, _):
        stopped = (
            await generate(client, {"input_ids": [9, 9], "sampling_params": {"stop_token_ids": [stop_id]}})
        ).json()
        ignored = (
            await generate(
                client, {"input_ids": [9, 9], "sampling_params": {"ignore_eos": True, "max_new_tokens": 600}}
            )
        ).json()
        raw = (
            await generate(
                client,
                {
                    "input_ids": [9, 9],
                    "sampling_params": {
                        "max_new_tokens": 4000,
                        "skip_special_tokens": False,
                        "no_stop_trim": True,
                    },
                },
            )
        ).json()
    assert stopped["output_ids"] == full[: full.index(stop_id) + 1]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert len(ignored["output_ids"]) == 600 and EOS not in ignored["output_ids"]
    assert ignored["meta_info"]["finish_reason"] == {"type": "length", "length": 600}
    assert raw["text"].endswith(f"<|special:{EOS}|>")


async def test_reasoning_tokens_and_prompt_token_ids_on_request(sim: SimFactory) -> None:
    body = {
        "input_ids": [4, 2],
        "require_reasoning": True,
        "return_prompt_token_ids": True,
        "sampling_params": {"max_new_tokens": 4000},
    }
    async with sim() as (client, _):
        data = (await generate(client, body)).json()
    ids = expected([4, 2], 4000).output_ids
    assert data["meta_info"]["reasoning_tokens"] == ids.index(SPECIAL.think_end_id) + 1
    assert data["prompt_token_ids"] == [4, 2]


async def test_null_max_new_tokens_runs_until_the_context_is_full(sim: SimFactory) -> None:
    async with sim(context_len=300) as (client, _):
        body = {"input_ids": [1] * 10, "sampling_params": {"max_new_tokens": None, "ignore_eos": True}}
        data = (await generate(client, body)).json()
    # SGLang caps at max_req_len - prompt - 1 = (300 - 1) - 10 - 1.
    assert data["meta_info"]["finish_reason"] == {"type": "length", "length": 288}
    assert len(data["output_ids"]) == 288


async def test_real_tokenizer_detokenizes_and_tokenizes(sim: SimFactory, deepseek_tokenizer: Any) -> None:
    async with sim(tokenizer_path=deepseek_tokenizer_dir()) as (client, _):
        data = (
            await generate(client, {"input_ids": [0, 5, 6], "sampling_params": {"max_new_tokens": 4000}})
        ).json()
        from_text = (
            await generate(client, {"text": "Hello there", "sampling_params": {"max_new_tokens": 5}})
        ).json()
    ids = data["output_ids"]
    assert data["text"] == deepseek_tokenizer.decode(ids[:-1], skip_special_tokens=True)
    prompt = deepseek_tokenizer("Hello there")["input_ids"]
    assert from_text["output_ids"] == expected(prompt, 5).output_ids
    assert from_text["meta_info"]["prompt_tokens"] == len(prompt)


# -- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({}, "Either text, input_ids or input_embeds should be provided."),
        ({"input_ids": []}, "input_ids cannot be empty."),
        ({"text": "hi"}, "cannot accept text prompts"),
        ({"input_ids": [1], "stream": True}, "Streaming is not simulated"),
        ({"input_ids": [1], "return_logprob": True}, "return_logprob is not simulated"),
        ({"input_ids": [1], "sampling_params": {"temperature": -1}}, "temperature must be a non-negative"),
        ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p must be in (0, 1], got 0."),
        (
            {"input_ids": [1], "sampling_params": {"top_k": 0}},
            "top_k must be -1 (disable) or at least 1, got 0.",
        ),
        ({"input_ids": [1], "sampling_params": {"min_p": 2}}, "min_p must be in [0, 1], got 2."),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens must be at least 0"),
        (
            {"input_ids": [1], "sampling_params": {"min_new_tokens": 5, "max_new_tokens": 2}},
            "min_new_tokens must be in [0, max_new_tokens(2)], got 5.",
        ),
        ({"input_ids": [1], "sampling_params": {"regex": "a", "ebnf": "b"}}, "Only one of regex"),
        ({"input_ids": [1], "sampling_params": {"logit_bias": {"999999": 1.0}}}, "logit_bias must has keys"),
        ({"rid": ["a"], "input_ids": [[1], [2]]}, "The specified rids length mismatch"),
        (
            {"rid": ["a", "a"], "input_ids": [[1], [2]]},
            "Duplicate request IDs detected within the request: ['a']",
        ),
        (
            {"input_ids": [[1], [2]], "sampling_params": [{"n": 2}, {"n": 3}]},
            "The parallel_sample_num should be the same for all samples in sample params.",
        ),
    ],
)
async def test_value_errors_answer_400_with_an_error_message(
    sim: SimFactory, body: dict[str, Any], message: str
) -> None:
    async with sim() as (client, _):
        resp = await generate(client, body)
    assert resp.status_code == 400
    assert set(resp.json()) == {"error"}
    assert message in resp.json()["error"]["message"]


async def test_length_limits_use_sglangs_messages(sim: SimFactory) -> None:
    async with sim(context_len=100, max_total_num_tokens=60) as (client, _):
        too_long = await generate(client, {"input_ids": [1] * 100})
        too_many = await generate(client, {"input_ids": [1] * 10, "sampling_params": {"max_new_tokens": 90}})
        over_pool = await generate(client, {"input_ids": [1] * 54, "sampling_params": {"max_new_tokens": 1}})
    assert too_long.json()["error"]["message"] == (
        "The input (100 tokens) is longer than the model's context length (100 tokens)."
    )
    assert too_many.json()["error"]["message"] == (
        "Requested token count exceeds the model's maximum context length of 100 tokens. You requested a "
        "total of 100 tokens: 10 tokens from the input messages and 90 tokens for the completion. Please "
        "reduce the number of tokens in the input messages or the completion to fit within the limit."
    )
    # max_req_input_len = min(100 - 1, 60 - 1) - 5 = 54
    assert over_pool.json()["error"]["message"] == (
        "Input length (54 tokens) exceeds the maximum allowed length (54 tokens). "
        "Use a shorter input or enable --allow-auto-truncate."
    )


@pytest.mark.parametrize(
    "body",
    [
        {"input_ids": [1], "sampling_params": {"max_tokens": 5}},
        {"input_ids": [1], "sampling_params": {"temperature": "hot"}},
        {"input_ids": [[1], [2]], "sampling_params": [{}]},
    ],
)
async def test_sampling_crashes_answer_plain_500(sim: SimFactory, body: dict[str, Any]) -> None:
    async with sim() as (client, _):
        resp = await generate(client, body)
    assert resp.status_code == 500
    assert resp.headers["content-type"].startswith("text/plain")
    assert resp.text == "Internal Server Error"


@pytest.mark.parametrize(
    "body",
    [
        {"input_ids": ["a", "b"]},
        {"input_ids": [1.5]},
        {"input_ids": "1 2 3"},
        {"rid": 5, "input_ids": [1]},
        {"input_ids": [1], "sampling_params": "greedy"},
    ],
)
async def test_body_type_errors_answer_400_in_openai_shape(sim: SimFactory, body: dict[str, Any]) -> None:
    async with sim() as (client, _):
        resp = await generate(client, body)
    assert resp.status_code == 400
    data = resp.json()
    assert set(data) == {"object", "message", "type", "param", "code"}
    assert (data["object"], data["type"], data["param"], data["code"]) == ("error", "Bad Request", None, 400)
    assert data["message"]


async def test_unparseable_json_is_a_bad_request(sim: SimFactory) -> None:
    async with sim() as (client, _):
        resp = await client.post(
            "/generate", content=b"{not json", headers={"content-type": "application/json"}
        )
    assert resp.status_code == 400
    assert resp.json()["type"] == "Bad Request"


async def test_a_rid_in_flight_cannot_be_reused(sim: SimFactory) -> None:
    async with sim(**SLOW) as (client, app):
        first = asyncio.create_task(
            generate(client, {"rid": "dup", "input_ids": [1], "sampling_params": {"max_new_tokens": 500}})
        )
        await wait_until_async(
            lambda: app.state.sim.engine.in_flight("dup"), WAIT_S, NOT_REACHED, interval_s=WAIT_POLL_S
        )
        second = await generate(client, {"rid": "dup", "input_ids": [2]})
        await client.post("/abort_request", json={"rid": "dup"})
        await first
    assert second.status_code == 400
    assert second.json() == {"error": {"message": "Duplicate request ID detected: dup"}}


# -- aborts and faults -------------------------------------------------------------------------


async def test_abort_request_shapes_for_running_and_waiting(sim: SimFactory) -> None:
    async with sim(max_running_requests=1, **SLOW) as (client, app):
        engine = app.state.sim.engine
        body = {"input_ids": [3, 3], "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
        running = asyncio.create_task(generate(client, {"rid": "job-1", **body}))
        await wait_until_async(lambda: engine.num_running == 1, WAIT_S, NOT_REACHED, interval_s=WAIT_POLL_S)
        waiting = asyncio.create_task(generate(client, {"rid": "job-2", **body}))
        await wait_until_async(lambda: engine.num_queued == 1, WAIT_S, NOT_REACHED, interval_s=WAIT_POLL_S)
        await asyncio.sleep(0.1)
        resp = await client.post("/abort_request", json={"rid": "job-"})
        unknown = await client.post("/abort_request", json={"rid": "nothing-here"})
        metrics_text = (await client.get("/metrics")).text
        ran, waited = (await running).json(), (await waiting).json()
    assert (resp.status_code, resp.content) == (200, b"")
    assert unknown.status_code == 200
    assert ran["meta_info"]["finish_reason"] == {
        "type": "abort",
        "message": "Aborted",
        "status_code": None,
        "err_type": None,
    }
    partial = ran["output_ids"]
    assert 0 < len(partial) < 400
    assert partial == expected([3, 3], 400, ignore_eos=True).output_ids[: len(partial)]
    assert ran["meta_info"]["completion_tokens"] == len(partial)
    assert waited["output_ids"] == [] and waited["text"] == ""
    assert waited["meta_info"]["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}
    assert "prompt_tokens" not in waited["meta_info"] and "cached_tokens" not in waited["meta_info"]
    assert waited["meta_info"]["completion_tokens"] == 0
    assert metric(metrics_text, "sglang:num_aborted_requests_total") == 2


async def test_fault_503_uses_sglangs_error_body(sim: SimFactory) -> None:
    async with sim(fail_503_rate=1.0) as (client, _):
        resp = await generate(client, {"input_ids": [1]})
    assert resp.status_code == 503
    assert resp.json() == {
        "object": "error",
        "message": "The request queue is full.",
        "type": "503",
        "param": None,
        "code": 503,
    }


async def test_fault_500_uses_sglangs_error_body(sim: SimFactory) -> None:
    async with sim(fail_500_rate=1.0) as (client, _):
        resp = await generate(client, {"input_ids": [1]})
    assert resp.status_code == 500
    data = resp.json()
    assert (data["object"], data["type"], data["code"], data["param"]) == ("error", "500", 500, None)


async def test_fault_abort_returns_a_partial_output(sim: SimFactory) -> None:
    prompt = long_prompt(50)
    async with sim(abort_rate=1.0) as (client, _):
        data = (
            await generate(client, {"input_ids": prompt, "sampling_params": {"max_new_tokens": 4000}})
        ).json()
    assert data["meta_info"]["finish_reason"]["type"] == "abort"
    full = expected(prompt, 4000).output_ids
    assert len(data["output_ids"]) < len(full)
    assert data["output_ids"] == full[: len(data["output_ids"])]


async def test_faults_are_deterministic_per_rid_and_retries_redraw(sim: SimFactory) -> None:
    async def statuses() -> list[int]:
        async with sim(fail_503_rate=0.5) as (client, _):
            return [
                (await generate(client, {"rid": f"r{i}", "input_ids": [1]})).status_code for i in range(40)
            ]

    first, second = await statuses(), await statuses()
    assert first == second
    assert 5 < first.count(503) < 35
    async with sim(fail_503_rate=0.5) as (client, _):
        codes = [
            (await generate(client, {"rid": "retry-me", "input_ids": [1]})).status_code for _ in range(30)
        ]
    assert 200 in codes


# -- health, info, control, metrics ---------------------------------------------------------


async def test_health_is_503_with_an_empty_body_while_starting(sim: SimFactory) -> None:
    async with sim(starting_s=60) as (client, _):
        for path in ("/health", "/health_generate"):
            resp = await client.get(path)
            assert (resp.status_code, resp.content) == (503, b"")
        assert (await generate(client, {"input_ids": [1]})).status_code == 200  # not gated
        assert (await client.get("/model_info")).status_code == 200
    async with sim() as (client, _):
        for path in ("/health", "/health_generate"):
            resp = await client.get(path)
            assert (resp.status_code, resp.content) == (200, b"")


async def test_info_endpoints(sim: SimFactory) -> None:
    async with sim(context_len=4096, max_total_num_tokens=1000, weight_version="v7") as (client, _):
        model_info = (await client.get("/model_info")).json()
        assert (await client.get("/get_model_info")).json() == model_info
        server_info = (await client.get("/server_info")).json()
        old_server_info = (await client.get("/get_server_info")).json()
        models = (await client.get("/v1/models")).json()
    assert model_info["model_path"] == "sim/deepseek-r1"
    assert model_info["weight_version"] == "v7"
    assert {"tokenizer_path", "is_generation", "preferred_sampling_params", "architectures"} <= set(
        model_info
    )
    assert server_info == old_server_info
    assert server_info["max_total_num_tokens"] == 1000
    assert server_info["max_req_input_len"] == 994
    assert server_info["context_length"] == 4096
    assert server_info["internal_states"][0]["memory_usage"]["token_capacity"] == 1000
    assert server_info["version"]
    assert models["object"] == "list"
    assert models["data"][0]["id"] == "sim/deepseek-r1"
    assert models["data"][0]["max_model_len"] == 4096
    assert models["data"][0]["owned_by"] == "sglang"


async def test_flush_cache_refuses_while_busy(sim: SimFactory) -> None:
    async with sim(**SLOW) as (client, app):
        idle = await client.post("/flush_cache")
        task = asyncio.create_task(
            generate(client, {"rid": "busy", "input_ids": [1], "sampling_params": {"max_new_tokens": 300}})
        )
        await wait_until_async(
            lambda: app.state.sim.engine.in_flight("busy"), WAIT_S, NOT_REACHED, interval_s=WAIT_POLL_S
        )
        busy = await client.get("/flush_cache")
        await client.post("/abort_request", json={"rid": "busy"})
        await task
    assert idle.status_code == 200
    assert idle.text.startswith("Cache flushed.")
    assert busy.status_code == 400


ALL_METRICS = [
    "sglang:token_usage",
    "sglang:num_used_tokens",
    "sglang:max_total_num_tokens",
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
    "sglang:gen_throughput",
    "sglang:context_len",
    "sglang:generation_tokens_total",
    "sglang:prompt_tokens_total",
    "sglang:num_requests_total",
    "sglang:num_retracted_requests_total",
    "sglang:num_aborted_requests_total",
    "sglang:e2e_request_latency_seconds_count",
    "sglang:time_to_first_token_seconds_count",
    "sglang:inter_token_latency_seconds_count",
    "sglang:queue_time_seconds_count",
]


async def test_metrics_use_sglangs_names_and_labels(sim: SimFactory) -> None:
    async with sim(served_model_name="m/x", max_total_num_tokens=5000) as (client, _):
        data = (
            await generate(
                client, {"input_ids": [[1, 2], [3, 4, 5]], "sampling_params": {"max_new_tokens": 10}}
            )
        ).json()
        await generate(client, {"input_ids": [9], "log_metrics": False})
        resp = await client.get("/metrics")
    assert resp.headers["content-type"].startswith("text/plain")
    text = resp.text
    for name in ALL_METRICS:
        metric(text, name)  # raises KeyError when absent
    assert metric(text, "sglang:num_requests_total") == 2
    assert metric(text, "sglang:prompt_tokens_total") == 5
    assert metric(text, "sglang:generation_tokens_total") == sum(len(d["output_ids"]) for d in data)
    assert metric(text, "sglang:max_total_num_tokens") == 5000
    assert metric(text, "sglang:e2e_request_latency_seconds_count") == 2
    assert metric_labels(text, "sglang:num_requests_total") == [
        {"model_name": "m/x", "engine_type": "unified"}
    ]
    assert metric_labels(text, "sglang:token_usage") == [
        {"model_name": "m/x", "engine_type": "unified", "tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0"}
    ]


async def test_retraction_shows_in_meta_info_and_metrics(sim: SimFactory) -> None:
    body = {
        "input_ids": [[i, 1] for i in range(6)],
        "sampling_params": {"max_new_tokens": 200, "ignore_eos": True},
    }
    async with sim(max_total_num_tokens=500, reserve_fraction=0.0) as (client, _):
        data = (await generate(client, body)).json()
        text = (await client.get("/metrics")).text
    retractions = sum(d["meta_info"]["num_retractions"] for d in data)
    assert retractions >= 1
    assert metric(text, "sglang:num_retracted_requests_total") == retractions
    assert [d["output_ids"] for d in data] == [
        expected([i, 1], 200, ignore_eos=True).output_ids for i in range(6)
    ]


async def test_admission_blocking_queues_requests_under_load(sim: SimFactory) -> None:
    async with sim(max_total_num_tokens=2000, **SLOW) as (client, app):
        body = {
            "rid": "load",
            "input_ids": [[i] for i in range(20)],
            "sampling_params": {"max_new_tokens": 400},
        }
        task = asyncio.create_task(generate(client, body))
        await wait_until_async(
            lambda: app.state.sim.engine.num_running > 0, WAIT_S, NOT_REACHED, interval_s=WAIT_POLL_S
        )
        text = (await client.get("/metrics")).text
        await client.post("/abort_request", json={"rid": "load"})
        await task
    # Each request reserves 1 + 400 tokens, so only four of twenty fit in 2000.
    assert metric(text, "sglang:num_queue_reqs") == 16
    assert metric(text, "sglang:num_running_reqs") == 4
    assert metric(text, "sglang:num_used_tokens") > 0
