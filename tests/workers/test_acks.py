"""Batched acknowledgements (``workers.run.finish.Acks``) over a real Redis: the prompts of one
shard finish in RQ and count in their job with one script call, and a repeated ack counts nothing."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable

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


def _claimed(
    redis_client: redis.Redis, storage: Storage, job_id: str, n: int
) -> tuple[QueueIdentity, list[InFlight]]:
    """A job of ``n`` prompts, all claimed by one registered worker identity."""
    ingest(redis_client, storage, job_id, n)
    identity = QueueIdentity(
        KEYS.queue_name(PromptClass.SHORT), f"w-{job_id}", redis_client, 0.5, f"1-{job_id}"
    )
    identity.register()
    return identity, identity.claim_many(Dispatch(redis_client, KEYS), PromptClass.SHORT, n)


def _acker(
    jobs: JobStore, identity: QueueIdentity, job_id: str, *, partition: str
) -> Callable[[InFlight], Awaitable[object]]:
    """Acknowledges one claimed prompt done (7 output tokens, finish ``stop``), batched by ``Acks``
    as the tasks of one committed shard are."""
    acks = Acks(jobs)

    def ack(item: InFlight) -> Awaitable[object]:
        made = ack_item(
            item,
            job_id=job_id,
            incarnation="",
            output_tokens=7,
            partition=partition,
            cls="short",
            finish="stop",
        )
        return acks.done(identity, item, made)

    return ack


async def test_a_shards_prompts_are_acknowledged_in_one_script_call(
    redis_client: redis.Redis, storage: Storage
) -> None:
    identity, items = _claimed(redis_client, storage, "acks", 5)
    assert len(items) == 5 and len(identity.in_flight) == 5
    jobs = JobStore(redis_client, KEYS)
    assert jobs.progress("acks").in_flight == 5
    ack = _acker(jobs, identity, "acks", partition="")

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


def _commands(redis_client: redis.Redis) -> Counter[str]:
    """Calls per command so far (Redis counts a script's commands too)."""
    return Counter(
        {
            name.removeprefix("cmdstat_"): int(stat["calls"])
            for name, stat in redis_client.info("commandstats").items()
        }
    )


async def test_a_shards_ack_reads_and_writes_its_job_once_and_keeps_counts_exact(
    redis_client: redis.Redis, storage: Storage
) -> None:
    identity, items = _claimed(redis_client, storage, "acks3", 3)
    assert len(items) == 3
    jobs = JobStore(redis_client, KEYS)
    # Counters past 15 digits, where Lua's own number printing turns to exponents.
    redis_client.hset(KEYS.job("acks3"), "output_tokens", 999_999_999_999_999)
    ack = _acker(jobs, identity, "acks3", partition="default")

    redis_client.script_load(source("ack_done"))
    before = _commands(redis_client)
    await asyncio.gather(*(ack(item) for item in items))
    spent = _commands(redis_client) - before
    del spent["info"]  # the INFO that read ``before``
    # Written out by hand: the call; the started registry's ZREM; the job read once (HMGET, its
    # partition's label with it) and written once (HSET); which prompts ran (SMISMEMBER); per
    # prompt RQ's finished hash and TTL (HSET, EXPIRE); the breakdown's three counters read and
    # written once (HMGET, HSET); the running set dropped as the job completes (DEL, no SREM); the
    # finished registry (ZADD). Each rule's own HINCRBY, HSETNX and HMGET cost 15 on the job before.
    assert spent == Counter(
        {
            "evalsha": 1,
            "zrem": 1,
            "hmget": 2,
            "hset": 5,
            "smismember": 1,
            "expire": 3,
            "del": 1,
            "zadd": 1,
        }
    ), spent
    job = redis_client.hgetall(KEYS.job("acks3"))
    assert job[b"output_tokens"] == b"1000000000000020"  # 999,999,999,999,999 + 3 x 7
    assert (job[b"done"], job[b"state"]) == (b"3", b"completed")
    assert int(job[b"first_record_at_ms"]) == int(job[b"tail_from_ms"]) == int(job[b"finished_at_ms"]) > 0
    assert redis_client.hgetall(KEYS.job_breakdown("acks3")) == {
        b"accepted|default|short": b"3",
        b"done|default|short": b"3",
        b"output_tokens|default|short": b"21",
        b"finish:stop|default|short": b"3",
    }
    assert not redis_client.exists(KEYS.job_running("acks3"))
