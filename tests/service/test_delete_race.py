"""A job deleted while its last prompts are acknowledged: an ack that lands between the delete's
steps must leave nothing of the job in Redis (it did: a finished RQ hash kept for its result TTL)."""

from __future__ import annotations

import redis
from rq.job import Job

from datagen.control.dispatch import Dispatch
from datagen.control.jobs import JobStore
from datagen.records.storage import Storage
from datagen.states import PromptClass
from service.lifecycle import JobControls
from tests.support.workers import KEYS, ingest, short_identity
from workers.claim.rqbridge import InFlight, QueueIdentity
from workers.run.finish import ack_item

JOB = "delrace"


def _ack(jobs: JobStore, identity: QueueIdentity, item: InFlight) -> int:
    made = ack_item(
        item, job_id=JOB, incarnation="", output_tokens=3, partition="", cls="short", finish="stop"
    )
    return jobs.outcomes.ack_done(identity.ack_target, [made])


def _left(redis_client: redis.Redis) -> list[bytes]:
    return sorted(
        list(redis_client.scan_iter(match=f"{KEYS.job(JOB)}*"))
        + list(redis_client.scan_iter(match=f"rq:job:{KEYS.rq_job_prefix(JOB)}*"))
    )


def test_an_ack_between_the_deletes_steps_leaves_nothing_behind(
    redis_client: redis.Redis, storage: Storage
) -> None:
    ingest(redis_client, storage, JOB, 3)
    identity = short_identity(redis_client, "w-del")
    jobs = JobStore(redis_client, KEYS)
    early, late = identity.claim_many(Dispatch(redis_client, KEYS), PromptClass.SHORT, 2)
    controls = JobControls(redis_client, KEYS, jobs, storage)
    assert controls.cancel(JOB)["dropped"] == 1  # the third prompt, queued; two are in flight

    sweep = controls.rq_jobs.delete
    acked: list[int] = []

    def sweep_then_ack(job_id: str) -> int:
        deleted = sweep(job_id)
        if not acked:  # the worker's ack lands right after the first sweep
            acked.append(_ack(jobs, identity, early))
        return deleted

    controls.rq_jobs.delete = sweep_then_ack  # type: ignore[method-assign]
    answer = controls.delete(JOB)
    assert acked == [1]  # it counted in the job, which still stood, and finished the prompt in RQ
    # The two in flight went in the first sweep (the cancel dropped the queued one); the ack wrote one
    # of them back, and the delete took it again.
    assert answer["rq_jobs"] == 3
    assert _left(redis_client) == []
    assert early.job.id not in identity.queue.finished_job_registry.get_job_ids()
    # An ack after the delete finds no job: it counts nothing and writes nothing.
    assert _ack(jobs, identity, late) == 0
    assert _left(redis_client) == []
    assert not Job.exists(late.job.id, connection=redis_client)
