"""The simulator speaking vLLM with hidden-state capture, over a real socket: vLLM 0.33.0's
``extract_hidden_states`` with ``ExampleHiddenStatesConnector`` (and speculators' FP8 variant).

Each test reads the capture directory as a client does: the path from ``kv_transfer_params``, the
``<file>.lock`` held until the file is written, then the safetensors file itself.
"""

from __future__ import annotations

import asyncio
import os
import re
import stat
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import ml_dtypes
import numpy as np
import pytest
from pydantic import ValidationError
from safetensors import SafetensorError

from datagen_cli.local.processes import child_env
from simulator import SimApi, SimConfig
from simulator.capture_values import hidden_states
from simulator.config import CaptureDtype
from tests.support.metrics import metric_value
from tests.support.sim import capturing_simulator, lock_held, read_capture, wait_for_capture
from tests.support.wait import wait_until, wait_until_async

PROMPT = [5, 6, 7]
LAYERS = (29, 2, 16, 32)  # given unsorted: the file's layer axis is 2, 16, 29, 32
AXIS = [2, 16, 29, 32]
HIDDEN = 8
FAST: dict[str, Any] = {"capture_layers": LAYERS, "capture_hidden_size": HIDDEN, "startup_timeout_s": 10}
# Long enough to look at the lock before the file is written.
SLOW_WRITE: dict[str, Any] = {**FAST, "capture_write_delay_ms": 300}
# 20 ms per decode step, so a long request is still running when the client leaves.
SLOW_DECODE: dict[str, Any] = {**FAST, "time_scale": 1.0, "decode_step_base_s": 0.02}
BODY: dict[str, Any] = {"prompt": PROMPT, "max_tokens": 1, "return_token_ids": True}


async def capture(
    url: str, body: Mapping[str, Any] | None = None, *, headers: Mapping[str, str] | None = None
) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        return await client.post("/v1/completions", json=dict(body or BODY), headers=headers)


def path_of(resp: httpx.Response) -> str:
    assert resp.status_code == 200, resp.text
    path: str = resp.json()["kv_transfer_params"]["hidden_states_path"]
    return path


def files(directory: Path) -> list[str]:
    return sorted(os.listdir(directory)) if directory.exists() else []


# -- the file and its lock -----------------------------------------------------------------------


async def test_the_path_is_locked_at_response_time_and_written_after(tmp_path: Path) -> None:
    with capturing_simulator(tmp_path, **SLOW_WRITE) as url:
        resp = await capture(url, headers={"X-Request-Id": "abc"})
        path = path_of(resp)
        # Before the file: the lock exists, 0644 at most, held exclusively by the writer.
        assert re.fullmatch(rf"{re.escape(str(tmp_path))}/cmpl-abc-0-[0-9a-f]{{8}}\.safetensors", path)
        lock = Path(f"{path}.lock")
        assert lock.exists() and not Path(path).exists()
        assert stat.S_IMODE(lock.stat().st_mode) & ~0o644 == 0
        assert lock_held(lock)
        wait_for_capture(path)
    got = resp.json()["choices"][0]
    assert got["prompt_token_ids"] == PROMPT
    assert len(got["token_ids"]) == 1
    tensors = read_capture(path)
    assert set(tensors) == {"hidden_states", "token_ids"}
    dtype, values = tensors["hidden_states"]
    assert (dtype, values.shape) == ("BF16", (3, 4, HIDDEN))
    id_dtype, ids = tensors["token_ids"]
    assert (id_dtype, ids.tolist()) == ("I64", PROMPT)
    as_float = values.astype(np.float32)
    # By hand, ((token*31 + t*7 + layer*13 + h*3) % 251 - 125) / 16:
    # token 5, t=0, layer 2 (slot 0), h=0: (155 + 0 + 26 + 0) % 251 - 125 = 56 -> 3.5
    assert as_float[0, 0, 0] == 3.5
    # token 6, t=1, layer 32 (slot 3), h=1: (186 + 7 + 416 + 3) % 251 - 125 = 110 - 125 = -15 -> -0.9375
    assert as_float[1, 3, 1] == -0.9375
    # token 7, t=2, layer 16 (slot 1), h=2: (217 + 14 + 208 + 6) % 251 - 125 = 194 - 125 = 69 -> 4.3125
    assert as_float[2, 1, 2] == 4.3125
    np.testing.assert_array_equal(as_float, hidden_states(PROMPT, AXIS, HIDDEN))
    # The server never deletes: the lock stays beside the file.
    assert files(tmp_path) == sorted([Path(path).name, lock.name])


async def test_the_file_name_takes_the_header_then_the_body_id_then_random_hex(tmp_path: Path) -> None:
    with capturing_simulator(tmp_path, **FAST) as url:
        header = path_of(await capture(url, {**BODY, "request_id": "body"}, headers={"X-Request-Id": "head"}))
        body = path_of(await capture(url, {**BODY, "request_id": "body"}))
        random = path_of(await capture(url))
        unsafe = [await capture(url, {**BODY, "request_id": bad}) for bad in ("a/b", "..")]
        for path in (header, body, random):
            wait_for_capture(path)
    assert Path(header).name.startswith("cmpl-head-0-")
    assert Path(body).name.startswith("cmpl-body-0-")
    assert re.fullmatch(r"cmpl-[0-9a-f]{16}-0-[0-9a-f]{8}\.safetensors", Path(random).name)
    for resp in unsafe:
        assert resp.status_code == 400
        assert resp.json()["error"]["param"] == "request_id"
    assert len(files(tmp_path)) == 6  # three files and their locks; nothing for the refused ids


async def test_fp8_files_hold_per_token_scales_as_speculators_quantises(tmp_path: Path) -> None:
    prompt = [5, 6, 7, 1000, 129000]
    with capturing_simulator(tmp_path, **FAST, capture_dtype="fp8") as url:
        path = path_of(await capture(url, {**BODY, "prompt": prompt}))
        wait_for_capture(path)
    tensors = read_capture(path)
    assert {name: (dtype, array.shape) for name, (dtype, array) in tensors.items()} == {
        "hidden_states": ("F8_E4M3", (5, 4, HIDDEN)),
        "hidden_states_scales": ("F32", (5, 1, 1)),
        "token_ids": ("I64", (5,)),
    }
    exact = hidden_states(prompt, AXIS, HIDDEN)
    scales = tensors["hidden_states_scales"][1]
    amax = np.abs(exact).max(axis=(1, 2), keepdims=True)
    np.testing.assert_array_equal(scales, amax / np.float32(448.0))
    quantised = tensors["hidden_states"][1]
    assert quantised.dtype == ml_dtypes.float8_e4m3fn
    restored = quantised.astype(np.float32) * scales
    # e4m3 keeps 3 mantissa bits (relative error up to 2^-4) and its subnormals step by scale * 2^-9.
    assert np.all(np.abs(restored - exact) <= np.abs(exact) * 2.0**-4 + scales * 2.0**-9)
    assert tensors["token_ids"][1].tolist() == prompt


async def test_each_prompt_gets_a_file_and_only_the_first_path_comes_back(tmp_path: Path) -> None:
    with capturing_simulator(tmp_path, **FAST) as url:
        path = path_of(await capture(url, {**BODY, "prompt": [PROMPT, [8, 9]], "request_id": "two"}))
        second = wait_until(lambda: list(tmp_path.glob("cmpl-two-1-*.safetensors")), 5, "the second file")
        for written in (path, second[0]):
            wait_for_capture(written)
    assert Path(path).name.startswith("cmpl-two-0-")
    assert read_capture(path)["token_ids"][1].tolist() == PROMPT
    assert read_capture(second[0])["token_ids"][1].tolist() == [8, 9]


async def test_include_output_tokens_stores_the_prompt_and_all_but_the_last_generated(tmp_path: Path) -> None:
    body = {
        **BODY,
        "max_tokens": 3,
        "ignore_eos": True,
        "kv_transfer_params": {"include_output_tokens": True},
    }
    with capturing_simulator(tmp_path, **FAST) as url:
        resp = await capture(url, body)
        path = path_of(resp)
        wait_for_capture(path)
    generated = resp.json()["choices"][0]["token_ids"]
    assert len(generated) == 3
    stored = [*PROMPT, *generated[:-1]]
    tensors = read_capture(path)
    assert tensors["token_ids"][1].tolist() == stored
    np.testing.assert_array_equal(
        tensors["hidden_states"][1].astype(np.float32), hidden_states(stored, AXIS, HIDDEN)
    )


# -- refused before scheduling: no lock, no file ------------------------------------------------


async def test_requests_refused_before_scheduling_leave_nothing(tmp_path: Path) -> None:
    # vLLM 0.33.0 lowers a max_tokens that overruns the context (docs/reference/vllm-contract.md);
    # what it still refuses: a prompt over max_model_len, one filling it (max_tokens lowered to 0),
    # max_tokens over max_model_len, and an invalid body or model.
    refused = [
        {**BODY, "prompt": list(range(10, 75))},
        {**BODY, "prompt": list(range(10, 74))},
        {**BODY, "max_tokens": 65},
        {**BODY, "prompt": [5, -1]},
        {**BODY, "model": "nope"},
    ]
    with capturing_simulator(tmp_path, **FAST, context_len=64) as url:
        answers = [await capture(url, body) for body in refused]
    assert [r.status_code for r in answers] == [400, 400, 400, 400, 404]
    assert [r.json()["error"]["param"] for r in answers[:3]] == ["input_tokens", "max_tokens", "max_tokens"]
    assert files(tmp_path) == []


# -- faults -------------------------------------------------------------------------------------


async def test_fault_truncate_cuts_the_file_and_releases_the_lock(tmp_path: Path) -> None:
    with capturing_simulator(tmp_path, **FAST, capture_fault_truncate=1.0) as url:
        path = path_of(await capture(url))
        wait_for_capture(path)
    size = Path(path).stat().st_size
    with capturing_simulator(tmp_path / "whole", **FAST) as url:
        whole = path_of(await capture(url))
        wait_for_capture(whole)
    assert size < Path(whole).stat().st_size
    with pytest.raises(SafetensorError):
        read_capture(path)


async def test_fault_nofile_releases_the_lock_with_no_file(tmp_path: Path) -> None:
    with capturing_simulator(tmp_path, **FAST, capture_fault_nofile=1.0) as url:
        path = path_of(await capture(url))
        wait_for_capture(path)
    assert not Path(path).exists()
    assert files(tmp_path) == [f"{Path(path).name}.lock"]


async def test_fault_short_stores_fewer_rows_than_token_ids(tmp_path: Path) -> None:
    prompt = list(range(5, 45))
    with capturing_simulator(tmp_path, **FAST, capture_fault_short=1.0) as url:
        path = path_of(await capture(url, {**BODY, "prompt": prompt}))
        wait_for_capture(path)
    tensors = read_capture(path)
    rows = tensors["hidden_states"][1].shape[0]
    assert rows < len(prompt)
    assert tensors["token_ids"][1].tolist() == prompt
    # The rows it has are the first positions' (stale or missing rows are what a client must catch).
    np.testing.assert_array_equal(
        tensors["hidden_states"][1].astype(np.float32), hidden_states(prompt, AXIS, HIDDEN)[:rows]
    )


async def test_fault_slow_holds_the_lock_for_the_slow_write(tmp_path: Path) -> None:
    options = {**FAST, "capture_fault_slow": 1.0, "capture_slow_write_s": 0.6, "capture_write_delay_ms": 0}
    with capturing_simulator(tmp_path, **options) as url:
        path = path_of(await capture(url))
        await asyncio.sleep(0.3)
        assert lock_held(f"{path}.lock") and not Path(path).exists()
        wait_for_capture(path)
    assert read_capture(path)["token_ids"][1].tolist() == PROMPT


async def test_fault_5xx_answers_vllms_500_with_no_lock_or_file(tmp_path: Path) -> None:
    with capturing_simulator(tmp_path, **FAST, capture_fault_5xx=1.0) as url:
        resp = await capture(url)
    assert resp.status_code == 500
    error = resp.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("InternalServerError", 500, None)
    assert files(tmp_path) == []


async def test_faults_follow_the_request_id_and_a_retry_draws_again(tmp_path: Path) -> None:
    ids = [f"r{i}" for i in range(24)]

    async def failed(url: str) -> list[str]:
        answers = [await capture(url, {**BODY, "request_id": rid}) for rid in ids]
        return [rid for rid, resp in zip(ids, answers, strict=True) if resp.status_code == 500]

    with capturing_simulator(tmp_path / "a", **FAST, capture_fault_5xx=0.5) as url:
        first = await failed(url)
    with capturing_simulator(tmp_path / "b", **FAST, capture_fault_5xx=0.5) as url:
        again = await failed(url)
        retried = [(await capture(url, {**BODY, "request_id": rid})).status_code for rid in again]
    assert first == again
    assert 0 < len(first) < len(ids)
    assert 200 in retried  # a second attempt at the same id is a fresh draw


# -- aborts after scheduling leave orphans -------------------------------------------------------


async def _leave_while_running(url: str, body: dict[str, Any]) -> None:
    async with (
        httpx.AsyncClient(base_url=url, timeout=10) as watcher,
        httpx.AsyncClient(base_url=url) as client,
    ):

        async def running() -> bool:
            return metric_value((await watcher.get("/metrics")).text, "vllm:num_requests_running") == 1

        task = asyncio.create_task(client.post("/v1/completions", json=body))
        ran: bool = await wait_until_async(running, 5, "the request never ran")
        assert ran
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


def _orphan(directory: Path) -> Path:
    def written() -> list[Path]:
        return [p for p in directory.glob("*.safetensors") if not lock_held(f"{p}.lock")]

    found = wait_until(written, 5, "the orphan file")
    assert len(found) == 1
    return found[0]


async def test_a_client_that_leaves_during_decode_still_gets_a_whole_orphan(tmp_path: Path) -> None:
    body = {**BODY, "max_tokens": 2000, "ignore_eos": True}
    with capturing_simulator(tmp_path, **SLOW_DECODE) as url:
        await _leave_while_running(url, body)
        orphan = _orphan(tmp_path)
    tensors = read_capture(orphan)
    assert tensors["token_ids"][1].tolist() == PROMPT
    assert tensors["hidden_states"][1].shape == (3, 4, HIDDEN)
    assert re.fullmatch(r"cmpl-[0-9a-f]{16}-0-[0-9a-f]{8}\.safetensors", orphan.name)


async def test_a_client_that_leaves_mid_prefill_gets_an_orphan_with_fewer_rows(tmp_path: Path) -> None:
    prompt = list(range(5, 205))  # 200 tokens at 10 ms each: a 2 s prefill
    with capturing_simulator(tmp_path, **SLOW_DECODE, prefill_s_per_token=0.01) as url:
        await _leave_while_running(url, {**BODY, "prompt": prompt})
        orphan = _orphan(tmp_path)
    tensors = read_capture(orphan)
    assert tensors["token_ids"][1].tolist() == prompt
    assert tensors["hidden_states"][1].shape[0] < len(prompt)


# -- launch options ------------------------------------------------------------------------------


def test_capture_options_are_checked_at_start() -> None:
    vllm = SimApi.VLLM
    layer_errors = {
        "": "name at least one layer id",
        "2,16,16": "layer id 16 is given twice",
        "2,33": "layer id 33 is outside 0..32",
        "2,x": "valid integer",
    }
    for layers, message in layer_errors.items():
        with pytest.raises(ValidationError, match=message):
            SimConfig.model_validate({"api": vllm, "capture_dir": "d", "capture_layers": layers})
    spelled = SimConfig.model_validate({"api": vllm, "capture_dir": "d", "capture_layers": "32, 2,16"})
    assert spelled.capture_layer_ids == (2, 16, 32)
    assert SimConfig(api=vllm, capture_dir="d", capture_num_layers=40).capture_layer_ids == (2, 20, 37, 40)
    with pytest.raises(ValidationError, match="the default layers"):
        SimConfig(api=vllm, capture_dir="d", capture_num_layers=2)
    with pytest.raises(ValidationError, match="capture_dtype, capture_fault_5xx need capture_dir"):
        SimConfig(api=vllm, capture_fault_5xx=0.1, capture_dtype=CaptureDtype.FP8)
    with pytest.raises(ValidationError, match="simulated only with api=vllm"):
        SimConfig(capture_dir="d")
    with pytest.raises(ValidationError, match=r"must not add up to more than 1\.0"):
        SimConfig(api=vllm, capture_dir="d", capture_fault_nofile=0.6, capture_fault_slow=0.6)


def test_bad_capture_flags_are_refused_in_one_line(tmp_path: Path) -> None:
    config = tmp_path / "sim.yaml"
    config.write_text("api: vllm\ncapture-dir: hs\ncapture-layers: '2,40'\n", encoding="utf-8")
    runs = {
        ("--api", "vllm", "--capture-dir", "hs", "--capture-layers", "2,2"): "--capture-layers='2,2'",
        ("--api", "vllm", "--capture-dir", "hs", "--capture-dtype", "fp16"): "--capture-dtype='fp16'",
        ("--config", str(config)): f"capture_layers='2,40' in {config}",
    }
    procs = {
        expected: subprocess.Popen(
            [sys.executable, "-m", "datagen_cli", "sim", "--port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=child_env({}),
            cwd=tmp_path,
        )
        for args, expected in runs.items()
    }
    for expected, proc in procs.items():
        out, err = proc.communicate(timeout=30)
        lines = (out + err).decode().strip().splitlines()
        assert proc.returncode != 0
        assert len(lines) == 1 and expected in lines[0], lines
    assert not (tmp_path / "hs").exists()
