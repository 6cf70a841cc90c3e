"""Wake-ups coalesce (``workers.claim.wake``): a flood of messages on the wake channel, published by
another process as fast as one Redis connection takes them, costs an idle worker (a real Worker,
real Redis, a simulator over real HTTP) a few claims a second and little CPU, and a real prompt
enqueued during the flood is still started within two wake-up windows.

Claims are counted where they cost: Redis runs each as one EVALSHA of the claim script, the only
script an idle worker runs (``INFO commandstats``)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

import redis

from datagen.control.jobs import JobStore
from datagen.records.storage import Storage
from datagen.states import JobState
from tests.support.sim import running_simulator
from tests.support.wait import wait_until_async
from tests.support.workers import KEYS, NOT_MET, WAIT_S, ingest, settings, start, stop
from workers.claim.wake import WAKE_COALESCE_S
from workers.worker import Worker

FLOOD_S = 3.0
# The publisher's floor: well beyond anything the worker could claim for one by one.
MIN_FLOOD_MESSAGES = 10_000
# Per class, one wake-driven claim a window, plus one at each end of the flood and an idle poll.
SPARE_CLAIMS = 3
# The worker's process (event loop, listener thread, idle simulator) during the flood; it used to
# take a whole core.
MAX_CPU_SHARE = 0.25
# Pipelined PUBLISHes of both classes (and some junk, which wakes every class) for argv[3] seconds;
# prints how many were published.
PUBLISHER = """
import sys, time, redis
client, channel, until = redis.Redis.from_url(sys.argv[1]), sys.argv[2], time.monotonic() + float(sys.argv[3])
sent = 0
while time.monotonic() < until:
    pipe = client.pipeline(transaction=False)
    for i in range(500):
        pipe.publish(channel, ("short", "long", "short", "junk")[i % 4])
    pipe.execute()
    sent += 500
print(sent)
"""


def _claims(client: redis.Redis) -> int:
    stats = client.info("commandstats").get("cmdstat_evalsha")
    return int(stats["calls"]) if stats else 0


@contextmanager
def _flood(redis_url: str) -> Iterator[subprocess.Popen[str]]:
    args = [sys.executable, "-c", PUBLISHER, redis_url, KEYS.wake_channel(), str(FLOOD_S)]
    with subprocess.Popen(args, stdout=subprocess.PIPE, text=True) as publisher:
        try:
            yield publisher
        finally:
            publisher.kill()


async def _published(publisher: subprocess.Popen[str]) -> int:
    out, _ = await asyncio.to_thread(publisher.communicate, None, FLOOD_S * 10)
    return int(out)


@asynccontextmanager
async def _idle_worker(redis_url: str, storage: Storage, tokenizer_path: str) -> AsyncIterator[Worker]:
    with running_simulator(tokenizer_path=tokenizer_path, time_scale=0.02) as url:
        worker = await start(settings(redis_url, storage), {"s": url})
        run = asyncio.create_task(worker.run())
        try:
            await asyncio.sleep(1.0)  # its first claims found nothing: idle, polling slowly
            yield worker
        finally:
            await stop(worker, run)


async def test_a_flood_of_wake_ups_costs_an_idle_worker_a_few_claims_a_second(
    redis_client: redis.Redis, redis_url: str, storage: Storage, tokenizer_path: str
) -> None:
    async with _idle_worker(redis_url, storage, tokenizer_path):
        claims, cpu_s, wall_s = _claims(redis_client), time.process_time(), time.monotonic()
        with _flood(redis_url) as publisher:
            published = await _published(publisher)
        claims = _claims(redis_client) - claims
        cpu_s, wall_s = time.process_time() - cpu_s, time.monotonic() - wall_s
    assert published >= MIN_FLOOD_MESSAGES
    most = 2 * (wall_s / WAKE_COALESCE_S + SPARE_CLAIMS)
    assert claims <= most, f"{claims} claims for {published} wake-ups in {wall_s:.1f} s"
    assert cpu_s <= MAX_CPU_SHARE * wall_s, f"{cpu_s:.2f} s of CPU in {wall_s:.1f} s"


async def test_a_prompt_enqueued_during_a_flood_starts_at_once(
    redis_client: redis.Redis, redis_url: str, storage: Storage, tokenizer_path: str
) -> None:
    jobs = JobStore(redis_client, KEYS)

    def started() -> bool:
        progress = jobs.progress("during_flood")
        return progress.in_flight + progress.done > 0

    async with _idle_worker(redis_url, storage, tokenizer_path):
        with _flood(redis_url) as publisher:
            await asyncio.sleep(FLOOD_S / 3)
            await asyncio.to_thread(ingest, redis_client, storage, "during_flood", 1)
            enqueued = time.monotonic()
            await wait_until_async(started, FLOOD_S, NOT_MET)
            waited_s = time.monotonic() - enqueued
            await wait_until_async(
                lambda: jobs.progress("during_flood").state is JobState.COMPLETED, WAIT_S, NOT_MET
            )
            assert await _published(publisher) >= MIN_FLOOD_MESSAGES
    # At worst its message came as the listener stopped listening (a window), and the claim loop
    # had just claimed in vain (another window); then the claim and this test's 50 ms polling.
    assert waited_s <= 2 * WAKE_COALESCE_S + 0.5, f"started {waited_s:.2f} s after its enqueue"
