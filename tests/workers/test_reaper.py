"""The reaper (``workers.claim.reaper``) over real Redis: a dead worker's prompts go back to the queue
until their job's budget of worker losses is spent, also after RQ's own registry cleanup."""

from __future__ import annotations

import time
from datetime import UTC, datetime

import redis
from rq import Queue
from rq.registry import FailedJobRegistry
from rq.serializers import JSONSerializer
from rq.utils import utcformat

from datagen.control.dispatch import Dispatch
from datagen.control.jobs import JobStore
from datagen.records.storage import Storage
from datagen.states import PromptClass
from tests.support.workers import KEYS, ingest
from workers.claim.reaper import Reaper
from workers.claim.rqbridge import QueueIdentity, heartbeat_ttl_s
from workers.metrics import WorkerMetrics

HEARTBEAT_TTL_S = heartbeat_ttl_s(0.5)


def _short_queue(redis_client: redis.Redis) -> Queue:
    return Queue(KEYS.queue_name(PromptClass.SHORT), connection=redis_client, serializer=JSONSerializer)


def _claim(redis_client: redis.Redis, name: str, *, dies: bool = True, beats_on: bool = False) -> str:
    identity = QueueIdentity(KEYS.queue_name(PromptClass.SHORT), name, redis_client, 0.5)
    identity.register()
    item = identity.claim(Dispatch(redis_client, KEYS), PromptClass.SHORT)
    assert item is not None  # the claim put it in the job's running set too (in_flight below)
    # The prompt's heartbeat lapses (the score is the expiry time), and with ``dies`` the worker's
    # own heartbeat (its RQ key, which expires with it).
    registry = item.queue.started_job_registry
    member = next(m for m in redis_client.zrange(registry.key, 0, -1) if m.decode().startswith(item.job.id))
    lapsed_s = time.time() - 1
    redis_client.zadd(registry.key, {member: lapsed_s})
    if dies:
        redis_client.delete(identity.key)
    else:  # its key lingers, from the entry's last renewal or (``beats_on``) from a later beat
        # The same instant as the entry's last renewal (its expiry less the TTL), not a fresh clock
        # reading: on a loaded machine the gap between two readings can pass for a later beat.
        last_beat = lapsed_s - identity.get_heartbeat_ttl(item.job)
        redis_client.hset(identity.key, "last_heartbeat", utcformat(datetime.fromtimestamp(last_beat, UTC)))
        if beats_on:
            identity.heartbeat()
    return item.job.id


def _reaper(redis_client: redis.Redis, queue: Queue, *, heartbeat_ttl_s: float = HEARTBEAT_TTL_S) -> Reaper:
    jobs = JobStore(redis_client, KEYS)
    return Reaper(
        redis_client,
        KEYS,
        jobs,
        [queue],
        owner="r",
        interval_s=0.01,
        heartbeat_ttl_s=heartbeat_ttl_s,
        metrics=WorkerMetrics(),
    )


def test_reaper_requeues_dead_workers_prompts_then_gives_up_on_a_killer(
    redis_client: redis.Redis, storage: Storage
) -> None:
    ingest(redis_client, storage, "reap", 3, max_worker_losses=2)
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
    [report] = jobs.outcomes.failed_reports("reap", 10)
    assert report["reason"] == "WorkerLost" and report["sample_id"] == "p0"


def test_rqs_own_cleanup_follows_the_same_budget_and_is_reconciled(
    redis_client: redis.Redis, storage: Storage
) -> None:
    """rq info / rq-dashboard run RQ's registry cleanup; it must not lose a prompt either."""
    ingest(redis_client, storage, "reap", 2, max_worker_losses=1)
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


def test_a_stall_holds_the_reaper_for_a_heartbeat_ttl(redis_client: redis.Redis, storage: Storage) -> None:
    """Redis (or the process) stalled longer than half a TTL: every heartbeat lapsed, so nothing is
    reaped until live workers have had a TTL to beat again."""
    ingest(redis_client, storage, "stall", 1)
    queue = _short_queue(redis_client)
    reaper = _reaper(redis_client, queue, heartbeat_ttl_s=0.4)
    victim = _claim(redis_client, "w1")
    time.sleep(0.3)  # no round trip for more than half a TTL
    assert reaper.reap_once().requeued == 0
    assert reaper.reap_once().requeued == 0  # still within the TTL after the stall
    time.sleep(0.45)  # the reaper lock expired; a gap under half a TTL would not hold again...
    reaper._last_round_trip = time.monotonic()  # ...so pretend passes ran every interval meanwhile
    assert reaper.reap_once().requeued == 1
    assert queue.get_job_ids() == [victim]


def test_a_prompt_whose_worker_still_beats_is_requeued_uncharged(
    redis_client: redis.Redis, storage: Storage
) -> None:
    ingest(redis_client, storage, "alive", 1, max_worker_losses=1)
    queue = _short_queue(redis_client)
    reaper = _reaper(redis_client, queue)
    victim = _claim(redis_client, "w1", dies=False, beats_on=True)
    result = reaper.reap_once()
    assert (result.requeued, result.uncharged, result.failed) == (1, 1, 0)
    assert queue.get_job_ids() == [victim]
    assert queue.fetch_job(victim).retries_left == 1  # no worker loss spent


def test_a_killed_workers_lingering_key_does_not_spare_the_retry(
    redis_client: redis.Redis, storage: Storage
) -> None:
    """Its key expires a moment after its prompts' entries, with their last heartbeat."""
    ingest(redis_client, storage, "killed", 1, max_worker_losses=2)
    queue = _short_queue(redis_client)
    victim = _claim(redis_client, "w1", dies=False)
    result = _reaper(redis_client, queue).reap_once()
    assert (result.requeued, result.uncharged, result.failed) == (1, 0, 0)
    assert queue.fetch_job(victim).retries_left == 1
