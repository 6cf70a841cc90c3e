"""The worker engine over real Redis and simulators over real HTTP: routing, health, pauses,
shared targets, the KV controller and the reaper."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
import redis
from rq import Queue
from rq.registry import FailedJobRegistry
from rq.serializers import JSONSerializer

from datagen.dispatch import Dispatch
from datagen.jobs import JobStore
from datagen.keys import Keys
from datagen.settings import WorkerSettings
from datagen.spec import JobSpec
from datagen.states import JobState, PromptClass
from datagen.storage import Storage
from datagen.tokenization import bundled_tokenizer_path, default_chat_template_path
from service.fleetview import FleetView
from tests.helpers import fast_worker_settings, ingest_rows, running_simulator
from workers.control import HealthProbe
from workers.fleet import Fleet, Server, ServerSpec
from workers.metrics import WorkerMetrics
from workers.reaper import Reaper
from workers.rqbridge import QueueIdentity
from workers.sglang import ClientTimeouts, SGLangClient
from workers.worker import Worker

NS = "eng"
KEYS = Keys(NS)


def _ingest(
    redis_client: redis.Redis,
    storage: Storage,
    job_id: str,
    n: int,
    *,
    max_worker_losses: int = 3,
    **spec: Any,
) -> None:
    values: dict[str, Any] = {
        "tokenizer": bundled_tokenizer_path(),
        "chat_template": str(default_chat_template_path()),
        "short_max_new_tokens": 400,
        "long_threshold_tokens": 100_000,
        "sampling": {"sampling_seed": 3},
        **spec,
    }
    rows = [
        {"id": f"p{i}", "messages": [{"role": "user", "content": f"prompt number {i}"}]} for i in range(n)
    ]
    ingest_rows(
        redis_client,
        storage,
        KEYS,
        job_id,
        JobSpec.model_validate(values),
        rows,
        max_worker_losses=max_worker_losses,
    )


def _settings(redis_url: str, storage: Storage, **overrides: Any) -> WorkerSettings:
    values = {"short_concurrency": 4, "long_concurrency": 1, "drain_timeout_s": 10, "kv_controller": False}
    return fast_worker_settings(redis_url, storage, NS, **{**values, **overrides})


async def _start(settings: WorkerSettings, servers: dict[str, str], *, burst: bool = False) -> Worker:
    specs = [ServerSpec(name, url) for name, url in servers.items()]
    worker = Worker(settings, specs, burst=burst, install_signal_handlers=False)
    await worker.start()
    return worker


async def _stop(worker: Worker, run: asyncio.Task[None] | None = None) -> None:
    await worker.drain()
    if run is not None:
        await run
    await worker.close()


def _records(storage: Storage, job_id: str) -> list[dict[str, Any]]:
    return [row for batch in storage.iter_record_batches(job_id) for row in batch.to_pylist()]


def _short_queue(redis_client: redis.Redis) -> Queue:
    return Queue(KEYS.queue_name(PromptClass.SHORT), connection=redis_client, serializer=JSONSerializer)


async def _eventually(predicate: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.05)


@pytest.fixture
def two_speeds(tokenizer_path: str) -> Iterator[dict[str, str]]:
    with (
        running_simulator(tokenizer_path=tokenizer_path, time_scale=0.002) as fast,
        running_simulator(tokenizer_path=tokenizer_path, time_scale=0.02) as slow,
    ):
        yield {"fast": fast, "slow": slow}


# Routing -------------------------------------------------------------------------------------------


async def test_least_outstanding_routing_sends_more_to_the_faster_server(
    redis_client: redis.Redis, redis_url: str, storage: Storage, two_speeds: dict[str, str]
) -> None:
    _ingest(redis_client, storage, "route", 60)
    worker = await _start(_settings(redis_url, storage), two_speeds, burst=True)
    try:
        await worker.run()
    finally:
        await _stop(worker)
    by_server: dict[str, int] = {}
    for record in _records(storage, "route"):
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


# Pause and drain -----------------------------------------------------------------------------------


async def test_pausing_a_queue_stops_dispatch_within_two_seconds(
    redis_client: redis.Redis, redis_url: str, storage: Storage, tokenizer_path: str
) -> None:
    _ingest(redis_client, storage, "pause", 40)
    fleet_view = FleetView(redis_client, KEYS)

    def queued() -> int:
        return int(fleet_view.queues()[0]["queued"])

    with running_simulator(tokenizer_path=tokenizer_path, time_scale=0.02) as url:
        worker = await _start(_settings(redis_url, storage), {"s": url})
        run = asyncio.create_task(worker.run())
        await _eventually(lambda: queued() <= 34)
        fleet_view.set_queue_paused("short", True)
        await asyncio.sleep(2.0)
        left = queued()
        await asyncio.sleep(1.5)
        assert queued() == left > 0  # nothing dispatched after the pause took effect
        assert worker._generating[PromptClass.SHORT] == 0  # in-flight requests finished
        assert fleet_view.queues()[0]["paused"] is True
        fleet_view.set_queue_paused("short", False)
        await _eventually(
            lambda: JobStore(redis_client, KEYS).progress("pause").state is JobState.COMPLETED, 30
        )
        await _stop(worker, run)
    assert len(_records(storage, "pause")) == 40


async def test_pausing_a_server_moves_new_work_to_the_others(
    redis_client: redis.Redis, redis_url: str, storage: Storage, two_speeds: dict[str, str]
) -> None:
    _ingest(redis_client, storage, "spause", 60)
    fleet_view = FleetView(redis_client, KEYS)
    fleet_view.redis.sadd(KEYS.paused_servers(), "fast")  # paused before the worker starts
    worker = await _start(_settings(redis_url, storage), two_speeds, burst=True)
    try:
        await worker.run()
    finally:
        await _stop(worker)
    assert {r["server"] for r in _records(storage, "spause")} == {"slow"}
    assert FleetView(redis_client, KEYS).server("fast")["state"] == "paused"


async def test_workers_listing_one_server_share_its_target(
    redis_client: redis.Redis, redis_url: str, storage: Storage, tokenizer_path: str
) -> None:
    with running_simulator(tokenizer_path=tokenizer_path, time_scale=0.0) as url:
        settings = _settings(redis_url, storage, short_concurrency=10)
        first = await _start(settings, {"s": url})
        second = await _start(settings, {"s": url})
        try:
            first.sync.sync_once()
            second.sync.sync_once()
            assert first.fleet.servers[0].limits[PromptClass.SHORT] == 5
            assert second.fleet.servers[0].limits[PromptClass.SHORT] == 5
            view = FleetView(redis_client, KEYS).server("s")
            assert view["limits"]["short"] == 10 and len(view["workers"]) == 2 and view["state"] == "up"
        finally:
            await _stop(first)
            await _stop(second)
        assert FleetView(redis_client, KEYS).server("s")["workers"] == []


# KV controller -------------------------------------------------------------------------------------


async def test_controller_lowers_the_target_when_work_waits_in_the_server(
    redis_client: redis.Redis, redis_url: str, storage: Storage, tokenizer_path: str
) -> None:
    _ingest(redis_client, storage, "kv", 120)
    # The server runs at most 8 requests; 64 in flight would park 56 in its queue.
    with running_simulator(tokenizer_path=tokenizer_path, time_scale=0.01, max_running_requests=8) as url:
        settings = _settings(redis_url, storage, short_concurrency=64, kv_controller=True)
        worker = await _start(settings, {"s": url})
        run = asyncio.create_task(worker.run())
        control_key = KEYS.server_control("s")
        await _eventually(lambda: int(redis_client.hget(control_key, "target") or 65) <= 20, 20)
        reason = redis_client.hget(control_key, "reason")
        assert reason is not None and b"waiting in the server queue" in reason
        await _eventually(lambda: worker.fleet.servers[0].limits[PromptClass.SHORT] <= 20, 5)
        await _stop(worker, run)


# Reaper --------------------------------------------------------------------------------------------


def _claim(redis_client: redis.Redis, name: str) -> str:
    identity = QueueIdentity(KEYS.queue_name(PromptClass.SHORT), name, redis_client, 0.5)
    identity.register()
    item = identity.claim(Dispatch(redis_client, KEYS), PromptClass.SHORT)
    assert item is not None
    JobStore(redis_client, KEYS).started("reap", item.job.id)
    # The worker dies: its heartbeat lapses (the score is the expiry time).
    registry = item.queue.started_job_registry
    member = next(m for m in redis_client.zrange(registry.key, 0, -1) if m.decode().startswith(item.job.id))
    redis_client.zadd(registry.key, {member: time.time() - 1})
    return item.job.id


def _reaper(redis_client: redis.Redis, queue: Queue) -> Reaper:
    jobs = JobStore(redis_client, KEYS)
    return Reaper(redis_client, KEYS, jobs, [queue], owner="r", interval_s=0.01, metrics=WorkerMetrics())


def test_reaper_requeues_dead_workers_prompts_then_gives_up_on_a_killer(
    redis_client: redis.Redis, storage: Storage
) -> None:
    _ingest(redis_client, storage, "reap", 3, max_worker_losses=2)
    queue = _short_queue(redis_client)
    jobs = JobStore(redis_client, KEYS)
    reaper = _reaper(redis_client, queue)
    victim = _claim(redis_client, "w1")
    assert jobs.progress("reap").in_flight == 1
    result = reaper.reap_once()
    assert (result.requeued, result.failed) == (1, 0)
    assert queue.get_job_ids()[0] == victim  # at the front, uncharged
    job = queue.fetch_job(victim)
    assert job.meta.get("attempts", 0) == 0 and job.retries_left == 1
    assert jobs.progress("reap").in_flight == 0
    outcomes = []
    for n in range(2, 4):
        time.sleep(0.02)  # the reaper lock of the previous pass expires
        assert _claim(redis_client, f"w{n}") == victim
        result = reaper.reap_once()
        outcomes.append((result.requeued, result.failed))
    assert outcomes == [(1, 0), (0, 1)]  # the third dead worker is one too many
    assert FailedJobRegistry(queue=queue).get_job_ids(cleanup=False) == [victim]
    progress = jobs.progress("reap")
    assert (progress.failed, progress.in_flight) == (1, 0)
    [report] = jobs.failed_reports("reap", 10)
    assert report["reason"] == "WorkerLost" and report["sample_id"] == "p0"


def test_rqs_own_cleanup_follows_the_same_budget_and_is_reconciled(
    redis_client: redis.Redis, storage: Storage
) -> None:
    """rq info / rq-dashboard run RQ's registry cleanup; it must not lose a prompt either."""
    _ingest(redis_client, storage, "reap", 2, max_worker_losses=1)
    queue = _short_queue(redis_client)
    jobs = JobStore(redis_client, KEYS)
    victim = _claim(redis_client, "w1")
    queue.started_job_registry.cleanup()  # RQ's own: a retry is left, so it requeues
    assert victim in queue.get_job_ids()
    assert FailedJobRegistry(queue=queue).get_job_ids(cleanup=False) == []
    assert queue.get_job_ids() == [victim]  # RQ requeues onto its queue (p1 is in the job's backlog)
    assert _claim(redis_client, "w2") == victim  # what is on RQ's queue goes before any backlog
    queue.started_job_registry.cleanup()  # no retry left: RQ fails it as abandoned
    assert victim in FailedJobRegistry(queue=queue).get_job_ids(cleanup=False)
    assert jobs.progress("reap").failed == 0  # not yet counted by the job ...
    _reaper(redis_client, queue).reap_once()
    progress = jobs.progress("reap")
    assert progress.failed == 1  # ... until the reaper reconciles it, once
    _reaper(redis_client, queue).reap_once()
    assert jobs.progress("reap").failed == 1
