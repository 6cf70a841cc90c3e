"""The simulator's request log (``SimConfig.request_log``, ``datagen sim --request-log``): one JSON line
per accepted generation request, saying what it asked for, readable while the server runs.

Expected lines are written by hand; each ids' hash is ``sha256`` of their comma-joined decimal text
(``sha256(b"5,6,7")``).
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from datagen_cli.local.processes import child_env
from simulator import SimConfig
from tests.support.sim import SimFactory, read_request_log, running_simulator
from tests.support.wait import wait_until

FAST: dict[str, Any] = {"time_scale": 0.0, "startup_timeout_s": 10, "poll_s": 0.01}
SHA_5_6_7 = "9988e8a737dd629d5014a04ec3c0b97444416bb63e48f3ab7aa4da48a3aeb569"
SHA_8_9 = "188dc39f8dfce31448d5a65fbd62299120f30d06d8c0a68ae320b2de80599bf5"
SHA_11_12_13_14 = "bd3c181ff39079b44a5fc63d6eb72537d0f79eb16a621a5b330f40a976e9acdf"
CONCURRENT_REQUESTS = 50
CLI_STARTUP_TIMEOUT_S = 30.0
LISTENING = re.compile(r"simulator listening on (http://127\.0\.0\.1:\d+)")


def now_ms() -> int:
    return int(time.time() * 1000)


def without_time(line: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in line.items() if key != "at_ms"}


async def test_sglang_generate_logs_the_sampling_params_it_carried(tmp_path: Path) -> None:
    log = tmp_path / "requests.jsonl"
    sampling = {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 8, "sampling_seed": 3}
    before_ms = now_ms()
    with running_simulator(request_log=log, **FAST) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            resp = await client.post(
                "/generate", json={"rid": "r-1", "input_ids": [5, 6, 7], "sampling_params": sampling}
            )
            assert resp.status_code == 200, resp.text
            lines = read_request_log(log)  # while the server runs: each line is flushed as written
    after_ms = now_ms()
    assert [without_time(line) for line in lines] == [
        {
            "api": "sglang",
            "rid": "r-1",
            "prompt_tokens": 3,
            "input_ids_sha256": SHA_5_6_7,
            "sampling_params": {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 8, "sampling_seed": 3},
        }
    ]
    assert before_ms <= lines[0]["at_ms"] <= after_ms


async def test_vllm_completion_logs_its_sampling_fields_only(tmp_path: Path) -> None:
    log = tmp_path / "requests.jsonl"
    body = {
        "model": "sim/deepseek-r1",
        "prompt": [11, 12, 13, 14],
        "request_id": "c-1",
        "max_tokens": 5,
        "temperature": 0.6,
        "top_p": 0.95,
        "repetition_penalty": 1.1,
        "seed": 7,
        "stop_token_ids": [2],
        "return_token_ids": True,  # not a sampling field
        "skip_special_tokens": False,
    }
    with running_simulator(api="vllm", request_log=log, **FAST) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            resp = await client.post("/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            lines = read_request_log(log)
    assert [without_time(line) for line in lines] == [
        {
            "api": "vllm",
            "rid": "cmpl-c-1",
            "prompt_tokens": 4,
            "input_ids_sha256": SHA_11_12_13_14,
            "sampling_params": {
                "max_tokens": 5,
                "temperature": 0.6,
                "top_p": 0.95,
                "repetition_penalty": 1.1,
                "seed": 7,
                "stop_token_ids": [2],
                "skip_special_tokens": False,
            },
        }
    ]


async def test_a_batch_logs_one_line_per_prompt_and_refused_requests_none(tmp_path: Path) -> None:
    log = tmp_path / "requests.jsonl"
    with running_simulator(request_log=log, **FAST) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            refused = await client.post(
                "/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"top_p": 0}}
            )
            assert refused.status_code == 400
            batch = {
                "rid": ["b-0", "b-1"],
                "input_ids": [[5, 6, 7], [8, 9]],
                "sampling_params": [{"max_new_tokens": 4}, {"max_new_tokens": 6, "temperature": 0.0}],
            }
            resp = await client.post("/generate", json=batch)
            assert resp.status_code == 200, resp.text
            lines = read_request_log(log)
    assert [without_time(line) for line in lines] == [
        {
            "api": "sglang",
            "rid": "b-0",
            "prompt_tokens": 3,
            "input_ids_sha256": SHA_5_6_7,
            "sampling_params": {"max_new_tokens": 4},
        },
        {
            "api": "sglang",
            "rid": "b-1",
            "prompt_tokens": 2,
            "input_ids_sha256": SHA_8_9,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0.0},
        },
    ]


async def test_vllm_refuses_a_bad_penalty_and_logs_nothing(tmp_path: Path) -> None:
    log = tmp_path / "requests.jsonl"
    with running_simulator(api="vllm", request_log=log, **FAST) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            resp = await client.post("/v1/completions", json={"prompt": [5, 6, 7], "repetition_penalty": 0.0})
    assert resp.status_code == 400
    assert resp.json()["error"]["message"] == "repetition_penalty must be greater than zero, got 0.0."
    assert resp.json()["error"]["param"] == "repetition_penalty"
    assert read_request_log(log) == []


async def test_concurrent_requests_give_whole_lines(tmp_path: Path) -> None:
    log = tmp_path / "requests.jsonl"
    # A long stop list makes each line a few KiB, so a torn or interleaved write would show.
    stops = list(range(1000, 1400))
    with running_simulator(request_log=log, **FAST) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            responses = await asyncio.gather(
                *(
                    client.post(
                        "/generate",
                        json={
                            "rid": f"c-{i}",
                            "input_ids": [5, 6, 7, i],
                            "sampling_params": {
                                "max_new_tokens": 4,
                                "stop_token_ids": stops,
                                "sampling_seed": i,
                            },
                        },
                    )
                    for i in range(CONCURRENT_REQUESTS)
                )
            )
            assert [r.status_code for r in responses] == [200] * CONCURRENT_REQUESTS
            lines = read_request_log(log)  # json.loads fails on a cut or interleaved line
    assert sorted(line["rid"] for line in lines) == sorted(f"c-{i}" for i in range(CONCURRENT_REQUESTS))
    assert {line["sampling_params"]["sampling_seed"] for line in lines} == set(range(CONCURRENT_REQUESTS))
    assert all(line["sampling_params"]["stop_token_ids"] == stops for line in lines)
    assert log.read_text("utf-8").count("\n") == CONCURRENT_REQUESTS


async def test_without_the_option_there_is_no_log(sim: SimFactory) -> None:
    async with sim() as (client, app):
        resp = await client.post(
            "/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}}
        )
        assert resp.status_code == 200, resp.text
        assert app.state.sim.request_log is None


def test_a_log_in_a_missing_directory_is_refused_at_start(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="does not exist; create it or name another file"):
        SimConfig(request_log=tmp_path / "missing" / "requests.jsonl")
    with pytest.raises(ValidationError, match="is a directory"):
        SimConfig(request_log=tmp_path)


def test_datagen_sim_takes_request_log(tmp_path: Path) -> None:
    log = tmp_path / "requests.jsonl"
    out = tmp_path / "sim.out"
    command = [sys.executable, "-m", "datagen_cli", "sim", "--port", "0", "--time-scale", "0"]
    with open(out, "wb") as sink:
        proc = subprocess.Popen(
            [*command, "--request-log", str(log)], stdout=sink, stderr=subprocess.STDOUT, env=child_env({})
        )
    try:
        address = wait_until(
            lambda: _listening_url(out),
            CLI_STARTUP_TIMEOUT_S,
            "the simulator's address line",
            on_timeout=lambda: out.read_text("utf-8"),
        )
        resp = httpx.post(
            f"{address}/generate",
            json={"rid": "cli-1", "input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}},
            timeout=10,
        )
        assert resp.status_code == 200, resp.text
        lines = read_request_log(log)
    finally:
        proc.kill()
        proc.wait()
    assert [without_time(line) for line in lines] == [
        {
            "api": "sglang",
            "rid": "cli-1",
            "prompt_tokens": 3,
            "input_ids_sha256": SHA_5_6_7,
            "sampling_params": {"max_new_tokens": 2},
        }
    ]


def _listening_url(out: Path) -> str | None:
    found = LISTENING.search(out.read_text("utf-8"))
    return found.group(1) if found else None
