"""Issue 36 (conversations survive Redis): a multi-turn ``all`` turn's ack and its next turn's
enqueue are one script (``ack_next_turn.lua``) that enqueues only when it counts the turn. Over a
real Redis: the next turn is enqueued once (a resent ack, a stale ack after a rebuild and an ack
of another incarnation enqueue nothing), a late ack after Redis lost the job writes no job hash at
all, and a hash such an ack of an older version left (no incarnation, no state) is no job."""

from __future__ import annotations

import pytest
import redis
from rq import Queue
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from datagen.control.enqueue import EnqueueOptions, queued_job_fields
from datagen.control.job_outcomes import QueuedTurn
from datagen.control.jobs import AckItem, AckTarget, JobStore
from datagen.control.keys import Keys, prompt_key
from datagen.control.payload import Conversation, PromptPayload
from datagen.errors import JobNotFoundError
from datagen.spec import JobSpec
from datagen.states import JobState, Priority, PromptClass
from tests.support.jobfields import add_ingest_counts

KEYS = Keys("nt")
TARGET = AckTarget(started_key="started", finished_key="finished", execution_id="x")
OPTIONS = EnqueueOptions(result_ttl_s=100, failure_ttl_s=100, max_worker_losses=2)
CONVERSATION = Conversation(
    messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
    tools=None,
    cuts=[1, 3],
    generated=["the model's first answer"],
)


@pytest.fixture
def store(redis_client: redis.Redis) -> JobStore:
    return JobStore(redis_client, KEYS)


def _running_job(store: JobStore, redis_client: redis.Redis) -> str:
    """Job j1, running, one turn (rq-a) in flight; returns its incarnation."""
    store.create("j1", JobSpec(tokenizer="tok"))
    with redis_client.pipeline() as pipe:
        add_ingest_counts(pipe, store.keys, "j1", {"rows": 1, "accepted": 1}, line=1)
        pipe.execute()
    store.finish_ingest("j1")
    store.outcomes.started("j1", "rq-a")
    incarnation = store.incarnation("j1")
    assert incarnation
    return incarnation


def _ack(incarnation: str) -> AckItem:
    return AckItem("rq-a", "j1", incarnation, 7, "chat", "short", "stop", result_ttl_s=100)


def _next_turn(redis_client: redis.Redis, incarnation: str) -> QueuedTurn:
    payload = PromptPayload(
        job="j1",
        sample_id="s1",
        turn=1,
        gen=0,
        cls=PromptClass.SHORT,
        prompt_ids=[5, 6, 7],
        max_new_tokens=16,
        partition="chat",
        conversation=CONVERSATION,
        incarnation=incarnation,
    )
    queue = Queue(KEYS.queue_name(PromptClass.SHORT), connection=redis_client, serializer=JSONSerializer)
    rq_id, fields = queued_job_fields(queue, KEYS, payload, OPTIONS)
    return QueuedTurn(
        rq_id=rq_id,
        fields=fields,
        member=prompt_key("s1", 1, 0),
        cls=PromptClass.SHORT,
        priority=Priority.NORMAL,
        prompt_tokens=3,
        queue_key=queue.key,
        queues_key=queue.redis_queues_keys,
    )


def _backlog(redis_client: redis.Redis) -> list[bytes]:
    return redis_client.lrange(KEYS.job_backlog("j1", PromptClass.SHORT), 0, -1)


def test_the_next_turn_is_enqueued_once_by_the_ack_that_counts_its_turn(
    store: JobStore, redis_client: redis.Redis
) -> None:
    incarnation = _running_job(store, redis_client)
    following = _next_turn(redis_client, incarnation)
    assert store.outcomes.ack_next_turn(TARGET, _ack(incarnation), following) is True
    progress = store.progress("j1")
    # Counted before the completion check: the job does not complete with its next turn queued.
    assert (progress.state, progress.done, progress.accepted) == (JobState.RUNNING, 1, 2)
    assert _backlog(redis_client) == [following.rq_id.encode()]
    job = Job.fetch(following.rq_id, connection=redis_client, serializer=JSONSerializer)
    assert job.get_status() is JobStatus.QUEUED and job.origin == KEYS.queue_name(PromptClass.SHORT)
    assert PromptPayload.from_json(job.args[0]).conversation == CONVERSATION
    assert redis_client.sismember(KEYS.job_enqueued("j1"), following.member)
    assert redis_client.zscore(KEYS.dispatch_jobs(PromptClass.SHORT, Priority.NORMAL), "j1") is not None
    assert store.breakdown("j1")[("accepted", "other", "short")] == 1

    # The same ack again (its reply was lost): nothing counts, nothing is enqueued twice.
    assert store.outcomes.ack_next_turn(TARGET, _ack(incarnation), following) is False
    assert _backlog(redis_client) == [following.rq_id.encode()]
    assert (store.progress("j1").done, store.progress("j1").accepted) == (1, 2)


def test_a_stale_ack_after_a_rebuild_and_an_ack_of_another_incarnation_enqueue_nothing(
    store: JobStore, redis_client: redis.Redis
) -> None:
    incarnation = _running_job(store, redis_client)
    following = _next_turn(redis_client, incarnation)
    # Rebuilt from storage: same incarnation, its running set made anew (the turn is no longer in it;
    # the rebuild enqueues the next turn itself from the records).
    redis_client.delete(KEYS.job_running("j1"))
    assert store.outcomes.ack_next_turn(TARGET, _ack(incarnation), following) is False
    store.outcomes.started("j1", "rq-a")
    assert store.outcomes.ack_next_turn(TARGET, _ack("another"), following) is False
    assert _backlog(redis_client) == []
    assert not redis_client.exists("rq:job:" + following.rq_id, KEYS.job_enqueued("j1"))
    assert (store.progress("j1").done, store.progress("j1").accepted) == (0, 1)


def test_a_late_ack_after_redis_lost_the_job_writes_no_job_hash(
    store: JobStore, redis_client: redis.Redis
) -> None:
    incarnation = _running_job(store, redis_client)
    following = _next_turn(redis_client, incarnation)
    redis_client.flushdb()  # Redis restarted empty; the worker finishing its turn does not know
    assert store.outcomes.ack_next_turn(TARGET, _ack(incarnation), following) is False
    assert redis_client.keys("*") == []  # no job hash, no backlog, no RQ job, no guard


def test_a_hash_without_incarnation_or_state_is_no_job(store: JobStore, redis_client: redis.Redis) -> None:
    incarnation = _running_job(store, redis_client)
    following = _next_turn(redis_client, incarnation)
    redis_client.flushdb()
    # What a late next-turn count of an older version left: counters, no incarnation, no state.
    redis_client.hset(KEYS.job("j1"), mapping={"accepted": 1, "prompt_tokens": 3})
    assert store.incarnation("j1") is None  # a rebuild makes the job anew over it
    with pytest.raises(JobNotFoundError):
        store.progress("j1")
    redis_client.sadd(KEYS.job_running("j1"), "rq-a")
    assert store.outcomes.ack_next_turn(TARGET, _ack(incarnation), following) is False
    assert store.outcomes.ack_done(TARGET, [_ack("")]) == 0  # nothing counts in it, even unstamped
    assert redis_client.hgetall(KEYS.job("j1")) == {b"accepted": b"1", b"prompt_tokens": b"3"}
    assert _backlog(redis_client) == []
    # A rebuild's create replaces it whole, with the stored incarnation.
    assert store.create("j1", JobSpec(tokenizer="tok"), incarnation=incarnation, replace=True)
    assert store.incarnation("j1") == incarnation
    assert store.progress("j1").accepted == 0


def test_a_next_turn_of_a_cancelled_job_counts_cancelled_and_is_not_queued(
    store: JobStore, redis_client: redis.Redis
) -> None:
    incarnation = _running_job(store, redis_client)
    following = _next_turn(redis_client, incarnation)
    assert store.cancel("j1")
    assert store.outcomes.ack_next_turn(TARGET, _ack(incarnation), following) is True
    progress = store.progress("j1")
    assert (progress.state, progress.done, progress.accepted) == (JobState.CANCELLED, 1, 2)
    assert progress.to_json()["cancelled"] == 1
    assert _backlog(redis_client) == [] and not redis_client.exists("rq:job:" + following.rq_id)
