"""A job's time to first record and tail: the count script's timestamps (from fixed clocks) and the
job view's seconds (from given field values), worked out by hand."""

from __future__ import annotations

import redis

from datagen.control.job_outcomes import COUNT_STATES
from datagen.control.keys import Keys
from datagen.control.progress import JobProgress
from datagen.control.scripts import source
from datagen.states import JobState

NS = "timing"
JOB = "j"
CREATED_MS = 1_000_000


def _view(**fields: int) -> JobProgress:
    base: dict[str, int] = dict(
        rows=100, accepted=100, rejected=0, skipped=0, done=0, failed=0, in_flight=0,
        prompt_tokens=0, output_tokens=0, created_at_ms=CREATED_MS, finished_at_ms=0,
    )  # fmt: skip
    base.update(fields)
    state = JobState.COMPLETED if base["finished_at_ms"] else JobState.RUNNING
    return JobProgress(job_id=JOB, state=state, error=None, **base)


def test_neither_before_the_first_record() -> None:
    body = _view().to_json(at_ms=CREATED_MS + 5000)
    assert (body["time_to_first_record_s"], body["tail_s"]) == (None, None)


def test_time_to_first_record_is_from_creation() -> None:
    body = _view(done=1, first_record_at_ms=CREATED_MS + 2500).to_json(at_ms=CREATED_MS + 9000)
    assert (body["time_to_first_record_s"], body["tail_s"]) == (2.5, None)


def test_a_running_tail_grows_with_the_clock() -> None:
    job = _view(done=96, first_record_at_ms=CREATED_MS + 1200, tail_from_ms=CREATED_MS + 10_000)
    assert job.to_json(at_ms=CREATED_MS + 12_000)["tail_s"] == 2.0
    assert job.to_json(at_ms=CREATED_MS + 13_750)["tail_s"] == 3.75


def test_a_finished_tail_ends_at_the_finish() -> None:
    job = _view(
        done=100,
        first_record_at_ms=CREATED_MS + 1200,
        tail_from_ms=CREATED_MS + 10_000,
        finished_at_ms=CREATED_MS + 13_250,
    )
    body = job.to_json(at_ms=CREATED_MS + 60_000)
    assert (body["time_to_first_record_s"], body["tail_s"]) == (1.2, 3.25)


# The count script, with the clock given as its "now" argument ------------------------------------


class _Counter:
    def __init__(self, client: redis.Redis, accepted: int, state: JobState = JobState.RUNNING) -> None:
        self.client = client
        self.keys = Keys(NS)
        self.script = client.register_script(source("count_and_maybe_complete"))
        key = self.keys.job(JOB)
        client.hset(key, mapping={"state": state.value, "accepted": accepted, "created_at_ms": CREATED_MS})
        client.sadd(self.keys.job_running(JOB), *(f"rq{i}" for i in range(accepted)))

    def count(self, field: str, rq_id: str, now_ms: int, increment: int = 1) -> None:
        k = self.keys
        keys = [
            k.job(JOB),
            k.job_running(JOB),
            k.job_failed(JOB),
            k.job_breakdown(JOB),
            k.job_partitions(JOB),
        ]
        report = '{"reason": "x"}' if field == "failed" else ""
        args = [field, increment, 0, now_ms, rq_id, report, 10, "p", "short", "", "", *COUNT_STATES]
        self.script(keys=keys, args=args)

    def field(self, name: str) -> int | None:
        raw = self.client.hget(self.keys.job(JOB), name)
        return None if raw is None else int(raw)


def test_the_first_done_count_sets_first_record_and_95_percent_sets_the_tail(
    redis_client: redis.Redis,
) -> None:
    counter = _Counter(redis_client, accepted=40)
    counter.count("failed", "rq0", CREATED_MS + 1)  # a failure is no record
    assert counter.field("first_record_at_ms") is None
    for i in range(1, 40):
        counter.count("done", f"rq{i}", CREATED_MS + 1 + i)
        if i == 36:  # 37 of 40 finished: 92.5 %, below ceil(0.95 * 40) = 38
            assert counter.field("tail_from_ms") is None
    assert counter.field("first_record_at_ms") == CREATED_MS + 2  # rq1, the first done
    assert counter.field("tail_from_ms") == CREATED_MS + 38  # rq37, the 38th finished
    assert counter.field("finished_at_ms") == CREATED_MS + 40
    assert redis_client.hget(counter.keys.job(JOB), "state") == b"completed"


def test_the_tail_threshold_rounds_up(redis_client: redis.Redis) -> None:
    # ceil(0.95 * 21) = ceil(19.95) = 20: the 19th count is not yet the tail, the 20th is.
    counter = _Counter(redis_client, accepted=21)
    for i in range(19):
        counter.count("done", f"rq{i}", CREATED_MS + 100 + i)
    assert counter.field("tail_from_ms") is None
    counter.count("cancelled", "rq19", CREATED_MS + 500)  # cancelled prompts count as finished
    assert counter.field("tail_from_ms") == CREATED_MS + 500
    counter.count("done", "rq20", CREATED_MS + 900)  # set once: a later count does not move it
    assert counter.field("tail_from_ms") == CREATED_MS + 500
    assert counter.field("first_record_at_ms") == CREATED_MS + 100


def test_no_tail_while_ingesting_and_a_repeated_count_changes_nothing(redis_client: redis.Redis) -> None:
    counter = _Counter(redis_client, accepted=2, state=JobState.INGESTING)
    counter.count("done", "rq0", CREATED_MS + 10)
    counter.count("done", "rq1", CREATED_MS + 20)
    counter.count("done", "rq0", CREATED_MS + 30)  # the same prompt again (a rescuer): not counted
    assert (counter.field("done"), counter.field("first_record_at_ms")) == (2, CREATED_MS + 10)
    assert counter.field("tail_from_ms") is None  # `accepted` is not the whole job yet
    # Ingestion ends: its zero-increment count finds the job running and 100 % finished.
    redis_client.hset(counter.keys.job(JOB), "state", JobState.RUNNING.value)
    counter.count("done", "", CREATED_MS + 50, increment=0)
    assert counter.field("tail_from_ms") == counter.field("finished_at_ms") == CREATED_MS + 50
    assert counter.field("first_record_at_ms") == CREATED_MS + 10
