from __future__ import annotations

import pytest
import redis

from datagen.errors import JobNotFoundError
from datagen.jobs import JobStore
from datagen.keys import Keys
from datagen.spec import JobSpec
from datagen.states import JobState


@pytest.fixture
def store(redis_client: redis.Redis) -> JobStore:
    return JobStore(redis_client, Keys("t"))


def test_create_is_idempotent(store: JobStore) -> None:
    spec = JobSpec(tokenizer="tok")
    assert store.create("j1", spec) is True
    assert store.create("j1", spec) is False
    assert store.spec("j1") == spec
    assert store.list_ids() == ["j1"]
    assert store.progress("j1").state is JobState.INGESTING


def test_job_completes_when_the_last_prompt_is_counted(store: JobStore, redis_client: redis.Redis) -> None:
    store.create("j1", JobSpec(tokenizer="tok"))
    with redis_client.pipeline() as pipe:
        store.add_ingest_counts(pipe, "j1", {"rows": 3, "accepted": 2, "rejected": 1}, line=3)
        pipe.execute()
    store.finish_ingest("j1")
    store.started("j1", "rq-a")
    store.started("j1", "rq-b")
    store.started("j1", "rq-b")  # started again after a hand-back: still one prompt in flight
    with redis_client.pipeline() as pipe:
        store.count_done(pipe, "j1", "rq-a", output_tokens=10, partition="math", cls="short")
        pipe.execute()
    progress = store.progress("j1")
    assert (progress.state, progress.done, progress.in_flight, progress.output_tokens) == (
        JobState.RUNNING,
        1,
        1,
        10,
    )
    with redis_client.pipeline() as pipe:
        report = {"reason": "BadRequestError", "message": "too long"}
        store.count_failed(pipe, "j1", "rq-b", report, partition="chat", cls="long")
        pipe.execute()
    progress = store.progress("j1")
    assert progress.state is JobState.COMPLETED
    assert progress.to_json()["failed"] == 1
    assert progress.to_json()["eta_s"] is None
    assert store.failed_reports("j1", 10) == [{"message": "too long", "reason": "BadRequestError"}]


def test_a_job_with_no_prompts_completes_at_end_of_ingestion(store: JobStore) -> None:
    store.create("j1", JobSpec(tokenizer="tok"))
    store.finish_ingest("j1")
    assert store.progress("j1").state is JobState.COMPLETED


def test_unknown_job(store: JobStore) -> None:
    with pytest.raises(JobNotFoundError):
        store.progress("nope")
    with pytest.raises(JobNotFoundError):
        store.spec("nope")


def test_a_prompt_finished_twice_is_counted_once(store: JobStore, redis_client: redis.Redis) -> None:
    """A stalled worker and the one that ran the prompt again after the reaper handed it back both
    finish it: the second count finds it gone from the running set and counts nothing."""
    store.create("j1", JobSpec(tokenizer="tok"))
    with redis_client.pipeline() as pipe:
        store.add_ingest_counts(pipe, "j1", {"rows": 2, "accepted": 2}, line=2)
        pipe.execute()
    store.finish_ingest("j1")
    store.started("j1", "rq-a")
    store.started("j1", "rq-b")
    for _ in range(2):
        with redis_client.pipeline() as pipe:
            store.count_done(
                pipe, "j1", "rq-a", output_tokens=10, partition="math", cls="short", finish="stop"
            )
            pipe.execute()
    progress = store.progress("j1")
    # Counted twice, rq-a would make done 2 = accepted and complete the job with rq-b still running.
    assert (progress.state, progress.done, progress.in_flight, progress.output_tokens) == (
        JobState.RUNNING,
        1,
        1,
        10,
    )
