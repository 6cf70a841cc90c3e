"""The worker's background control (``workers.control``) over real Redis and simulators over real
HTTP: health probes, targets shared by the workers listing one server, the KV controller."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import redis

from datagen.states import PromptClass
from datagen.storage import Storage
from service.fleetview import FleetView
from tests.helpers import running_simulator
from tests.workers.worker_helpers import KEYS, eventually, ingest, settings, start, stop
from workers.control import HealthProbe
from workers.fleet import Fleet, Server
from workers.metrics import WorkerMetrics
from workers.sglang import ClientTimeouts, SGLangClient

# Health --------------------------------------------------------------------------------------------


@pytest.fixture
async def probe_setup(
    redis_client: redis.Redis, tokenizer_path: str
) -> AsyncIterator[tuple[str, Server, HealthProbe]]:
    with running_simulator(tokenizer_path=tokenizer_path, time_scale=0.0) as url:
        client = SGLangClient("s", url, timeouts=ClientTimeouts(), max_connections=2)
        server = Server("s", client, max_limits={PromptClass.SHORT: 2, PromptClass.LONG: 1}, up=False)
        fleet = Fleet([server], WorkerMetrics())
        probe = HealthProbe(
            redis_client, KEYS, fleet, server, interval_s=0.1, timeout_s=0.3, timeouts_to_down=3
        )
        yield url, server, probe
        await client.aclose()


def _chaos(url: str, **fields: Any) -> None:
    httpx.post(f"{url}/_sim/chaos", json=fields, timeout=5).raise_for_status()


async def test_health_503_marks_down_at_once_and_recovery_brings_it_back(
    probe_setup: tuple[str, Server, HealthProbe],
) -> None:
    url, server, probe = probe_setup
    await probe.probe()
    assert server.up and server.context_len == 32768  # learnt on the first healthy probe
    _chaos(url, health_status=503)
    await probe.probe()
    assert not server.up
    _chaos(url)
    await probe.probe()
    assert server.up


async def test_probe_timeouts_mark_down_only_after_k_in_a_row(
    probe_setup: tuple[str, Server, HealthProbe],
) -> None:
    url, server, probe = probe_setup
    await probe.probe()
    _chaos(url, health_delay_s=1.0)
    await probe.probe()
    await probe.probe()
    assert server.up and server.health_timeouts == 2  # slow under load is not down
    await probe.probe()
    assert not server.up
    _chaos(url)
    await probe.probe()
    assert server.up and server.health_timeouts == 0


async def test_refused_connection_marks_down_at_once(redis_client: redis.Redis) -> None:
    client = SGLangClient("gone", "http://127.0.0.1:9", timeouts=ClientTimeouts(), max_connections=1)
    server = Server("gone", client, max_limits={PromptClass.SHORT: 1, PromptClass.LONG: 1})
    probe = HealthProbe(
        redis_client,
        KEYS,
        Fleet([server], WorkerMetrics()),
        server,
        interval_s=1,
        timeout_s=1,
        timeouts_to_down=3,
    )
    await probe.probe()
    assert not server.up
    await client.aclose()


# Shared targets ------------------------------------------------------------------------------------


async def test_workers_listing_one_server_share_its_target(
    redis_client: redis.Redis, redis_url: str, storage: Storage, tokenizer_path: str
) -> None:
    with running_simulator(tokenizer_path=tokenizer_path, time_scale=0.0) as url:
        worker_settings = settings(redis_url, storage, short_concurrency=10)
        first = await start(worker_settings, {"s": url})
        second = await start(worker_settings, {"s": url})
        try:
            first.sync.sync_once()
            second.sync.sync_once()
            assert first.fleet.servers[0].limits[PromptClass.SHORT] == 5
            assert second.fleet.servers[0].limits[PromptClass.SHORT] == 5
            view = FleetView(redis_client, KEYS).server("s")
            assert view["limits"]["short"] == 10 and len(view["workers"]) == 2 and view["state"] == "up"
        finally:
            await stop(first)
            await stop(second)
        assert FleetView(redis_client, KEYS).server("s")["workers"] == []


# KV controller -------------------------------------------------------------------------------------


async def test_controller_lowers_the_target_when_work_waits_in_the_server(
    redis_client: redis.Redis, redis_url: str, storage: Storage, tokenizer_path: str
) -> None:
    ingest(redis_client, storage, "kv", 120)
    # The server runs at most 8 requests; 64 in flight would park 56 in its queue.
    with running_simulator(tokenizer_path=tokenizer_path, time_scale=0.01, max_running_requests=8) as url:
        worker = await start(
            settings(redis_url, storage, short_concurrency=64, kv_controller=True), {"s": url}
        )
        run = asyncio.create_task(worker.run())
        control_key = KEYS.server_control("s")
        await eventually(lambda: int(redis_client.hget(control_key, "target") or 65) <= 20, 20)
        reason = redis_client.hget(control_key, "reason")
        assert reason is not None and b"waiting in the server queue" in reason
        await eventually(lambda: worker.fleet.servers[0].limits[PromptClass.SHORT] <= 20, 5)
        await stop(worker, run)
