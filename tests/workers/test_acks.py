"""Batched acknowledgements (``workers.run.finish.Acks``) over a real Redis: the prompts of one
shard finish in RQ and count in their job with one script call, and a repeated ack counts nothing."""

from __future__ import annotations

import asyncio

import redis
from rq.job import JobStatus

from datagen.control.dispatch import Dispatch
from datagen.control.jobs import JobStore
from datagen.control.scripts import source
from datagen.records.storage import Storage
from datagen.states import JobState, PromptClass
from tests.support.workers import KEYS, ingest
from workers.claim.rqbridge import InFlight, QueueIdentity
from workers.run.finish import Acks, ack_item


def _evalsha_calls(redis_client: redis.Redis) -> int:
    return int(redis_client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


async def test_a_shards_prompts_are_acknowledged_in_one_script_call(
    redis_client: redis.Redis, storage: Storage
) -> None:
    ingest(redis_client, storage, "acks", 5)
    identity = QueueIdentity(KEYS.queue_name(PromptClass.SHORT), "w-acks", redis_client, 0.5, "1-acks")
    identity.register()
    items = identity.claim_many(Dispatch(redis_client, KEYS), PromptClass.SHORT, 5)
    assert len(items) == 5 and len(identity.in_flight) == 5
    jobs = JobStore(redis_client, KEYS)
    assert jobs.progress("acks").in_flight == 5
    acks = Acks(jobs)

    def ack(item: InFlight) -> object:
        made = ack_item(
            item, job_id="acks", incarnation="", output_tokens=7, partition="", cls="short", finish="stop"
        )
        return acks.done(identity, item, made)

    redis_client.script_load(source("ack_done"))  # as after the worker's first ack: no NOSCRIPT round
    before = _evalsha_calls(redis_client)
    await asyncio.gather(*(ack(item) for item in items))  # as the tasks of one committed shard resume
    assert _evalsha_calls(redis_client) - before == 1
    progress = jobs.progress("acks")
    assert (progress.state, progress.done, progress.in_flight, progress.output_tokens) == (
        JobState.COMPLETED,
        5,
        0,
        35,
    )
    queue = identity.queue
    assert queue.started_job_registry.count == 0 and queue.finished_job_registry.count == 5
    job = queue.fetch_job(items[0].job.id)
    assert job is not None and job.get_status() is JobStatus.FINISHED
    assert not identity.in_flight  # no more heartbeats for them
    # A lost reply retried, or a stalled worker's ack after its rescuer's: nothing counts twice.
    await ack(items[0])
    assert jobs.progress("acks").done == 5
