"""Issue 36 (conversations survive Redis): storage holds each turn's next-turn history with its
commit (the record's ``next_turn``), so a job rebuilt from storage enqueues the next turn of every
conversation whose last committed turn is not its last, instead of stopping it as ``lost``.

Over real Redis and HTTP, in one process: a tool-calling ``all`` job runs to its end; a second job
of the same rows starts from storage holding only the first turns' records (what a Redis loss
right after them leaves), is ingested as a rebuild ingests it (`service.committed`), and runs to
its end. Every later turn matches the uninterrupted run token for token (the model's parsed calls
in the history included), every stop is the same (a stop decided with a committed turn is stored
from its record), no first turn runs again, and only a conversation whose record predates
``next_turn`` (schema version 1) stops ``lost``."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest
import redis
from fastapi.testclient import TestClient

from datagen.control.enqueue import EnqueueOptions
from datagen.control.jobs import JobStore
from datagen.control.keys import Keys
from datagen.records.schema import NEXT_TURN
from datagen.records.storage import Storage
from datagen.settings import CoordinatorSettings
from datagen.spec import JobSpec
from datagen.states import JobState
from service.committed import read_committed
from service.ingest import IngestOptions, Ingestor
from tests.support.conversations import tool_rows
from tests.support.ingest import ingest_rows, wait_ingested
from tests.support.sim import running_simulator
from tests.support.specs import job_spec, make_spec
from tests.support.wait import wait_until
from tests.support.workers import fast_worker_settings
from workers.fleet.servers import ServerSpec
from workers.worker import Worker

NS = "cc"
SEED = 7
CONVERSATIONS = 24
# The coordinator checks Redis's epoch every second.
REBUILD_TIMEOUT_S = 30.0
SPEC: dict[str, Any] = {
    "context_len": None,
    "multi_turn": "all",
    "tool_call_parser": "deepseekv3",
    "short_max_new_tokens": 3000,
    "long_threshold_tokens": 100_000,
    "sampling": {"sampling_seed": SEED},
}


@pytest.fixture
def settings(redis_url: str, tmp_path: Path) -> CoordinatorSettings:
    return CoordinatorSettings(redis_url=redis_url, storage=str(tmp_path / "data"), namespace=NS)


@pytest.fixture(scope="module")
def sim(tokenizer_path: str) -> Iterator[str]:
    with running_simulator(
        tokenizer_path=tokenizer_path, time_scale=0.0, tool_call_format="deepseekv3"
    ) as url:
        yield url


async def _run_worker(redis_url: str, storage: Storage, url: str) -> None:
    settings = fast_worker_settings(redis_url, storage, NS, short_concurrency=CONVERSATIONS)
    await Worker(settings, [ServerSpec("s0", url)], burst=True, install_signal_handlers=False).main()


def _records(storage: Storage, job_id: str) -> list[dict[str, Any]]:
    return [r for batch in storage.iter_record_batches(job_id) for r in batch.to_pylist()]


def _first_turns(storage: Storage, job_id: str, into: str) -> pa.Table:
    """The first turns' records of ``job_id``, as records of job ``into``."""
    table = pa.concat_tables(pa.Table.from_batches([batch]) for batch in storage.iter_record_batches(job_id))
    table = table.filter(pc.equal(table.column("turn"), 0))
    return table.set_column(
        table.schema.get_field_index("job_id"), "job_id", pa.array([into] * table.num_rows)
    )


def _rebuilt_from_first_turns(
    redis_client: redis.Redis, storage: Storage, job_id: str, spec: JobSpec, first: pa.Table, old: str
) -> None:
    """Job ``job_id`` made as a rebuild makes it: its manifest and upload in storage, the first
    turns committed (``old``'s as a version-1 shard, without ``next_turn``), ingested from line 0
    with what storage has committed."""
    keys = Keys(NS)
    jobs = JobStore(redis_client, keys)
    jobs.create(job_id, spec)
    incarnation = jobs.incarnation(job_id)
    storage.write_manifest(job_id, {"spec": spec.model_dump(mode="json"), "incarnation": incarnation})
    data = "".join(json.dumps(row) + "\n" for row in tool_rows(CONVERSATIONS)).encode()
    input_name = storage.write_input(job_id, [data])
    is_old = pc.equal(first.column("sample_id"), old)
    info = {"worker": "w", "incarnation": incarnation}
    storage.commit_shard(job_id, "w-00000001", first.filter(pc.invert(is_old)), info | {"committed_at_ms": 1})
    version_1 = first.filter(is_old).drop_columns([NEXT_TURN])
    storage.commit_shard(job_id, "w-00000002", version_1, info | {"committed_at_ms": 2})
    committed = read_committed(storage, job_id)
    assert len(committed) == CONVERSATIONS
    enqueue = EnqueueOptions(result_ttl_s=600, failure_ttl_s=600, max_worker_losses=3)
    ingestor = Ingestor(redis_client, keys, jobs, storage, IngestOptions(chunk=50, enqueue=enqueue))
    assert ingestor.run(job_id, input_name, threading.Event(), committed=committed)


async def test_a_rebuilt_job_continues_each_conversation_from_its_records(
    redis_client: redis.Redis, redis_url: str, storage: Storage, tokenizer_path: str, sim: str
) -> None:
    spec = job_spec(SPEC, tokenizer=tokenizer_path)
    ingest_rows(redis_client, storage, Keys(NS), "whole", spec, tool_rows(CONVERSATIONS))
    await _run_worker(redis_url, storage, sim)
    whole = {(r["sample_id"], r["turn"]): r for r in _records(storage, "whole")}
    whole_stops = {s["sample_id"]: s["reason"] for s in storage.iter_stopped("whole")}
    # The rows give every path after a first turn: a next turn built from the model's parsed
    # calls, a stop decided with the first turn, and conversations of one turn.
    continued = sorted({sid for sid, turn in whole if turn == 1})
    assert len(continued) >= 4 and any(t == 2 for _, t in whole)
    assert any(whole_stops.get(sid) for sid, turn in whole if turn == 0 and (sid, 1) not in whole)
    # Each record says what follows it: the next turn's history, the stop, or nothing after the last.
    for (sid, turn), record in whole.items():
        note = json.loads(record[NEXT_TURN] or "null")
        if (sid, turn + 1) in whole:
            assert set(note) == {"history"}, (sid, turn)
        elif sid in whole_stops:
            assert note["stop"]["reason"] == whole_stops[sid], (sid, turn)
        else:
            assert note is None, (sid, turn)

    old = continued[0]  # its first turn's record predates next_turn
    _rebuilt_from_first_turns(
        redis_client, storage, "rebuilt", spec, _first_turns(storage, "whole", "rebuilt"), old
    )
    await _run_worker(redis_url, storage, sim)

    records = _records(storage, "rebuilt")
    keys = [(r["sample_id"], r["turn"]) for r in records]
    assert len(keys) == len(set(keys)), "a turn with a committed record ran again"
    expected = {key for key in whole if key[0] != old or key[1] == 0}
    assert set(keys) == expected
    for record in records:
        assert record["input_ids"] == whole[(record["sample_id"], record["turn"])]["input_ids"], record
    stops = {s["sample_id"]: (s["reason"], s["turn"]) for s in storage.iter_stopped("rebuilt")}
    assert stops.pop(old) == ("lost", 1)
    assert {sid: reason for sid, (reason, _) in stops.items()} == whole_stops
    progress = JobStore(redis_client, Keys(NS)).progress("rebuilt")
    assert (progress.state, progress.failed) == (JobState.COMPLETED, 0)
    assert progress.done == progress.accepted == len(records)


def test_a_hash_that_late_acks_left_after_a_loss_is_rebuilt_not_taken_for_another_incarnation(
    client: TestClient, redis_client: redis.Redis
) -> None:
    """Reported: workers finishing turns just after Redis restarted empty counted their next turns
    into a hash of their own (no incarnation, no state); the rebuild took it for another
    incarnation and left the job alone: 404 for good, nothing logged."""
    rows = "".join(json.dumps(row) + "\n" for row in tool_rows(6)).encode()
    response = client.post(
        "/jobs",
        data={"spec": json.dumps(make_spec(multi_turn="all")), "job_id": "j1"},
        files={"dataset": ("d.jsonl", rows, "application/jsonl")},
    )
    assert response.status_code == 202, response.text
    wait_ingested(client, "j1")
    with redis_client.pipeline() as pipe:  # Redis restarted empty; a late next-turn count lands
        pipe.flushall()
        pipe.hset(Keys(NS).job("j1"), mapping={"accepted": 1, "prompt_tokens": 40})
        pipe.execute()

    def rebuilt() -> dict[str, Any] | None:
        job: dict[str, Any] = client.get("/jobs/j1").json()
        return job if job.get("rebuilt") and job["state"] != "ingesting" else None

    job = wait_until(rebuilt, REBUILD_TIMEOUT_S, "the job to be rebuilt", interval_s=0.1)
    assert (job["state"], job["total"], job["done"], job["queued"]) == ("running", 6, 0, 6)
    assert job["rebuilt"]["reason"] == "Redis lost its data"
