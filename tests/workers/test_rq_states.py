"""RQ's stored job format has several writers (docs/architecture.md, "Who writes RQ's job hashes"):
enqueue through RQ's own API, three Lua scripts that write the hash as RQ would (claim, ack, retry)
and `workers/claim/rqbridge.py` through RQ's API for the rare paths. Each state any of them writes is read
back here through RQ's own API (`Job.fetch`, `get_status`, the registries), so a script that drifts
from RQ's format fails here and not in an operator's `rq info`."""

from __future__ import annotations

import asyncio

import redis
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from datagen.control.dispatch import Dispatch
from datagen.control.jobs import JobStore
from datagen.control.keys import FINISH_PREFIX, OTHER_LABEL, BreakdownField, Keys
from datagen.records.storage import Storage
from datagen.states import JobState, PromptClass
from service.lifecycle import JobControls
from tests.support.workers import KEYS, ingest
from workers.claim.rqbridge import InFlight, QueueIdentity
from workers.run.finish import Acks, ack_item

JOB = "rqstates"


def _fetch(redis_client: redis.Redis, item: InFlight) -> Job:
    return Job.fetch(item.job.id, connection=redis_client, serializer=JSONSerializer)


async def test_every_state_our_writers_store_reads_back_through_rq(
    redis_client: redis.Redis, storage: Storage
) -> None:
    ingest(redis_client, storage, JOB, 4)
    identity = QueueIdentity(KEYS.queue_name(PromptClass.SHORT), "w-rq", redis_client, 0.5, "1-rq")
    identity.register()
    queue = identity.queue
    jobs = JobStore(redis_client, KEYS)

    # Enqueued (datagen/control/enqueue.py, RQ's API): queued, in its origin queue, data readable.
    [first_id] = [i for i in redis_client.scan_iter(f"rq:job:{KEYS.rq_job_prefix(JOB)}*", count=100)][:1]
    queued = Job.fetch(
        first_id.decode().removeprefix("rq:job:"), connection=redis_client, serializer=JSONSerializer
    )
    assert queued.get_status() is JobStatus.QUEUED
    assert queued.origin == KEYS.queue_name(PromptClass.SHORT)
    assert queued.enqueued_at is not None and queued.args

    # Claimed (claim_many.lua): started, by this worker, in the started registry.
    items = identity.claim_many(Dispatch(redis_client, KEYS), PromptClass.SHORT, 4)
    assert len(items) == 4
    for item in items:
        started = _fetch(redis_client, item)
        assert started.get_status() is JobStatus.STARTED
        assert started.worker_name == identity.name and started.started_at is not None
    assert set(queue.started_job_registry.get_job_ids()) == {item.job.id for item in items}
    done, failed, handed, cancelled = items

    # Acknowledged after its commit (ack_done.lua): finished, with its end, in the finished registry.
    made = ack_item(
        done, job_id=JOB, incarnation="", output_tokens=3, partition="", cls="short", finish="stop"
    )
    await Acks(jobs).done(identity, done, made)
    finished = _fetch(redis_client, done)
    assert finished.get_status() is JobStatus.FINISHED and finished.ended_at is not None
    assert done.job.id in queue.finished_job_registry.get_job_ids()
    # The breakdown ack_done.lua wrote reads back through the one codec (`BreakdownField`), with the
    # literals it shares with the Lua: an unlabelled partition's label, a finish reason's counter.
    written = {name for name in jobs.breakdown(JOB) if name.counter != "accepted"}
    assert written == {
        BreakdownField("done", OTHER_LABEL, "short"),
        BreakdownField("output_tokens", OTHER_LABEL, "short"),
        BreakdownField(f"{FINISH_PREFIX}stop", OTHER_LABEL, "short"),
    }
    assert BreakdownField("finish:stop", "other", "short").finish == "stop"

    # Failed (rqbridge.fail_job): failed, with its message as RQ's exception text.
    def count_failed(pipe: redis.client.Pipeline) -> None:
        report = {"reason": "fatal", "message": "boom"}
        jobs.outcomes.count_failed(pipe, JOB, failed.job.id, report, partition="", cls="short")

    identity.finish_failure(failed, "boom", count_failed)
    stored = _fetch(redis_client, failed)
    assert stored.get_status() is JobStatus.FAILED and stored.ended_at is not None
    assert failed.job.id in queue.failed_job_registry.get_job_ids()
    result = stored.latest_result()
    assert result is not None and "boom" in (result.exc_string or "")

    # Handed back (rqbridge.hand_back): queued again, at the front of its queue.
    identity.hand_back(handed, lambda pipe: jobs.outcomes.handed_back(pipe, JOB, handed.job.id))
    assert _fetch(redis_client, handed).get_status() is JobStatus.QUEUED
    assert queue.get_job_ids()[0] == handed.job.id

    # Cancelled while running (rqbridge.finish_cancelled): RQ's canceled registry.
    identity.finish_cancelled(cancelled, None)
    assert _fetch(redis_client, cancelled).get_status() is JobStatus.CANCELED
    assert cancelled.job.id in queue.canceled_job_registry.get_job_ids()

    # Retried (requeue_failed.lua): queued again, out of the failed registry, its attempts reset.
    controls = JobControls(redis_client, Keys(KEYS.namespace), jobs, storage)
    await asyncio.to_thread(controls.retry, JOB)
    retried = _fetch(redis_client, failed)
    assert retried.get_status() is JobStatus.QUEUED
    assert failed.job.id not in queue.failed_job_registry.get_job_ids()
    assert retried.meta["attempts"] == 0 and retried.meta["retried"] == 1
    assert jobs.state(JOB) is JobState.RUNNING
