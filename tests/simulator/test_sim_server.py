"""The simulator over a real socket, served by uvicorn as the CLI serves it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import httpx
import pytest

from datagen_cli.local.redis_server import free_port
from simulator import SimConfig, SpecialIds, expected_output
from simulator.server import serve
from tests.support.metrics import metric
from tests.support.sim import running_simulator
from tests.support.wait import wait_until, wait_until_async

SPECIAL = SpecialIds.deepseek_default()


async def test_generate_health_and_metrics_over_a_socket() -> None:
    with running_simulator(time_scale=0.0, startup_timeout_s=10, poll_s=0.01) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            assert (await client.get("/health")).status_code == 200
            resp = await client.post("/generate", json={"rid": "s1", "input_ids": [1, 2, 3]})
            text = (await client.get("/metrics")).text
    assert resp.status_code == 200
    assert resp.headers["content-type"] == "application/json"
    want = expected_output([1, 2, 3], max_new_tokens=128, seed=None, special=SPECIAL)
    assert resp.json()["output_ids"] == want.output_ids
    assert metric(text, "sglang:num_requests_total") == 1


async def test_serve_runs_on_the_current_loop_until_cancelled() -> None:
    config = SimConfig(time_scale=0.0, port=free_port())
    task = asyncio.create_task(serve(config))
    url = f"http://{config.host}:{config.port}"
    async with httpx.AsyncClient(base_url=url, timeout=5) as client:

        async def healthy() -> bool:
            try:
                return (await client.get("/health")).status_code == 200
            except httpx.TransportError:
                return False

        await wait_until_async(healthy, 10, "server did not come up", interval_s=0.02)
        assert (await client.post("/generate", json={"input_ids": [5]})).status_code == 200
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def test_300_requests_at_concurrency_64_finish_in_a_few_seconds() -> None:
    # The CPU budget: the simulator shares two cores with Redis, a coordinator and a worker.
    n_requests, concurrency = 300, 64
    prompts = [[i, i + 1, i + 2] for i in range(n_requests)]
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    gate = asyncio.Semaphore(concurrency)
    with running_simulator(time_scale=0.001, startup_timeout_s=10, poll_s=0.01) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:

            async def one(prompt: list[int]) -> list[int]:
                async with gate:
                    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 600}}
                    resp = await client.post("/generate", json=body)
                assert resp.status_code == 200
                ids: list[int] = resp.json()["output_ids"]
                return ids

            started = time.monotonic()
            outputs = await asyncio.gather(*(one(p) for p in prompts))
            elapsed = time.monotonic() - started
    expected = [
        expected_output(p, max_new_tokens=600, seed=None, special=SPECIAL).output_ids for p in prompts
    ]
    assert outputs == expected
    assert sum(map(len, outputs)) / n_requests > 200
    # About 6 s alone on two cores and 12-13 s under CI's coverage tracing; a simulator that served
    # requests one at a time would take minutes (each takes about 1.3 s here, 64 at once).
    assert elapsed < 30, f"took {elapsed:.1f}s"


def test_a_simulator_logs_what_it_served(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="simulator.frontend")
    # The five requests go well within the first interval, counted from the start.
    with running_simulator(time_scale=0.0, report_interval_s=1.0) as url:
        with httpx.Client(base_url=url, timeout=10) as client:
            for _ in range(3):
                assert client.post("/generate", json={"input_ids": [1, 2, 3]}).status_code == 200
            assert client.get("/health").status_code == 200
            assert client.post("/generate", json={"input_ids": "no"}).status_code == 400

        def reported() -> list[str]:
            return [r.getMessage() for r in caplog.records if r.name == "simulator.frontend"]

        said = wait_until(reported, 5, "the simulator's report")
    assert said[0] == (
        "served 5 requests in the last 1 s (GET /health 200 x1, POST /generate 200 x3, POST /generate "
        "400 x1); 0 running, 0 waiting"
    )
    assert len(said) == 1  # nothing more while no request came
