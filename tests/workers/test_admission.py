"""Admission (``workers.claim.admission``) over real Redis and simulators over real HTTP: a paused
queue is no longer claimed from, and its in-flight prompts still finish; at the end of a backlog
a slow server starts nothing new."""

from __future__ import annotations

import asyncio

import redis

from datagen.control.jobs import JobStore
from datagen.records.storage import Storage
from datagen.states import JobState, PromptClass
from service.fleetview import FleetView
from tests.support.sim import running_simulator
from tests.support.wait import wait_until_async
from tests.support.workers import KEYS, NOT_MET, WAIT_S, ingest, records, settings, start, stop
from workers.claim.admission import BACKLOG_REFRESH_S


async def test_pausing_a_queue_stops_dispatch_within_two_seconds(
    redis_client: redis.Redis, redis_url: str, storage: Storage, tokenizer_path: str
) -> None:
    ingest(redis_client, storage, "pause", 40)
    fleet_view = FleetView(redis_client, KEYS)

    def queued() -> int:
        return int(fleet_view.queues()[0]["queued"])

    with running_simulator(tokenizer_path=tokenizer_path, time_scale=0.02) as url:
        worker = await start(settings(redis_url, storage), {"s": url})
        run = asyncio.create_task(worker.run())
        await wait_until_async(lambda: queued() <= 34, WAIT_S, NOT_MET)
        fleet_view.set_queue_paused("short", True)
        await asyncio.sleep(2.0)
        left = queued()
        await asyncio.sleep(1.5)
        assert queued() == left > 0  # nothing dispatched after the pause took effect
        assert worker.slots.generating[PromptClass.SHORT] == 0  # in-flight requests finished
        assert fleet_view.queues()[0]["paused"] is True
        fleet_view.set_queue_paused("short", False)
        await wait_until_async(
            lambda: JobStore(redis_client, KEYS).progress("pause").state is JobState.COMPLETED, 30, NOT_MET
        )
        await stop(worker, run)
    assert len(records(storage, "pause")) == 40


async def test_the_slow_server_starts_nothing_new_at_the_end_of_the_backlog(
    redis_client: redis.Redis, redis_url: str, storage: Storage, tokenizer_path: str
) -> None:
    short = PromptClass.SHORT
    with (
        running_simulator(tokenizer_path=tokenizer_path) as fast_url,
        running_simulator(tokenizer_path=tokenizer_path) as slow_url,
    ):
        worker = await start(settings(redis_url, storage), {"fast": fast_url, "slow": slow_url})
        admission = worker.admission

        def free() -> int:
            return admission._free(short, admission._end_of_backlog(short))

        try:
            fast, slow = worker.fleet.servers
            assert free() == 8  # not measured yet: 4 slots on each
            fast.observe(1.0, 100)  # 10 ms a token: its 4 slots end 4 requests a second
            slow.observe(3.0, 100)  # 30 ms a token
            # 5 prompts left: the fast server takes them all in 1.25 s and answers the last 1 s
            # later, before a request started on the slow one now (3 s) would.
            ingest(redis_client, storage, "endgame", 5)
            assert free() == 4
            # 15 left (another job; the backlog is read again after BACKLOG_REFRESH_S): 3.75 s + 1 s
            # on the fast one, later than 3 s on the slow one, which gets work again.
            ingest(redis_client, storage, "endgame2", 10)
            await asyncio.sleep(BACKLOG_REFRESH_S)
            assert free() == 8
        finally:
            await stop(worker)


async def test_a_claim_gathers_the_slots_that_free_within_a_fiftieth_of_a_request(
    redis_client: redis.Redis, redis_url: str, storage: Storage, tokenizer_path: str
) -> None:
    short = PromptClass.SHORT
    with running_simulator(tokenizer_path=tokenizer_path) as url:
        worker = await start(settings(redis_url, storage), {"s": url})
        admission, slots = worker.admission, worker.slots
        try:
            (server,) = worker.fleet.servers
            assert admission._gather_s() == 0.005  # nothing measured yet: the floor
            server.observe(1.0, 100)
            assert admission._gather_s() == 0.02  # 2 % of a 1-s request
            server.observe(60.0, 100)
            assert admission._gather_s() == 0.1  # the ceiling: a run's last claims wait no longer

            # 64 slots, all busy; three end 10 ms apart, fewer than a batch (a quarter of the slots):
            # one claim waits the window and takes all three.
            server.limits[short] = 64
            capacity = worker.fleet.capacity(short)
            slots.generating[short] = capacity

            async def end_one_by_one() -> None:
                for _ in range(3):
                    await asyncio.sleep(0.01)
                    slots.generating[short] -= 1
                    slots.freed.set()

            ending = asyncio.create_task(end_one_by_one())
            started = asyncio.get_running_loop().time()
            free = await admission._gather(short, 0, None)
            waited_s = asyncio.get_running_loop().time() - started
            await ending
            assert free == 3
            assert 0.09 <= waited_s < 0.5  # the window, not the first freed slot
            slots.generating[short] = 0
        finally:
            await stop(worker)


async def test_the_worker_counts_its_claims_and_the_prompts_they_started(
    redis_client: redis.Redis, redis_url: str, storage: Storage, tokenizer_path: str
) -> None:
    ingest(redis_client, storage, "counted", 12)
    with running_simulator(tokenizer_path=tokenizer_path, time_scale=0.02) as url:
        worker = await start(settings(redis_url, storage), {"s": url})
        run = asyncio.create_task(worker.run())
        await wait_until_async(
            lambda: JobStore(redis_client, KEYS).progress("counted").state is JobState.COMPLETED,
            WAIT_S,
            NOT_MET,
        )
        admission = worker.admission
        await stop(worker, run)
    assert admission.claimed_prompts == 12
    assert 1 <= admission.claims <= 12
    metrics = worker.fleet.metrics
    assert metrics.claimed_prompts.labels("short")._value.get() == 12
    assert metrics.claims.labels("short")._value.get() == admission.claims
