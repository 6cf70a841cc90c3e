"""An ingestion chunk's landing (`datagen.control.ingest_chunks`, ``ingest_land.lua``) against a
real Redis: whole or nothing, once (a chunk sent again after a lost reply answers "landed before"),
never for a job whose fence is gone or taken, or that is cancelled or deleted; it waits for room in
the job's backlog, checks the ``rows`` counter a run assumed, and labels partitions as the job's
first few, and keeps its labels and its fence in the job's hash (a job an older version made keeps
working)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import pytest
import redis

from datagen.control.enqueue import EnqueueOptions
from datagen.control.ingest_chunks import ChunkWrite, IngestChunks, Landing
from datagen.control.jobs import MAX_PARTITION_LABEL_CHARS, MAX_PARTITION_LABELS, AckItem, AckTarget, JobStore
from datagen.control.keys import OTHER_LABEL, BreakdownField, Keys, prompt_key
from datagen.control.payload import PromptPayload
from datagen.control.redistext import as_texts
from datagen.states import JobState, Priority, PromptClass
from tests.support.specs import job_spec

NS = "land"
KEYS = Keys(NS)
JOB = "j1"
SHORT = PromptClass.SHORT
ENQUEUE = EnqueueOptions(result_ttl_s=600, failure_ttl_s=600, max_worker_losses=3)
WINDOW = 100
PROMPT_TOKENS = 3


def _payloads(first: int, n: int, partition: str = "default") -> list[PromptPayload]:
    return [
        PromptPayload(
            job=JOB,
            sample_id=f"s{i}",
            turn=0,
            gen=0,
            cls=SHORT,
            prompt_ids=[1] * PROMPT_TOKENS,
            max_new_tokens=8,
            partition=partition,
        )
        for i in range(first, first + n)
    ]


def _write(payloads: Sequence[PromptPayload], last_line: int) -> ChunkWrite:
    n = len(payloads)
    partitioned: dict[BreakdownField, int] = {}
    for p in payloads:
        field = BreakdownField("accepted", p.partition, p.cls.value)
        partitioned[field] = partitioned.get(field, 0) + 1
    return ChunkWrite(
        input_name="up.jsonl",
        last_line=last_line,
        enqueue=payloads,
        continued=(),
        counts={"rows": n, "accepted": n, "prompt_tokens": PROMPT_TOKENS * n, "rejected": 0},
        partitions={p.partition for p in payloads},
        partitioned=partitioned,
        breakdown={},
        rows={f"k{p.sample_id}": f"d:{i}:up" for i, p in enumerate(payloads)},
        seen=b"records",
    )


def _job(redis_client: redis.Redis) -> tuple[JobStore, str]:
    jobs = JobStore(redis_client, KEYS)
    jobs.create(JOB, job_spec())
    incarnation = jobs.incarnation(JOB)
    assert incarnation
    return jobs, incarnation


def _land(
    redis_client: redis.Redis,
    write: ChunkWrite,
    incarnation: str,
    *,
    fence_value: str | None = None,
    window: int = WINDOW,
    wait_for_room: Callable[[PromptClass, int, int], None] | None = None,
    expect_rows: int | None = None,
    finish: bool = False,
) -> Landing:
    def refuse(cls: PromptClass, wanted: int, backlog: int) -> None:
        raise AssertionError(f"waited for room: {cls} {wanted} {backlog}")

    return IngestChunks(redis_client, KEYS, ENQUEUE).land(
        JOB,
        write,
        priority=Priority.NORMAL,
        incarnation=incarnation,
        fence_value=incarnation if fence_value is None else fence_value,
        window=window,
        wait_for_room=wait_for_room or refuse,
        expect_rows=expect_rows,
        finish=finish,
    )


def _backlog(redis_client: redis.Redis) -> list[str]:
    return as_texts(redis_client.lrange(KEYS.job_backlog(JOB, SHORT), 0, -1))


COUNTED = ["rows", "accepted", "prompt_tokens", "ingest_line"]


def _counts(redis_client: redis.Redis) -> dict[str, int]:
    raw = redis_client.hmget(KEYS.job(JOB), COUNTED)
    return {name: int(value or 0) for name, value in zip(COUNTED, raw, strict=True)}


def test_a_chunk_lands_whole_and_once_when_it_is_sent_again(redis_client: redis.Redis) -> None:
    _, incarnation = _job(redis_client)
    write = _write(_payloads(0, 3), last_line=3)
    assert _land(redis_client, write, incarnation) is Landing.LANDED
    # Sent again (its reply was lost): it finds its own id as the checkpoint, and writes nothing.
    assert _land(redis_client, write, incarnation) is Landing.LANDED_BEFORE

    backlog = _backlog(redis_client)
    assert backlog == [KEYS.rq_job_id(JOB, f"s{i}", 0, 0) for i in range(3)]
    assert all(redis_client.hget(f"rq:job:{rq_id}", "status") == b"queued" for rq_id in backlog)
    assert _counts(redis_client) == {"rows": 3, "accepted": 3, "prompt_tokens": 9, "ingest_line": 3}
    assert redis_client.hget(KEYS.job(JOB), "rejected") is None  # a zero adds no field
    assert redis_client.hgetall(KEYS.job_breakdown(JOB)) == {b"accepted|default|short": b"3"}
    assert as_texts(redis_client.smembers(KEYS.job_partitions(JOB))) == ["default"]
    assert redis_client.hlen(KEYS.job_rows(JOB)) == 3
    seen = [redis_client.get(KEYS.job_seen(JOB, s)) for s in range(16)]
    assert [s for s in seen if s] == [b"records"]
    assert redis_client.hget(KEYS.job(JOB), "ingest_at") == b"up.jsonl:3"
    assert redis_client.zscore(KEYS.dispatch_jobs(SHORT, Priority.NORMAL), JOB) is not None


def test_a_chunk_lands_nothing_once_the_fence_is_dropped_or_taken(redis_client: redis.Redis) -> None:
    jobs, incarnation = _job(redis_client)
    token = jobs.take_ingest(JOB, incarnation)  # another run holds the fence now
    assert token
    assert _land(redis_client, _write(_payloads(0, 2), 2), incarnation) is Landing.TAKEN_OVER
    assert jobs.cancel(JOB)  # the fence goes
    assert _land(redis_client, _write(_payloads(0, 2), 2), incarnation, fence_value=token) is Landing.FENCED
    assert _backlog(redis_client) == []
    assert _counts(redis_client) == {"rows": 0, "accepted": 0, "prompt_tokens": 0, "ingest_line": 0}
    assert not redis_client.exists(KEYS.job_rows(JOB))
    assert redis_client.hget(KEYS.job(JOB), "ingest_at") is None
    assert not redis_client.keys("rq:job:*")


def test_a_cancelled_or_deleted_job_takes_no_chunk_even_without_a_fence(redis_client: redis.Redis) -> None:
    # A job made before incarnations has no fence to look at ('' for fence_value).
    jobs, incarnation = _job(redis_client)
    jobs.cancel(JOB)
    assert _land(redis_client, _write(_payloads(0, 2), 2), incarnation, fence_value="") is Landing.FENCED
    assert _counts(redis_client)["accepted"] == 0 and _backlog(redis_client) == []
    jobs.forget_keys(JOB)
    assert _land(redis_client, _write(_payloads(0, 2), 2), incarnation, fence_value="") is Landing.FENCED
    assert not redis_client.exists(KEYS.job(JOB)), "a deleted job's hash came back"


def test_a_run_that_found_no_rows_lands_nothing_once_rows_landed_since(redis_client: redis.Redis) -> None:
    _, incarnation = _job(redis_client)
    assert _land(redis_client, _write(_payloads(0, 2), 2), incarnation, expect_rows=0) is Landing.LANDED
    # A second run that also started at 0 rows (it read neither the rows guard nor the seen records).
    stale = _write(_payloads(0, 2), 4)
    assert _land(redis_client, stale, incarnation, expect_rows=0) is Landing.STALE
    assert _counts(redis_client) == {"rows": 2, "accepted": 2, "prompt_tokens": 6, "ingest_line": 2}
    assert len(_backlog(redis_client)) == 2
    assert _land(redis_client, stale, incarnation, expect_rows=2) is Landing.LANDED


def test_a_chunk_waits_for_room_in_the_backlog_and_then_lands(redis_client: redis.Redis) -> None:
    _, incarnation = _job(redis_client)
    assert _land(redis_client, _write(_payloads(0, 3), 3), incarnation, window=4) is Landing.LANDED
    waits: list[tuple[PromptClass, int, int]] = []

    def take_all(cls: PromptClass, wanted: int, backlog: int) -> None:
        waits.append((cls, wanted, backlog))
        redis_client.delete(KEYS.job_backlog(JOB, cls))  # a worker took them

    # 3 queued + 3 more > 4: it waits once, then lands.
    landing = _land(redis_client, _write(_payloads(3, 3), 6), incarnation, window=4, wait_for_room=take_all)
    assert landing is Landing.LANDED
    assert waits == [(SHORT, 3, 3)]
    assert len(_backlog(redis_client)) == 3
    # More prompts of one class than the window ask for the whole window: an empty backlog fits them.
    landing = _land(redis_client, _write(_payloads(6, 6), 12), incarnation, window=4, wait_for_room=take_all)
    assert landing is Landing.LANDED
    assert waits[1:] == [(SHORT, 4, 3)]
    assert len(_backlog(redis_client)) == 6


def test_partitions_are_labelled_up_to_the_cap_counting_characters(redis_client: redis.Redis) -> None:
    _, incarnation = _job(redis_client)
    # Two bytes a character: one at the cap in characters (twice it in bytes) and one over it.
    at_cap, over_cap = "é" * MAX_PARTITION_LABEL_CHARS, "é" * (MAX_PARTITION_LABEL_CHARS + 1)
    first = [*_payloads(0, 1, at_cap), *_payloads(1, 1, over_cap)]
    assert _land(redis_client, _write(first, 2), incarnation) is Landing.LANDED
    many = [p for i in range(MAX_PARTITION_LABELS + 5) for p in _payloads(10 + i, 1, f"p{i:02d}")]
    assert _land(redis_client, _write(many, 40), incarnation) is Landing.LANDED

    # The cap counts the job's labels: one from the first chunk, then the first (sorted) of the rest.
    labelled = [at_cap, *(f"p{i:02d}" for i in range(MAX_PARTITION_LABELS - 1))]
    assert sorted(as_texts(redis_client.smembers(KEYS.job_partitions(JOB)))) == sorted(labelled)
    breakdown = JobStore(redis_client, KEYS).breakdown(JOB)
    assert breakdown == {
        **{BreakdownField("accepted", label, "short"): 1 for label in labelled},
        BreakdownField("accepted", OTHER_LABEL, "short"): 1 + 6,
    }


def test_a_chunk_larger_than_a_slice_lands_whole(redis_client: redis.Redis) -> None:
    # Over PUSH_SLICE prompts, rows and next turns: each write goes in pieces (Lua's unpack has a
    # stack limit), all of them in the one step.
    _, incarnation = _job(redis_client)
    payloads = _payloads(0, 2500)
    continued = [dataclasses.replace(p, turn=1) for p in _payloads(5000, 1500)]
    write = dataclasses.replace(_write(payloads, 2500), continued=continued)
    assert _land(redis_client, write, incarnation, window=10_000) is Landing.LANDED
    assert len(_backlog(redis_client)) == 4000
    assert redis_client.hlen(KEYS.job_rows(JOB)) == 2500
    assert redis_client.scard(KEYS.job_enqueued(JOB)) == 1500  # next turns' guard, as workers keep it
    assert redis_client.sismember(KEYS.job_enqueued(JOB), prompt_key("s5000", 1, 0))


def test_the_last_chunk_ends_the_ingestion_as_it_lands(redis_client: redis.Redis) -> None:
    jobs, incarnation = _job(redis_client)
    assert _land(redis_client, _write(_payloads(0, 2), 2), incarnation) is Landing.LANDED
    assert jobs.progress(JOB).state is JobState.INGESTING
    assert jobs.ingest_fence(JOB) == incarnation
    write = _write(_payloads(2, 1), last_line=3)
    assert _land(redis_client, write, incarnation, finish=True) is Landing.LANDED
    # Ingesting -> running in the same step, the fence gone (nothing more lands), every count in.
    assert jobs.progress(JOB).state is JobState.RUNNING
    assert jobs.ingest_fence(JOB) is None
    assert _counts(redis_client) == {"rows": 3, "accepted": 3, "prompt_tokens": 9, "ingest_line": 3}
    assert redis_client.hget(KEYS.job(JOB), "tail_from_ms") is None  # nothing ended yet
    # Sent again after a lost reply: landed before (though its landing dropped the fence), nothing
    # written twice.
    assert _land(redis_client, write, incarnation, finish=True) is Landing.LANDED_BEFORE
    assert _counts(redis_client)["accepted"] == 3 and len(_backlog(redis_client)) == 3


def test_a_last_chunk_with_nothing_accepted_completes_the_job(redis_client: redis.Redis) -> None:
    _, incarnation = _job(redis_client)
    write = dataclasses.replace(
        _write([], last_line=2),
        counts={"rows": 2, "rejected": 2},
        breakdown={BreakdownField("rejected", "unknown", "unknown"): 2},
    )
    assert _land(redis_client, write, incarnation, finish=True) is Landing.LANDED
    job = redis_client.hgetall(KEYS.job(JOB))
    assert job[b"state"] == b"completed" and job[b"rejected"] == b"2"
    # The tail and completion rules, as `finish_ingest.lua` applies them: both at the end of ingestion.
    assert int(job[b"finished_at_ms"]) == int(job[b"tail_from_ms"]) > 0
    assert redis_client.hgetall(KEYS.job_breakdown(JOB)) == {b"rejected|unknown|unknown": b"2"}


def test_a_job_joins_its_dispatch_set_once_and_keeps_its_place(redis_client: redis.Redis) -> None:
    """A landing into an empty backlog joins the set without looking for the job there first; one
    while prompts wait finds it there; one into a backlog emptied while the job stayed a member (as
    a claim finds and drops it) keeps its place. The set's weight sum counts the job once."""
    _, incarnation = _job(redis_client)
    members = KEYS.dispatch_jobs(SHORT, Priority.NORMAL)
    weight_sum = KEYS.dispatch_weight(SHORT, Priority.NORMAL)
    redis_client.config_resetstat()
    assert _land(redis_client, _write(_payloads(0, 2), 2), incarnation) is Landing.LANDED
    zscores = redis_client.info("commandstats").get("cmdstat_zscore", {}).get("calls", 0)
    assert zscores == 0
    # Weight 1 is 1000 units; the first job of an empty set joins at virtual time 0.
    assert (redis_client.zscore(members, JOB), redis_client.get(weight_sum)) == (0.0, b"1000")
    assert _land(redis_client, _write(_payloads(2, 2), 4), incarnation) is Landing.LANDED
    assert (redis_client.zscore(members, JOB), redis_client.get(weight_sum)) == (0.0, b"1000")
    redis_client.zadd(members, {JOB: 7})
    redis_client.delete(KEYS.job_backlog(JOB, SHORT))
    assert _land(redis_client, _write(_payloads(4, 1), 5), incarnation) is Landing.LANDED
    assert (redis_client.zscore(members, JOB), redis_client.get(weight_sum)) == (7.0, b"1000")
    assert len(_backlog(redis_client)) == 1


def _calls(redis_client: redis.Redis, command: str) -> int:
    return int(redis_client.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


@pytest.mark.parametrize("made", ["now", "before"])
def test_labels_kept_in_the_job_hash_give_the_labels_its_labelled_partitions_give(
    redis_client: redis.Redis, made: str
) -> None:
    """A job keeps its labels in its hash too (`labels`, `label:<partition>`), so a chunk and an ack
    read them with the job: no SMEMBERS, no SISMEMBER. A job an older version made (no `labels`)
    looks them up in its labelled partitions, as does a chunk of more partitions than one read takes
    (64). Either way: the same labels, and the same breakdown."""
    jobs, incarnation = _job(redis_client)
    if made == "before":
        redis_client.hdel(KEYS.job(JOB), "labels")
    first = [*_payloads(0, 2, "chat"), *_payloads(2, 1, "math")]
    assert _land(redis_client, _write(first, 3), incarnation) is Landing.LANDED
    # 70 partitions in one chunk, more than a read takes: 18 more get labels, 20 in all.
    wide = [p for i in range(70) for p in _payloads(10 + i, 1, f"w{i:02d}")]
    assert _land(redis_client, _write(wide, 73), incarnation) is Landing.LANDED
    again = [*_payloads(100, 1, "chat"), *_payloads(101, 1, "w00"), *_payloads(102, 1, "w69")]
    redis_client.config_resetstat()
    assert _land(redis_client, _write(again, 76), incarnation) is Landing.LANDED
    assert _calls(redis_client, "smembers") == (0 if made == "now" else 1)

    labelled = ["chat", "math", *(f"w{i:02d}" for i in range(18))]
    assert sorted(as_texts(redis_client.smembers(KEYS.job_partitions(JOB)))) == labelled
    fields = {k.decode(): v.decode() for k, v in redis_client.hgetall(KEYS.job(JOB)).items()}
    kept = sorted(name.removeprefix("label:") for name in fields if name.startswith("label:"))
    if made == "now":
        assert (fields["labels"], kept) == ("20", labelled)
    else:
        assert ("labels" in fields, kept) == (False, [])
    accepted = {label: n for (counter, label, _), n in jobs.breakdown(JOB).items() if counter == "accepted"}
    assert accepted == {
        "chat": 3,
        "math": 1,
        "w00": 2,
        **{f"w{i:02d}": 1 for i in range(1, 18)},
        OTHER_LABEL: 70 - 18 + 1,  # w18..w69, and w69 again
    }

    # Acks of prompts of a labelled partition, of one labelled in the wide chunk and of another.
    acked = [("s100", "chat"), ("s101", "w00"), ("s102", "w69")]
    for sample, _ in acked:
        rq_id = KEYS.rq_job_id(JOB, sample, 0, 0)
        jobs.outcomes.started(JOB, rq_id)
        redis_client.zadd("started", {f"{rq_id}:x": 1e12})
    target = AckTarget(started_key="started", finished_key="finished", execution_id="x")
    batch = [
        AckItem(KEYS.rq_job_id(JOB, sample, 0, 0), JOB, incarnation, 5, partition, "short", "stop", 600)
        for sample, partition in acked
    ]
    redis_client.config_resetstat()
    assert jobs.outcomes.ack_done(target, batch) == 3
    assert _calls(redis_client, "sismember") == (0 if made == "now" else 3)
    done = {label: n for (counter, label, _), n in jobs.breakdown(JOB).items() if counter == "done"}
    assert done == {"chat": 1, "w00": 1, OTHER_LABEL: 1}


def test_a_fence_an_older_version_kept_in_a_key_moves_into_the_hash_when_a_resume_takes_it(
    redis_client: redis.Redis,
) -> None:
    jobs, incarnation = _job(redis_client)
    assert jobs.ingest_fence(JOB) == incarnation  # written with the hash, by the create
    # As an older version made the job: its fence in a key of its own, none in the hash.
    redis_client.hdel(KEYS.job(JOB), "ingest_fence")
    redis_client.set(KEYS.job_ingest_fence(JOB), incarnation)
    assert jobs.ingest_fence(JOB) is None
    token = jobs.take_ingest(JOB, incarnation)
    assert token is not None and token.startswith(f"{incarnation}/")
    assert jobs.ingest_fence(JOB) == token
    assert not redis_client.exists(KEYS.job_ingest_fence(JOB))  # a run of the older version stops
    assert _land(redis_client, _write(_payloads(0, 2), 2), incarnation, fence_value=token) is Landing.LANDED
    assert _land(redis_client, _write(_payloads(2, 2), 4), incarnation) is Landing.TAKEN_OVER


def test_a_cancel_or_a_rebuild_drops_a_fence_an_older_version_kept_in_a_key(
    redis_client: redis.Redis,
) -> None:
    jobs, incarnation = _job(redis_client)
    legacy = KEYS.job_ingest_fence(JOB)
    redis_client.set(legacy, incarnation)
    assert jobs.cancel(JOB)
    assert not redis_client.exists(legacy) and jobs.ingest_fence(JOB) is None
    redis_client.set(legacy, incarnation)
    created = jobs.create_job(JOB, job_spec(), incarnation=incarnation, replace=True)
    assert created.made and not redis_client.exists(legacy)
    assert jobs.ingest_fence(JOB) == incarnation
    # A fence key left of a job that is gone is nothing to take: no hash is made for it.
    redis_client.set(KEYS.job_ingest_fence("gone"), "i1")
    assert jobs.take_ingest("gone", "i1") is None
    assert not redis_client.exists(KEYS.job("gone"))
