"""Routing over the fleet (``workers.fleet.servers``): least outstanding requests, free slots, paused servers;
real Redis and simulators over real HTTP."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from datagen.records.storage import Storage
from datagen.states import PromptClass
from service.fleetview import FleetView
from tests.support.sim import running_simulator
from tests.support.workers import KEYS, ingest, records, settings, start, stop
from workers.engines.http import ClientTimeouts
from workers.engines.sglang import SGLangClient
from workers.fleet.servers import Fleet, Server
from workers.metrics import WorkerMetrics


@pytest.fixture
def two_speeds(tokenizer_path: str) -> Iterator[dict[str, str]]:
    with (
        running_simulator(tokenizer_path=tokenizer_path, time_scale=0.002) as fast,
        running_simulator(tokenizer_path=tokenizer_path, time_scale=0.02) as slow,
    ):
        yield {"fast": fast, "slow": slow}


async def test_least_outstanding_routing_sends_more_to_the_faster_server(
    redis_client: redis.Redis, redis_url: str, storage: Storage, two_speeds: dict[str, str]
) -> None:
    ingest(redis_client, storage, "route", 60)
    worker = await start(settings(redis_url, storage), two_speeds, burst=True)
    try:
        await worker.run()
    finally:
        await stop(worker)
    by_server: dict[str, int] = {}
    for record in records(storage, "route"):
        by_server[record["server"]] = by_server.get(record["server"], 0) + 1
    assert sum(by_server.values()) == 60
    assert by_server["fast"] > 2 * by_server.get("slow", 0)


async def test_fleet_picks_the_server_with_most_free_slots() -> None:
    client = SGLangClient("x", "http://127.0.0.1:9", timeouts=ClientTimeouts(), max_connections=1)
    limits = {PromptClass.SHORT: 4, PromptClass.LONG: 1}
    a, b = Server("a", client, max_limits=dict(limits)), Server("b", client, max_limits=dict(limits))
    fleet = Fleet([a, b], WorkerMetrics())
    picks = [await fleet.acquire(PromptClass.SHORT) for _ in range(6)]
    assert sorted(s.name for s in picks) == ["a", "a", "a", "b", "b", "b"]
    b.paused = True
    assert fleet.capacity(PromptClass.SHORT) == 4
    assert fleet.free_slots(PromptClass.SHORT) == 1
    await fleet.release(a, PromptClass.SHORT)
    assert (await fleet.acquire(PromptClass.SHORT)) is a
    await client.aclose()


async def test_fleet_prefers_the_faster_server_among_those_with_room() -> None:
    client = SGLangClient("x", "http://127.0.0.1:9", timeouts=ClientTimeouts(), max_connections=1)
    limits = {PromptClass.SHORT: 4, PromptClass.LONG: 1}
    a, b, c, d = (Server(name, client, max_limits=dict(limits)) for name in "abcd")
    fleet = Fleet([a, b, c, d], WorkerMetrics())
    a.observe(1.0, 100)  # 10 ms a token
    b.observe(3.0, 100)  # 30 ms a token
    c.observe(1.05, 100)  # as fast as a, within measurement noise
    # d is not measured yet: it comes last.
    picks = [(await fleet.acquire(PromptClass.SHORT)).name for _ in range(16)]
    assert sorted(picks[:8]) == ["a"] * 4 + ["c"] * 4  # least outstanding among the fast ones
    assert picks[8:] == ["b"] * 4 + ["d"] * 4
    await fleet.release(b, PromptClass.SHORT)
    await fleet.release(a, PromptClass.SHORT)
    assert (await fleet.acquire(PromptClass.SHORT)) is a
    assert (await fleet.acquire(PromptClass.SHORT)) is b
    # A slot taken without waiting (backup requests): only where one is free.
    await fleet.release(c, PromptClass.SHORT)
    assert fleet.try_acquire(c, PromptClass.SHORT)
    assert not fleet.try_acquire(c, PromptClass.SHORT)
    await client.aclose()


def test_measured_speed_is_an_ewma_of_seconds_per_output_token() -> None:
    client = SGLangClient("x", "http://127.0.0.1:9", timeouts=ClientTimeouts(), max_connections=1)
    server = Server("s", client, max_limits={PromptClass.SHORT: 1, PromptClass.LONG: 1})
    assert server.s_per_token is None
    server.observe(2.0, 100)
    assert server.s_per_token == pytest.approx(0.02)
    server.observe(12.0, 100)  # latency EWMA 2 + 0.1 * 10 = 3.0 over 100 tokens
    assert server.s_per_token == pytest.approx(0.03)


async def test_pausing_a_server_moves_new_work_to_the_others(
    redis_client: redis.Redis, redis_url: str, storage: Storage, two_speeds: dict[str, str]
) -> None:
    ingest(redis_client, storage, "spause", 60)
    fleet_view = FleetView(redis_client, KEYS)
    fleet_view.redis.sadd(KEYS.paused_servers(), "fast")  # paused before the worker starts
    worker = await start(settings(redis_url, storage), two_speeds, burst=True)
    try:
        await worker.run()
    finally:
        await stop(worker)
    assert {r["server"] for r in records(storage, "spause")} == {"slow"}
    assert FleetView(redis_client, KEYS).server("fast")["state"] == "paused"


async def test_a_resumed_server_shows_up_before_the_worker_has_seen_the_resume(
    redis_client: redis.Redis, redis_url: str, storage: Storage, two_speeds: dict[str, str]
) -> None:
    fleet_view = FleetView(redis_client, KEYS)
    redis_client.sadd(KEYS.paused_servers(), "fast")
    worker = await start(settings(redis_url, storage), two_speeds)
    try:
        assert fleet_view.server("fast")["state"] == "paused"
        # What the worker published while the pause held; it has not read the resume yet.
        assert [w["state"] for w in fleet_view.server("fast")["workers"]] == ["up"]
        shown = fleet_view.set_server_paused("fast", False)
        assert (shown["state"], shown["paused"]) == ("up", False)
    finally:
        await stop(worker)


def _measured(name: str, client: SGLangClient, latency_s: float, short_limit: int) -> Server:
    server = Server(name, client, max_limits={PromptClass.SHORT: short_limit, PromptClass.LONG: 1})
    server.observe(latency_s, 100)  # 100 output tokens in latency_s
    return server


async def test_slow_servers_are_held_back_at_the_end_of_the_backlog() -> None:
    client = SGLangClient("x", "http://127.0.0.1:9", timeouts=ClientTimeouts(), max_connections=1)
    fast = _measured("fast", client, 1.0, 20)  # 10 ms a token: 20 slots end 20 requests a second
    slow = _measured("slow", client, 3.0, 20)  # 30 ms a token: a request takes 3 s here, 1 s there
    fleet = Fleet([fast, slow], WorkerMetrics())
    short = PromptClass.SHORT
    # Held when the fast server takes the backlog and its own request sooner than the slow one
    # would answer: backlog / 20 + 1 s < 3 s, i.e. fewer than 40 prompts left.
    assert fleet.held_back(short, 39) == [slow]
    assert fleet.held_back(short, 40) == []
    assert fleet.held_back(short, 0) == [slow]
    assert fleet.mixed_speeds()
    # The fast server's slots count every worker's share of it: with two workers listing it,
    # this one has 10 of its 20 slots, and the backlog still drains at 20 a second.
    fast.apply_target(1.0, 2)
    assert fast.limits[short] == 10
    assert fleet.held_back(short, 39) == [slow]
    assert fleet.held_back(short, 40) == []
    # The KV controller halved the fast server's target: 10 a second, fewer than 20 prompts.
    fast.apply_target(0.5, 1)
    assert fleet.held_back(short, 19) == [slow]
    assert fleet.held_back(short, 20) == []
    # Nothing faster takes requests: the slow server is all there is.
    fast.paused = True
    assert fleet.held_back(short, 0) == []
    assert not fleet.mixed_speeds()
    await client.aclose()


async def test_servers_about_as_fast_or_unmeasured_are_never_held_back() -> None:
    client = SGLangClient("x", "http://127.0.0.1:9", timeouts=ClientTimeouts(), max_connections=1)
    a = _measured("a", client, 1.0, 8)
    b = _measured("b", client, 1.1, 8)  # within SAME_SPEED_FACTOR of a
    c = Server("c", client, max_limits={PromptClass.SHORT: 8, PromptClass.LONG: 1})  # not measured
    fleet = Fleet([a, b, c], WorkerMetrics())
    assert fleet.held_back(PromptClass.SHORT, 0) == []
    assert not fleet.mixed_speeds()
    await client.aclose()
