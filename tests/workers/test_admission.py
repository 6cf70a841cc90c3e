"""Admission (``workers.admission``) over real Redis and a simulator over real HTTP: a paused
queue is no longer claimed from, and its in-flight prompts still finish."""

from __future__ import annotations

import asyncio

import redis

from datagen.jobs import JobStore
from datagen.states import JobState, PromptClass
from datagen.storage import Storage
from service.fleetview import FleetView
from tests.helpers import running_simulator
from tests.workers.worker_helpers import KEYS, eventually, ingest, records, settings, start, stop


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
        await eventually(lambda: queued() <= 34)
        fleet_view.set_queue_paused("short", True)
        await asyncio.sleep(2.0)
        left = queued()
        await asyncio.sleep(1.5)
        assert queued() == left > 0  # nothing dispatched after the pause took effect
        assert worker.slots.generating[PromptClass.SHORT] == 0  # in-flight requests finished
        assert fleet_view.queues()[0]["paused"] is True
        fleet_view.set_queue_paused("short", False)
        await eventually(
            lambda: JobStore(redis_client, KEYS).progress("pause").state is JobState.COMPLETED, 30
        )
        await stop(worker, run)
    assert len(records(storage, "pause")) == 40
