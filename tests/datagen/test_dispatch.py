"""The dispatch scripts against a real Redis: priority, weighted fair share, pause, cancel."""

from __future__ import annotations

import time

import redis

from datagen.control.dispatch import TAIL_PROMPTS, Claimant, Dispatch
from datagen.control.epoch import EpochWatch
from datagen.control.jobs import JobStore, RunFacts
from datagen.control.keys import Keys
from datagen.prompts.tokenization import bundled_tokenizer_path
from datagen.spec import JobSpec
from datagen.states import JobState, Priority, PromptClass
from tests.support.queued import queued

NS = "disp"
SHORT = PromptClass.SHORT
QUEUE = "q"
STARTED = "q:started"
CLAIMANT = Claimant(queue_key=QUEUE, started_key=STARTED, worker_name="w", execution_id="x", ttl_s=30)


def _job(redis_client: redis.Redis, job_id: str, n: int, **spec: object) -> None:
    keys = Keys(NS)
    JobStore(redis_client, keys).create(job_id, JobSpec(tokenizer=bundled_tokenizer_path(), **spec))  # type: ignore[arg-type]
    dispatch = Dispatch(redis_client, keys)
    priority = Priority(str(spec.get("priority", "normal")))
    ids = [f"{job_id}-{i}" for i in range(n)]
    _rq_jobs(redis_client, ids)
    with redis_client.pipeline() as pipe:
        dispatch.add(pipe, job_id, SHORT, priority, queued(ids))
        pipe.execute()


def _rq_jobs(redis_client: redis.Redis, ids: list[str]) -> None:
    """The RQ job hashes that enqueueing saves (a claim skips an id whose hash is gone)."""
    for rq_id in ids:
        redis_client.hset(f"rq:job:{rq_id}", mapping={"data": b"x", "status": "queued"})


def _claim(dispatch: Dispatch) -> str | None:
    claimed = dispatch.claim_many(SHORT, 1, CLAIMANT)
    return claimed[0].rq_id if claimed else None


def _claims(dispatch: Dispatch, n: int) -> list[str]:
    out = []
    for _ in range(n):
        rq_id = _claim(dispatch)
        if rq_id is None:
            break
        out.append(rq_id.split("-")[0])
    return out


def _started(redis_client: redis.Redis) -> list[str]:
    return sorted(m.decode().split(":")[0] for m in redis_client.zrange(STARTED, 0, -1))


def test_weights_decide_the_order_within_a_priority(redis_client: redis.Redis) -> None:
    _job(redis_client, "a", 30, weight=3.0)
    _job(redis_client, "b", 30)
    dispatch = Dispatch(redis_client, Keys(NS))
    order = _claims(dispatch, 40)
    # Written by hand: stride scheduling with passes 1/3 for a and 1 for b, ties to the
    # lexically first id.
    assert order[:8] == ["a", "b", "a", "a", "a", "b", "a", "a"]
    assert order.count("a") == 30 and order.count("b") == 10  # exactly 3:1 while both have work
    # Each claimed prompt is in RQ's started registry, as RQ's own worker would put it.
    assert len(_started(redis_client)) == 40
    shares = dispatch.shares()
    assert (shares["b"].target, shares["b"].active) == (1.0, True)  # a ran dry: b has the fleet
    assert shares["a"].dispatched == 30 and round(shares["a"].recent, 2) == 0.75


def test_high_priority_first_and_handed_back_prompts_before_all(redis_client: redis.Redis) -> None:
    _job(redis_client, "bulk", 5)
    _job(redis_client, "urgent", 2, priority="high")
    _rq_jobs(redis_client, ["back-1"])
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
    assert _claim(dispatch) is None


def test_a_paused_jobs_handed_back_prompt_waits_in_its_backlog(redis_client: redis.Redis) -> None:
    keys = Keys(NS)
    _job(redis_client, "a", 2)
    _job(redis_client, "b", 2)
    dispatch = Dispatch(redis_client, keys)
    assert _claims(dispatch, 2) == ["a", "b"]
    dispatch.pause("a")
    # A dead worker's prompt of the paused job, reaped onto RQ's list (ids as keys.rq_job_id builds).
    reaped = keys.rq_job_id("a", "s9", 0, 0)
    _rq_jobs(redis_client, [reaped])
    redis_client.lpush(QUEUE, reaped)
    rq_id = _claim(dispatch)
    assert rq_id is not None and rq_id.startswith("b-")  # not the paused job's
    assert redis_client.lrange(keys.job_backlog("a", SHORT), 0, 0) == [reaped.encode()]
    assert _started(redis_client) == ["a-0", "b-0", "b-1"]
    dispatch.resume("a")
    assert _claim(dispatch) == reaped  # first when resumed


def test_one_claim_of_many_takes_the_same_order_as_single_claims(redis_client: redis.Redis) -> None:
    _job(redis_client, "a", 30, weight=3.0)
    _job(redis_client, "b", 30)
    dispatch = Dispatch(redis_client, Keys(NS))
    claimed = dispatch.claim_many(SHORT, 8, CLAIMANT)
    # One call takes what the first 8 single claims take (written by hand in the weights test:
    # a b a a a b a a), grouped by job.
    assert sorted(c.rq_id for c in claimed) == ["a-0", "a-1", "a-2", "a-3", "a-4", "a-5", "b-0", "b-1"]
    # Started as RQ's worker would: status, worker, a started-registry member scored by the
    # heartbeat's expiry (the job's running set: tests/workers/test_reaper.py); the fields
    # returned are the queued job's.
    assert redis_client.hget("rq:job:a-0", "status") == b"started"
    assert redis_client.hget("rq:job:a-0", "worker_name") == b"w"
    assert claimed[0].fields[b"status"] == b"queued"
    score = redis_client.zscore(STARTED, "a-0:x")
    assert score is not None and 25 < score - time.time() <= 30
    assert Dispatch(redis_client, Keys(NS)).shares()["a"].dispatched == 6
    # More than is left: everything, and b's set entry goes once its backlog is empty.
    rest = dispatch.claim_many(SHORT, 100, CLAIMANT)
    assert len(rest) == 52 and dispatch.claim_many(SHORT, 5, CLAIMANT) == []


def test_a_job_picked_with_a_tail_left_gets_it_whole_as_far_as_the_claim_wants(
    redis_client: redis.Redis,
) -> None:
    assert TAIL_PROMPTS == 8  # the figures below are written by hand for it
    keys = Keys(NS)
    _job(redis_client, "a", 30)
    _job(redis_client, "t", 5)
    dispatch = Dispatch(redis_client, keys)
    # a first (vt 0, ties to the lower id; 30 left: one), then t (vt 0; 5 left, a tail): the three
    # the claim still wants, its virtual time moved by each, to 3.
    claimed = dispatch.claim_many(SHORT, 4, CLAIMANT)
    assert [c.rq_id for c in claimed] == ["a-0", "t-0", "t-1", "t-2"]
    members = keys.dispatch_jobs(SHORT, Priority.NORMAL)
    assert (redis_client.zscore(members, "a"), redis_client.zscore(members, "t")) == (1.0, 3.0)
    # Single claims: a until it is level with t (ties to a), then t, one at a time.
    assert _claims(dispatch, 4) == ["a", "a", "a", "t"]
    # t's last prompt empties its backlog: it leaves the set.
    assert _claims(dispatch, 2) == ["a", "t"] and redis_client.zscore(members, "t") is None


def test_a_claim_reads_only_the_jobs_whose_first_picks_cover_it_and_picks_as_if_it_read_more(
    redis_client: redis.Redis,
) -> None:
    """A job with its tail left gives a claim all of it at its first pick, any other job one: once
    the jobs read cover what the claim wants, no job past them can come first, so the claim reads
    no more of them (a claim among many small jobs read ``want`` jobs' backlogs and weights)."""
    keys = Keys(NS)
    for job_id, n in [("a", 20), ("b", 3), ("c", 2), ("d", 12), ("e", 1), ("f", 3), ("g", 3)]:
        _job(redis_client, job_id, n)
    dispatch = Dispatch(redis_client, keys)
    redis_client.config_resetstat()
    # All at virtual time 0, in id order. a (20 left) gives 1, b 3, c 2, d (12) 1, e 1: 8 covered,
    # f and g not read.
    claimed = dispatch.claim_many(SHORT, 8, CLAIMANT)
    assert [c.rq_id for c in claimed] == ["a-0", "b-0", "b-1", "b-2", "c-0", "c-1", "d-0", "e-0"]
    assert redis_client.info("commandstats")["cmdstat_llen"]["calls"] == 5
    members = keys.dispatch_jobs(SHORT, Priority.NORMAL)
    assert redis_client.zrange(members, 0, -1, withscores=True) == [
        (b"f", 0.0),
        (b"g", 0.0),
        (b"a", 1.0),
        (b"d", 1.0),
    ]
    # f's 3 and one of g's (the claim wants no more): two jobs read; g moves to 1, level with a and d.
    assert [c.rq_id for c in dispatch.claim_many(SHORT, 4, CLAIMANT)] == ["f-0", "f-1", "f-2", "g-0"]
    assert redis_client.zscore(members, "g") == 1.0
    assert _claims(dispatch, 4) == ["a", "d", "g", "a"]


def test_a_claim_hands_out_the_run_facts_of_jobs_the_worker_lacks_in_the_read_of_their_weight(
    redis_client: redis.Redis,
) -> None:
    keys = Keys(NS)
    _job(redis_client, "a", 2)
    _job(redis_client, "b", 2)
    _job(redis_client, "c", 2)
    jobs = JobStore(redis_client, keys)
    redis_client.hset(keys.job("b"), mapping={"tokenizer_identity": "tok@sha256:ab", "stop_ids": "[7, 9]"})
    dispatch = Dispatch(redis_client, keys)
    told: dict[str, RunFacts] = {}
    incarnation = jobs.incarnation("b")
    redis_client.config_resetstat()
    # a's 2 and b's 2 (which cover the claim: c is not read); the worker holds a's facts already.
    claimed = dispatch.claim_many(SHORT, 4, CLAIMANT, known=["a"], learn=told.__setitem__)
    assert [c.rq_id for c in claimed] == ["a-0", "a-1", "b-0", "b-1"]
    assert list(told) == ["b"]
    facts = told["b"]
    assert (facts.tokenizer, facts.stop_ids, facts.incarnation) == ("tok@sha256:ab", (7, 9), incarnation)
    assert facts.spec.tokenizer == bundled_tokenizer_path()
    # One read per job the scan reads, as without facts: a's weight alone (and the epoch's HGET),
    # b's with its facts.
    stats = redis_client.info("commandstats")
    assert (stats["cmdstat_hget"]["calls"], stats["cmdstat_hmget"]["calls"]) == (2, 1)
    # A claim with no one to tell reads weights alone.
    redis_client.config_resetstat()
    assert [c.rq_id for c in dispatch.claim_many(SHORT, 2, CLAIMANT)] == ["c-0", "c-1"]
    assert "cmdstat_hmget" not in redis_client.info("commandstats")


def test_a_claim_hands_out_nothing_while_redis_is_older_than_the_workers_floor(
    redis_client: redis.Redis,
) -> None:
    keys = Keys(NS)
    _job(redis_client, "a", 2)
    epoch = EpochWatch(redis_client, keys)
    epoch.floor = 5  # the worker saw seq 5; Redis came back from an older snapshot
    redis_client.hset(keys.epoch(), "seq", 3)
    dispatch = Dispatch(redis_client, keys, epoch=epoch)
    told: dict[str, RunFacts] = {}
    assert dispatch.claim_many(SHORT, 2, CLAIMANT, learn=told.__setitem__) == []
    assert told == {} and redis_client.llen(keys.job_backlog("a", SHORT)) == 2
    redis_client.hset(keys.epoch(), "seq", 5)  # settled by a coordinator's rebuild
    assert [c.rq_id for c in dispatch.claim_many(SHORT, 2, CLAIMANT, learn=told.__setitem__)] == [
        "a-0",
        "a-1",
    ]
    assert list(told) == ["a"]


def test_a_claim_skips_prompts_whose_rq_job_is_gone(redis_client: redis.Redis) -> None:
    _job(redis_client, "a", 3)
    redis_client.delete("rq:job:a-1")  # its job was deleted meanwhile
    dispatch = Dispatch(redis_client, Keys(NS))
    assert [c.rq_id for c in dispatch.claim_many(SHORT, 3, CLAIMANT)] == ["a-0", "a-2"]
    assert _started(redis_client) == ["a-0", "a-2"]


def _paused_jobs(redis_client: redis.Redis, n: int) -> None:
    """``n`` one-prompt jobs, each paused (their ids sort before any test job's)."""
    keys = Keys(NS)
    jobs, dispatch = JobStore(redis_client, keys), Dispatch(redis_client, keys)
    spec = JobSpec(tokenizer=bundled_tokenizer_path())
    with redis_client.pipeline(transaction=False) as pipe:
        for i in range(n):
            ids = [f"p{i:05d}-0"]
            jobs.create(f"p{i:05d}", spec)
            pipe.hset(f"rq:job:{ids[0]}", mapping={"data": b"x", "status": "queued"})
            dispatch.add(pipe, f"p{i:05d}", SHORT, Priority.NORMAL, queued(ids))
        pipe.execute()
    for i in range(n):
        dispatch.pause(f"p{i:05d}")


def test_a_new_job_behind_two_thousand_paused_jobs_is_dispatched_on_the_next_claim(
    redis_client: redis.Redis,
) -> None:
    _paused_jobs(redis_client, 2000)
    keys = Keys(NS)
    # Paused jobs are in no dispatch set: a claim never scans them.
    assert redis_client.zcard(keys.dispatch_jobs(SHORT, Priority.NORMAL)) == 0
    _job(redis_client, "zz", 50)
    dispatch = Dispatch(redis_client, keys)
    claimed = dispatch.claim_many(SHORT, 8, CLAIMANT)
    assert [c.rq_id for c in claimed] == [f"zz-{i}" for i in range(8)]
    # The paused ones still count as queued, with no share while paused.
    assert dispatch.depth(SHORT) == 2000 + 42
    shares = dispatch.shares()
    assert shares["p00000"].active is False and shares["p00000"].target == 0.0
    assert shares["zz"].target == 1.0
    # Resumed, one rejoins at the lowest virtual time and is served next (ties to the lower id).
    dispatch.resume("p01999")
    assert _claim(dispatch) == "p01999-0"


def test_prompts_added_to_a_paused_job_wait_until_it_resumes(redis_client: redis.Redis) -> None:
    keys = Keys(NS)
    _job(redis_client, "a", 1)
    dispatch = Dispatch(redis_client, keys)
    dispatch.pause("a")
    _job(redis_client, "a", 2)  # ingestion goes on while paused (ids a-0, a-1 again: fine here)
    assert redis_client.zcard(keys.dispatch_jobs(SHORT, Priority.NORMAL)) == 0
    assert _claim(dispatch) is None
    dispatch.resume("a")
    assert _claims(dispatch, 5) == ["a", "a", "a"]


def test_equal_jobs_get_even_shares_at_five_hundred_jobs(redis_client: redis.Redis) -> None:
    keys = Keys(NS)
    jobs, dispatch = JobStore(redis_client, keys), Dispatch(redis_client, keys)
    spec = JobSpec(tokenizer=bundled_tokenizer_path())
    with redis_client.pipeline(transaction=False) as pipe:
        for i in range(500):
            job_id = f"e{i:03d}"
            jobs.create(job_id, spec)
            ids = [f"{job_id}-{k}" for k in range(20)]
            for rq_id in ids:
                pipe.hset(f"rq:job:{rq_id}", mapping={"data": b"x", "status": "queued"})
            dispatch.add(pipe, job_id, SHORT, Priority.NORMAL, queued(ids))
        pipe.execute()
    taken: dict[str, int] = {}
    for _ in range(5000 // 200):
        for claimed in dispatch.claim_many(SHORT, 200, CLAIMANT):
            job = claimed.rq_id.split("-")[0]
            taken[job] = taken.get(job, 0) + 1
    # Half of all prompts dispatched: every job got its even share, 10 (stride scheduling is exact).
    assert len(taken) == 500 and set(taken.values()) == {10}
