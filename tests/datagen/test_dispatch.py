"""The dispatch scripts against a real Redis: priority, weighted fair share, pause, cancel."""

from __future__ import annotations

import redis

from datagen.dispatch import Dispatch
from datagen.jobs import JobStore
from datagen.keys import Keys
from datagen.spec import JobSpec
from datagen.states import JobState, Priority, PromptClass
from datagen.tokenization import bundled_tokenizer_path

NS = "disp"
SHORT = PromptClass.SHORT
QUEUE = "q"
INTERMEDIATE = "q:intermediate"


def _job(redis_client: redis.Redis, job_id: str, n: int, **spec: object) -> None:
    keys = Keys(NS)
    JobStore(redis_client, keys).create(job_id, JobSpec(tokenizer=bundled_tokenizer_path(), **spec))  # type: ignore[arg-type]
    dispatch = Dispatch(redis_client, keys)
    priority = Priority(str(spec.get("priority", "normal")))
    with redis_client.pipeline() as pipe:
        dispatch.add(pipe, job_id, SHORT, priority, [f"{job_id}-{i}" for i in range(n)])
        pipe.execute()


def _claims(dispatch: Dispatch, n: int) -> list[str]:
    out = []
    for _ in range(n):
        rq_id = dispatch.claim(SHORT, QUEUE, INTERMEDIATE)
        if rq_id is None:
            break
        out.append(rq_id.split("-")[0])
    return out


def test_weights_decide_the_order_within_a_priority(redis_client: redis.Redis) -> None:
    _job(redis_client, "a", 30, weight=3.0)
    _job(redis_client, "b", 30)
    dispatch = Dispatch(redis_client, Keys(NS))
    order = _claims(dispatch, 40)
    # Written by hand: stride scheduling with passes 1/3 for a and 1 for b, ties to the
    # lexically first id.
    assert order[:8] == ["a", "b", "a", "a", "a", "b", "a", "a"]
    assert order.count("a") == 30 and order.count("b") == 10  # exactly 3:1 while both have work
    # Each claim moved the RQ id into the intermediate list, as RQ's own LMOVE does.
    assert redis_client.llen(INTERMEDIATE) == 40
    shares = dispatch.shares()
    assert (shares["b"].target, shares["b"].active) == (1.0, True)  # a ran dry: b has the fleet
    assert shares["a"].dispatched == 30 and round(shares["a"].recent, 2) == 0.75


def test_high_priority_first_and_handed_back_prompts_before_all(redis_client: redis.Redis) -> None:
    _job(redis_client, "bulk", 5)
    _job(redis_client, "urgent", 2, priority="high")
    redis_client.rpush(QUEUE, "back-1")  # a prompt handed back by a stopping worker
    dispatch = Dispatch(redis_client, Keys(NS))
    assert _claims(dispatch, 10) == ["back", "urgent", "urgent", "bulk", "bulk", "bulk", "bulk", "bulk"]
    assert not dispatch.has_work(SHORT)


def test_a_paused_job_waits_and_resumes_without_a_catch_up_burst(redis_client: redis.Redis) -> None:
    _job(redis_client, "a", 20)
    _job(redis_client, "b", 20)
    dispatch = Dispatch(redis_client, Keys(NS))
    dispatch.pause("a")
    assert _claims(dispatch, 6) == ["b"] * 6
    assert dispatch.shares()["a"].target == 0.0 and dispatch.shares()["b"].target == 1.0
    dispatch.resume("a")
    # a starts level with b, so they alternate instead of a taking six in a row.
    assert _claims(dispatch, 6) == ["a", "b", "a", "b", "a", "b"]
    assert dispatch.depth(SHORT) == 40 - 12


def test_a_cancelled_job_takes_no_prompts_and_withdraw_counts_them(redis_client: redis.Redis) -> None:
    keys = Keys(NS)
    jobs = JobStore(redis_client, keys)
    _job(redis_client, "c", 5)
    dispatch = Dispatch(redis_client, keys)
    assert jobs.transition("c", (JobState.INGESTING, JobState.RUNNING), JobState.CANCELLED)
    assert dispatch.withdraw("c") == 5
    _job(redis_client, "c", 3)  # a late ingestion chunk
    assert redis_client.llen(keys.job_backlog("c", SHORT)) == 0
    assert jobs.progress("c").cancelled == 8
    assert dispatch.claim(SHORT, QUEUE, INTERMEDIATE) is None


def test_a_paused_jobs_handed_back_prompt_waits_in_its_backlog(redis_client: redis.Redis) -> None:
    keys = Keys(NS)
    _job(redis_client, "a", 2)
    _job(redis_client, "b", 2)
    dispatch = Dispatch(redis_client, keys)
    assert _claims(dispatch, 2) == ["a", "b"]
    dispatch.pause("a")
    # A dead worker's prompt of the paused job, reaped onto RQ's list (ids as keys.rq_job_id builds).
    reaped = keys.rq_job_id("a", "s9", 0, 0)
    redis_client.lpush(QUEUE, reaped)
    rq_id = dispatch.claim(SHORT, QUEUE, INTERMEDIATE)
    assert rq_id is not None and rq_id.startswith("b-")  # not the paused job's
    assert redis_client.lrange(keys.job_backlog("a", SHORT), 0, 0) == [reaped.encode()]
    assert redis_client.lrange(INTERMEDIATE, 0, -1) == [b"a-0", b"b-0", b"b-1"]
    dispatch.resume("a")
    assert dispatch.claim(SHORT, QUEUE, INTERMEDIATE) == reaped  # first when resumed
