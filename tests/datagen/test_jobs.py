from __future__ import annotations

import pytest
import redis

from datagen.control.jobs import AckItem, AckTarget, JobStore
from datagen.control.keys import Keys
from datagen.errors import JobNotFoundError
from datagen.spec import JobSpec
from datagen.states import JobState
from tests.support.jobfields import add_ingest_counts


@pytest.fixture
def store(redis_client: redis.Redis) -> JobStore:
    return JobStore(redis_client, Keys("t"))


def test_create_is_idempotent(store: JobStore) -> None:
    spec = JobSpec(tokenizer="tok")
    assert store.create("j1", spec) is True
    assert store.create("j1", spec) is False
    assert store.spec("j1") == spec
    assert store.index.list_ids() == ["j1"]
    assert store.progress("j1").state is JobState.INGESTING


def test_job_completes_when_the_last_prompt_is_counted(store: JobStore, redis_client: redis.Redis) -> None:
    store.create("j1", JobSpec(tokenizer="tok"))
    with redis_client.pipeline() as pipe:
        add_ingest_counts(pipe, store.keys, "j1", {"rows": 3, "accepted": 2, "rejected": 1}, line=3)
        pipe.execute()
    store.finish_ingest("j1")
    store.outcomes.started("j1", "rq-a")
    store.outcomes.started("j1", "rq-b")
    store.outcomes.started("j1", "rq-b")  # started again after a hand-back: still one prompt in flight
    store.outcomes.ack_done(TARGET, [_ack("j1", "rq-a", 10)])
    progress = store.progress("j1")
    assert (progress.state, progress.done, progress.in_flight, progress.output_tokens) == (
        JobState.RUNNING,
        1,
        1,
        10,
    )
    with redis_client.pipeline() as pipe:
        report = {"reason": "BadRequestError", "message": "too long"}
        store.outcomes.count_failed(pipe, "j1", "rq-b", report, partition="chat", cls="long")
        pipe.execute()
    progress = store.progress("j1")
    assert progress.state is JobState.COMPLETED
    assert progress.to_json()["failed"] == 1
    assert progress.to_json()["eta_s"] is None
    assert store.outcomes.failed_reports("j1", 10) == [{"message": "too long", "reason": "BadRequestError"}]


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
        add_ingest_counts(pipe, store.keys, "j1", {"rows": 2, "accepted": 2}, line=2)
        pipe.execute()
    store.finish_ingest("j1")
    store.outcomes.started("j1", "rq-a")
    store.outcomes.started("j1", "rq-b")
    for _ in range(2):
        store.outcomes.ack_done(TARGET, [_ack("j1", "rq-a", 10)])
    progress = store.progress("j1")
    # Counted twice, rq-a would make done 2 = accepted and complete the job with rq-b still running.
    assert (progress.state, progress.done, progress.in_flight, progress.output_tokens) == (
        JobState.RUNNING,
        1,
        1,
        10,
    )


def _ack(job: str, rq_id: str, tokens: int, *, incarnation: str = "", partition: str = "math") -> AckItem:
    return AckItem(rq_id, job, incarnation, tokens, partition, "short", "stop", result_ttl_s=100)


TARGET = AckTarget(started_key="started", finished_key="finished", execution_id="x")


def test_a_batch_ack_counts_each_prompt_once_and_finishes_it_in_rq(
    store: JobStore, redis_client: redis.Redis
) -> None:
    """Issue 11: one script finishes a shard's prompts; repeated (a lost reply), it counts nothing."""
    store.create("j1", JobSpec(tokenizer="tok"))
    with redis_client.pipeline() as pipe:
        add_ingest_counts(pipe, store.keys, "j1", {"rows": 40, "accepted": 40}, line=40)
        pipe.execute()
    store.finish_ingest("j1")
    ids = [f"rq-{i}" for i in range(40)]
    for rq_id in ids:
        store.outcomes.started("j1", rq_id)
        redis_client.hset(f"rq:job:{rq_id}", mapping={"data": "x", "status": "started"})
        redis_client.zadd("started", {f"{rq_id}:x": 1e12})
    batch = [_ack("j1", rq_id, 10) for rq_id in ids[:37]]
    assert store.outcomes.ack_done(TARGET, batch) == 37
    assert store.outcomes.ack_done(TARGET, batch) == 0  # the same batch again: counted before
    progress = store.progress("j1")
    assert (progress.state, progress.done, progress.in_flight, progress.output_tokens) == (
        JobState.RUNNING,
        37,
        3,
        370,
    )
    assert redis_client.hget("rq:job:rq-0", "status") == b"finished"
    assert 0 < redis_client.ttl("rq:job:rq-0") <= 100
    assert redis_client.zcard("started") == 3 and redis_client.zcard("finished") == 37
    fields = redis_client.hgetall(Keys("t").job("j1"))
    # 37 of 40 ended: past 95 % (38 of 40)? Not yet; the first record is known.
    assert b"first_record_at_ms" in fields and b"tail_from_ms" not in fields
    assert store.outcomes.ack_done(TARGET, [_ack("j1", "rq-37", 5)]) == 1
    assert b"tail_from_ms" in redis_client.hgetall(Keys("t").job("j1"))  # 38 of 40 = 95 %
    breakdown = redis_client.hgetall(Keys("t").job_breakdown("j1"))
    assert breakdown[b"done|other|short"] == b"38"  # "math" is not a labelled partition here
    assert breakdown[b"output_tokens|other|short"] == b"375"
    assert store.outcomes.ack_done(TARGET, [_ack("j1", "rq-38", 1), _ack("j1", "rq-39", 1)]) == 2
    assert store.progress("j1").state is JobState.COMPLETED


def test_a_batch_ack_of_another_incarnation_counts_nothing_and_leaves_rq_alone(
    store: JobStore, redis_client: redis.Redis
) -> None:
    store.create("j1", JobSpec(tokenizer="tok"))
    current = redis_client.hget(Keys("t").job("j1"), "incarnation")
    assert current
    store.outcomes.started("j1", "rq-a")
    redis_client.hset("rq:job:rq-a", mapping={"data": "x", "status": "queued"})
    assert store.outcomes.ack_done(TARGET, [_ack("j1", "rq-a", 10, incarnation="old")]) == 0
    assert redis_client.hget("rq:job:rq-a", "status") == b"queued"  # the new job's prompt
    assert store.outcomes.ack_done(TARGET, [_ack("gone", "rq-g", 10)]) == 0
    assert not redis_client.exists(Keys("t").job("gone"), Keys("t").job_running("gone"), "rq:job:rq-g")


def test_a_create_answers_what_it_made_and_a_second_what_it_found(store: JobStore) -> None:
    spec = JobSpec.model_validate({"tokenizer": "tok", "recipe": {"arms": [{"name": "low"}]}})
    ingest = store.ingest_input_fields("up.jsonl", 4096)
    made = store.create_job("j1", spec, fields=ingest, created_at_ms=1234)
    assert (made.made, made.created_at_ms) == (True, 1234)
    assert made.incarnation == store.incarnation("j1")
    # The progress answered without a read is the one a read gives.
    assert made.progress is not None
    read = store.progress("j1", with_arms=True)
    assert made.progress.to_json(at_ms=5000) == read.to_json(at_ms=5000)
    assert made.progress.arms == {"low": {"done": 0, "generated_tokens": 0}}
    # The ingest input went with the create.
    facts = store.ingest_facts("j1")
    assert facts is not None
    assert (facts.incarnation, facts.spec, facts.context_len, facts.ingest_line) == (
        made.incarnation,
        spec,
        4096,
        0,
    )
    assert store.ingest_input("j1") == "up.jsonl"
    assert not facts.waiting_for_room
    found = store.create_job("j1", spec)
    assert (found.made, found.incarnation, found.created_at_ms, found.progress) == (
        False,
        made.incarnation,
        1234,
        None,
    )


def test_ingest_facts_and_spec_and_state_of_a_job_that_is_gone(store: JobStore) -> None:
    assert store.ingest_facts("nope") is None
    assert store.spec_and_state("nope") is None
    store.create("j1", JobSpec(tokenizer="tok"))
    assert store.spec_and_state("j1") == (JobSpec(tokenizer="tok"), JobState.INGESTING)


def test_a_restart_sets_its_fields_with_the_move(store: JobStore) -> None:
    store.create("j1", JobSpec(tokenizer="tok"), fields=store.ingest_input_fields("a.jsonl", None))
    store.finish_ingest("j1")
    assert store.state("j1") is JobState.COMPLETED
    store.restart_ingest("j1", store.ingest_input_fields("b.jsonl", 2048))
    facts = store.ingest_facts("j1")
    assert facts is not None
    assert (store.state("j1"), store.ingest_input("j1"), facts.context_len) == (
        JobState.INGESTING,
        "b.jsonl",
        2048,
    )


def test_finish_ingest_moves_only_an_ingesting_job_and_drops_its_fence(
    store: JobStore, redis_client: redis.Redis
) -> None:
    keys = Keys("t")
    store.create("j1", JobSpec(tokenizer="tok"))
    with redis_client.pipeline() as pipe:
        add_ingest_counts(pipe, store.keys, "j1", {"rows": 2, "accepted": 2}, line=2)
        pipe.execute()
    assert store.ingest_fence("j1")
    store.finish_ingest("j1")
    assert store.state("j1") is JobState.RUNNING  # two prompts to run
    assert store.ingest_fence("j1") is None
    store.create("j2", JobSpec(tokenizer="tok"))
    assert store.cancel("j2")
    store.finish_ingest("j2")
    assert store.state("j2") is JobState.CANCELLED  # stays cancelled
    store.finish_ingest("gone")
    assert not redis_client.exists(keys.job("gone"))  # never recreated
