"""Shares read a page at a time against a real Redis: the dispatch sets' running weight sums, what a
page's read costs however many jobs there are, and the recent share's window after a resume."""

from __future__ import annotations

import time

import redis

from datagen.control.dispatch import (
    SHARE_WINDOW_S,
    TAIL_PROMPTS,
    WINDOW_BUCKET_S,
    WINDOW_TOTAL,
    Claimant,
    Dispatch,
)
from datagen.control.jobs import JobStore
from datagen.control.keys import Keys
from datagen.prompts.tokenization import bundled_tokenizer_path
from datagen.spec import JobSpec
from datagen.states import Priority, PromptClass
from tests.support.queued import queued

NS = "pages"
SHORT = PromptClass.SHORT
KEYS = Keys(NS)
CLAIMANT = Claimant(queue_key="q", started_key="q:started", worker_name="w", execution_id="x", ttl_s=30)


def _job(
    redis_client: redis.Redis, job_id: str, n: int, *, weight: float = 1.0, priority: str = "normal"
) -> None:
    spec = JobSpec(tokenizer=bundled_tokenizer_path(), weight=weight, priority=Priority(priority))
    JobStore(redis_client, KEYS).create(job_id, spec)
    ids = [f"{job_id}-{i}" for i in range(n)]
    for rq_id in ids:
        redis_client.hset(f"rq:job:{rq_id}", mapping={"data": b"x", "status": "queued"})
    with redis_client.pipeline() as pipe:
        Dispatch(redis_client, KEYS).add(pipe, job_id, SHORT, Priority(priority), queued(ids))
        pipe.execute()


def _sum(redis_client: redis.Redis, priority: Priority = Priority.NORMAL) -> int:
    return int(redis_client.get(KEYS.dispatch_weight(SHORT, priority)) or 0)


def _commands(redis_client: redis.Redis) -> int:
    stats = redis_client.info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items() if k not in {"cmdstat_info"})


def test_the_weight_sum_follows_joins_and_leaves(redis_client: redis.Redis) -> None:
    dispatch = Dispatch(redis_client, KEYS)
    # More than a tail (`TAIL_PROMPTS`): a is claimed a prompt a pick, in stride order.
    _job(redis_client, "a", TAIL_PROMPTS + 4, weight=3.0)
    _job(redis_client, "b", 1, weight=0.5)
    assert _sum(redis_client) == 3500
    shares = dispatch.page_shares(["a", "b"])
    assert round(shares["a"].target, 4) == round(3 / 3.5, 4)
    assert round(shares["b"].target, 4) == round(0.5 / 3.5, 4)
    # Stride order: a, a, b (vt 0, 1/3, 2/3 against b's 0 then 2): b's one prompt empties its
    # backlog, so it leaves its set at once, and the sum with it.
    claimed = [c.rq_id for c in dispatch.claim_many(SHORT, 3, CLAIMANT)]
    assert sorted(claimed) == ["a-0", "a-1", "b-0"]
    assert _sum(redis_client) == 3000
    assert dispatch.page_shares(["a"])["a"].target == 1.0
    dispatch.pause("a")
    assert _sum(redis_client) == 0
    paused = dispatch.page_shares(["a"])["a"]
    assert (paused.active, paused.target) == (False, 0.0)
    dispatch.resume("a")
    assert _sum(redis_client) == 3000
    JobStore(redis_client, KEYS).forget_keys("a")
    assert _sum(redis_client) == 0
    assert dispatch.page_shares(["a"]) == {}


def test_only_the_highest_priority_with_work_is_entitled(redis_client: redis.Redis) -> None:
    dispatch = Dispatch(redis_client, KEYS)
    _job(redis_client, "urgent", 2, priority="high")
    _job(redis_client, "slow", 2, weight=2.0)
    shares = dispatch.page_shares(["urgent", "slow"])
    assert (shares["urgent"].target, shares["slow"].target) == (1.0, 0.0)
    assert shares["slow"].active
    dispatch.withdraw("urgent")
    assert _sum(redis_client, Priority.HIGH) == 0
    assert dispatch.page_shares(["slow"])["slow"].target == 1.0


def test_a_page_costs_the_same_with_ten_jobs_or_five_hundred(redis_client: redis.Redis) -> None:
    dispatch = Dispatch(redis_client, KEYS)
    for i in range(10):
        _job(redis_client, f"j{i:03d}", 1)
    page = [f"j{i:03d}" for i in range(5)]
    dispatch.page_shares(page)  # the sums' mark read once
    before = _commands(redis_client)
    small = dispatch.page_shares(page)
    few = _commands(redis_client) - before
    for i in range(10, 500):
        _job(redis_client, f"j{i:03d}", 1)
    before = _commands(redis_client)
    large = dispatch.page_shares(page)
    many = _commands(redis_client) - before
    assert few == many
    assert round(small["j000"].target, 4) == 0.1
    assert round(large["j000"].target, 4) == 0.002


def test_sums_missing_from_an_older_redis_are_computed_once(redis_client: redis.Redis) -> None:
    dispatch = Dispatch(redis_client, KEYS)
    _job(redis_client, "a", 2, weight=2.0)
    _job(redis_client, "b", 2, weight=2.0)
    redis_client.delete(KEYS.dispatch_weight(SHORT, Priority.NORMAL), KEYS.dispatch_weights_mark())
    assert dispatch.page_shares(["a"])["a"].target == 0.5
    assert _sum(redis_client) == 4000
    assert redis_client.exists(KEYS.dispatch_weights_mark())


def test_the_recent_share_counts_from_the_resume_not_across_the_pause(redis_client: redis.Redis) -> None:
    dispatch = Dispatch(redis_client, KEYS)
    _job(redis_client, "x", 5)
    _job(redis_client, "y", 5)
    minute_ago_ms = int((time.time() - SHARE_WINDOW_S) * 1000)
    for job in ("x", "y"):  # both made a minute ago
        redis_client.hset(KEYS.job(job), "created_at_ms", minute_ago_ms)
    dispatch.pause("x")
    dispatch.resume("x")  # resumed now: its window starts in this bucket
    now_bucket = int(time.time() // WINDOW_BUCKET_S)
    assert SHARE_WINDOW_S // WINDOW_BUCKET_S > 3
    # While x was paused (30 s ago) y got 100 prompts; since the resume each got 5.
    redis_client.hset(KEYS.dispatch_window(now_bucket - 3), mapping={"y": 100, WINDOW_TOTAL: 100})
    redis_client.hset(KEYS.dispatch_window(now_bucket), mapping={"x": 5, "y": 5, WINDOW_TOTAL: 10})
    shares = dispatch.page_shares(["x", "y"])
    assert shares["x"].recent == 0.5  # not 5 / 110
    # y could run all along: its window is the whole minute.
    assert round(shares["y"].recent, 4) == round(105 / 110, 4)
