"""The finisher (``workers.run.finish``) over real Redis/RQ: a prompt that fails after its job was
deleted, or after its id was reused by a new job, leaves nothing in Redis and touches no new job."""

from __future__ import annotations

import pytest
import redis
from rq.job import Job, JobStatus

from datagen.control.dispatch import Dispatch
from datagen.control.jobs import JobStore
from datagen.control.payload import ParsedPayload, parse_payload
from datagen.control.rq_format import payload_of
from datagen.errors import FatalError
from datagen.records.storage import Storage
from datagen.states import PromptClass
from service.lifecycle import JobControls
from tests.support.workers import KEYS, ingest, short_identity
from workers.claim.rqbridge import InFlight, QueueIdentity
from workers.metrics import WorkerMetrics
from workers.run.conversation import Conversations
from workers.run.finish import Acks, Finisher
from workers.run.jobinfo import JobInfos

JOB = "fin"


def _finisher(redis_client: redis.Redis, storage: Storage, identity: QueueIdentity) -> Finisher:
    jobs = JobStore(redis_client, KEYS)
    infos = JobInfos(jobs)
    metrics = WorkerMetrics()
    return Finisher(
        redis_client,
        KEYS,
        jobs,
        Dispatch(redis_client, KEYS),
        {PromptClass.SHORT: identity},
        metrics,
        infos,
        Acks(jobs),
        Conversations(infos, [], storage, metrics),
    )


def _claim(redis_client: redis.Redis, identity: QueueIdentity) -> InFlight:
    [item] = identity.claim_many(Dispatch(redis_client, KEYS), PromptClass.SHORT, 1)
    return item


def _running_then_deleted(
    redis_client: redis.Redis, storage: Storage
) -> tuple[QueueIdentity, InFlight, ParsedPayload]:
    """A one-prompt job whose prompt runs in a worker while the job is cancelled and deleted."""
    ingest(redis_client, storage, JOB, 1)
    identity = short_identity(redis_client, "w-fin")
    item = _claim(redis_client, identity)
    controls = JobControls(redis_client, KEYS, JobStore(redis_client, KEYS), storage)
    controls.cancel(JOB)
    controls.delete(JOB)
    return identity, item, parse_payload(payload_of(item.job))


def test_a_prompt_failing_after_its_job_was_deleted_writes_nothing_back(
    redis_client: redis.Redis, storage: Storage
) -> None:
    identity, item, parsed = _running_then_deleted(redis_client, storage)

    _finisher(redis_client, storage, identity).fail(identity, item, parsed, FatalError("the server said no"))

    assert not Job.exists(item.job.id, connection=redis_client)
    assert identity.queue.failed_job_registry.get_job_ids() == []
    assert identity.queue.started_job_registry.get_job_ids() == []
    assert list(redis_client.scan_iter(match=f"{KEYS.job(JOB)}*")) == []


@pytest.mark.parametrize("end", ["fail", "hand_back"])
def test_a_prompt_ending_after_its_id_was_reused_leaves_the_new_jobs_prompt_queued_once(
    redis_client: redis.Redis, storage: Storage, end: str
) -> None:
    identity, old, parsed = _running_then_deleted(redis_client, storage)
    ingest(redis_client, storage, JOB, 1)  # the same id and rows: the same RQ id, a new incarnation
    assert Job.fetch(old.job.id, connection=redis_client).get_status() is JobStatus.QUEUED

    finisher = _finisher(redis_client, storage, identity)
    if end == "fail":
        finisher.fail(identity, old, parsed, FatalError("the server said no"))
    else:  # the worker drains while the old prompt runs
        finisher.hand_back(identity, old, parsed)

    assert Job.fetch(old.job.id, connection=redis_client).get_status() is JobStatus.QUEUED
    assert identity.queue.failed_job_registry.get_job_ids() == []
    assert identity.queue.get_job_ids() == []  # only in the new job's backlog: it runs once
    progress = JobStore(redis_client, KEYS).progress(JOB)
    assert (progress.failed, progress.done, progress.in_flight) == (0, 0, 0)
    assert _claim(redis_client, identity).job.id == old.job.id
    assert identity.claim_many(Dispatch(redis_client, KEYS), PromptClass.SHORT, 1) == []
