"""A worker's pre-flight checks of its servers: real simulators over HTTP, a real Redis."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest

from datagen.control.keys import Keys
from datagen.control.servers import live_servers
from datagen.records.storage import Storage
from service.fleetview import FleetView
from tests.support.sim import running_simulator
from tests.support.wait import wait_until_async
from tests.support.workers import fast_worker_settings
from workers.fleet.servers import ServerSpec
from workers.worker import Worker

NS = "pfw"
WAIT_S = 10.0
REFUSED_LOG = "refused: "


@asynccontextmanager
async def running_worker(redis_url: str, storage: Storage, servers: dict[str, str]) -> AsyncIterator[Worker]:
    settings = fast_worker_settings(redis_url, storage, NS, short_concurrency=2, long_concurrency=1)
    worker = Worker(settings, [ServerSpec(n, u) for n, u in servers.items()], install_signal_handlers=False)
    await worker.start()
    try:
        yield worker
    finally:
        await worker.drain()
        await worker.close()


async def set_chaos(url: str, **chaos: object) -> None:
    async with httpx.AsyncClient() as client:
        (await client.post(f"{url}/_sim/chaos", json=chaos)).raise_for_status()


def _refusals(caplog: pytest.LogCaptureFixture, name: str) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.getMessage().startswith(f"server {name} {REFUSED_LOG}")
    ]


async def test_a_server_running_other_weights_than_the_live_fleet_is_kept_off(
    redis_url: str, storage: Storage, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    keys = Keys(NS)
    with (
        running_simulator(time_scale=0.0, weight_version="v1") as url_a,
        running_simulator(time_scale=0.0, weight_version="v2") as url_b,
    ):
        async with (
            running_worker(redis_url, storage, {"a": url_a}) as first,
            running_worker(redis_url, storage, {"b": url_b}) as second,
        ):
            assert first.fleet.servers[0].state == "up"
            server_b = second.fleet.servers[0]
            assert (server_b.state, server_b.up) == ("refused", False)
            assert server_b.refused is not None
            assert server_b.refused.startswith(
                "server b runs model_path 'sim/deepseek-r1', weight_version 'v2' but a runs "
                "model_path 'sim/deepseek-r1', weight_version 'v1'. The worker keeps off b: restart it"
            )
            await asyncio.sleep(1.0)  # several probes: the server stays refused, logged once
            assert server_b.state == "refused"
            assert len(_refusals(caplog, "b")) == 1
            # What GET /servers shows, and what the coordinator's checks see.
            shown = FleetView(first.redis, keys).server("b")
            assert shown["state"] == "refused"
            assert shown["weight_version"] == "v2"
            assert list(shown["refused"].values()) == [server_b.refused]
            assert sorted(live_servers(first.redis, keys)) == ["a"]


async def test_one_worker_keeps_off_the_server_that_disagrees_with_its_others(
    redis_url: str, storage: Storage
) -> None:
    with (
        running_simulator(time_scale=0.0) as url_a,
        running_simulator(time_scale=0.0, served_model_name="other/model") as url_b,
    ):
        async with running_worker(redis_url, storage, {"a": url_a, "b": url_b}) as worker:
            states = {s.name: s.state for s in worker.fleet.servers}
            # Whichever answered first is accepted; the other one is kept off.
            assert sorted(states.values()) == ["refused", "up"]
            refused = next(s for s in worker.fleet.servers if s.state == "refused")
            assert "'other/model'" in str(refused.refused) and "'sim/deepseek-r1'" in str(refused.refused)


async def test_unknown_context_length_keeps_the_worker_off_until_the_server_is_fixed(
    redis_url: str, storage: Storage, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    with running_simulator(time_scale=0.0) as url:
        await set_chaos(url, hide_context_len=True)
        async with running_worker(redis_url, storage, {"s": url}) as worker:
            server = worker.fleet.servers[0]
            assert server.state == "refused"
            assert server.refused == (
                "server s reports no context length (neither /server_info context_length nor /v1/models "
                "max_model_len), so prompts cannot be sized to fit. Start SGLang with --context-length"
            )
            assert worker.fleet.capacity(next(iter(server.limits))) == 0
            await asyncio.sleep(0.6)
            assert len(_refusals(caplog, "s")) == 1

            await set_chaos(url)  # the operator fixes the server
            await wait_until_async(
                lambda: server.state == "up", WAIT_S, "timed out waiting until the fixed server is accepted"
            )
            assert server.refused is None and server.context_len == 32768
            assert "server s accepted: its pre-flight checks pass now" in caplog.messages
