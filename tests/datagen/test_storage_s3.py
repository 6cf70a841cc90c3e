"""Storage on ``s3://`` against a real S3-compatible server (moto's server mode on a loopback port),
and the same behaviour on a local directory: shards, manifest, uploads, rejected rows, then the
coordinator, a worker, an export and the report over S3."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pyarrow.parquet as pq
import pytest
import redis
from fastapi.testclient import TestClient

from datagen.control.enqueue import EnqueueOptions
from datagen.control.jobs import JobStore
from datagen.control.keys import Keys
from datagen.errors import ConfigError, InvalidSpecError, StorageError
from datagen.export import ExportFormat, export_job
from datagen.prompts.tokenization import get_renderer
from datagen.records.schema import Record, records_to_table
from datagen.records.storage import Storage
from datagen.report import build_report
from datagen.settings import CoordinatorSettings
from datagen.spec import JobSpec
from datagen.states import JobState
from service.app import create_app
from service.coordinator import Coordinator
from service.ingest import IngestOptions, Ingestor
from simulator.model import SpecialIds, expected_output
from tests.support.ingest import StopAfter, wait_ingested
from tests.support.records import make_record, write_manifest_once
from tests.support.s3 import moto_server, s3_bucket
from tests.support.sim import running_simulator
from tests.support.specs import make_spec
from tests.support.wait import wait_until
from tests.support.workers import fast_worker_settings
from workers.fleet.servers import ServerSpec
from workers.worker import Worker

NS = "s3t"
SEED = 7
PREFIX = "datagen"
MOTO_START_TIMEOUT_S = 15.0


@pytest.fixture(scope="module")
def moto_endpoint() -> Iterator[str]:
    with moto_server() as endpoint:
        yield endpoint


@pytest.fixture
def s3_url(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    return f"s3://{s3_bucket(moto_endpoint, monkeypatch)}/{PREFIX}"


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    """The same tests on both kinds of storage."""
    if request.param == "local":
        return Storage(tmp_path / "data")
    return Storage(request.getfixturevalue("s3_url"))


def _record(sample_id: str, ids: list[int], prompt_len: int = 2) -> Record:
    return make_record(sample_id, ids, prompt_len)


# Storage on both back ends -------------------------------------------------------------------------


def test_shards_are_read_back_exactly_and_only_when_committed(store: Storage) -> None:
    first = [_record("a", [0, 2**32 - 1, 7]), _record("b", [5, 6, 7, 8])]
    second = [_record("c", list(range(3000)), prompt_len=1000)]
    where = store.commit_shard("job1", "w-00000001", records_to_table(first), {"worker": "w"})
    assert where == store.url("job1", "records", "w-00000001.parquet")
    store.commit_shard("job1", "w-00000002", records_to_table(second), {"worker": "w"})
    # An orphan shard without its commit object (a crash between the two writes) is not data.
    with fsspec.open(store.url("job1", "records", "w-00000003.parquet"), "wb") as fh:
        pq.write_table(records_to_table([_record("zzz", [1, 2, 3])]), fh)

    commits = store.list_commits("job1")
    assert [(c["shard"], c["records"], c["worker"]) for c in commits] == [
        ("w-00000001", 2, "w"),
        ("w-00000002", 1, "w"),
    ]
    rows = [r for b in store.iter_record_batches("job1") for r in b.to_pylist()]
    assert [(r["sample_id"], r["input_ids"], r["prompt_len"]) for r in rows] == [
        ("a", [0, 2**32 - 1, 7], 2),
        ("b", [5, 6, 7, 8], 2),
        ("c", list(range(3000)), 1000),
    ]
    assert rows[0] == records_to_table(first).to_pylist()[0]
    ids_only = [b.schema.names for b in store.iter_record_batches("job1", columns=["sample_id"])]
    assert ids_only == [["sample_id"], ["sample_id"]]
    assert [m.num_rows for m in store.iter_shard_metadata("job1")] == [2, 1]
    assert store.job_exists("job1") and not store.job_exists("job2")
    assert store.list_commits("job2") == [] and list(store.iter_record_batches("job2")) == []
    if store.is_local:
        assert not list(Path(store.url("job1", "records")).glob("*.tmp"))


def test_manifest_is_written_once(store: Storage) -> None:
    assert store.read_manifest("j") is None
    assert write_manifest_once(store, "j", {"v": 1}) == {"v": 1}
    assert write_manifest_once(store, "j", {"v": 2}) == {"v": 1}
    assert store.read_manifest("j") == {"v": 1}


def test_uploads_stream_in_and_read_back(store: Storage) -> None:
    lines = [json.dumps({"prompt": f"p{i}"}).encode() + b"\n" for i in range(2000)]
    first = store.write_input("j", iter(lines))
    if not store.is_local:
        time.sleep(1.1)  # S3 dates objects to the second
    second = store.write_input("j", [b'{"prompt": "later"}\n'])
    assert store.input_names("j") == [first, second]
    assert store.input_exists("j", first) and not store.input_exists("j", "f00.jsonl")

    def too_large() -> Iterator[bytes]:
        yield b"x" * 1000
        raise InvalidSpecError("over the limit")

    with pytest.raises(InvalidSpecError, match="over the limit"):
        store.write_input("j", too_large())
    assert store.input_names("j") == [first, second]  # nothing left of the failed upload

    with store.open_input("j", first) as fh:
        assert fh.read() == b"".join(lines)
    with store.open_input("j", first, random_access=True) as fh:  # seeks as the conversations export does
        for number in (1500, 3, 1999, 0):
            offset = sum(len(line) for line in lines[:number])
            fh.seek(offset)
            assert fh.tell() == offset
            assert fh.readline(5) == lines[number][:5]
            assert fh.readline(10_000) == lines[number][5:]


def test_rejected_rows_are_one_object_per_chunk_merged_by_upload_and_line(store: Storage) -> None:
    store.write_rejected("j", "u1.jsonl", [{"line": 2, "reason": "a"}, {"line": 3, "reason": "b"}])
    store.write_rejected("j", "u1.jsonl", [{"line": 9, "reason": "c"}])
    # A resumed chunk reports a row again, and a second upload has its own line numbers.
    store.write_rejected("j", "u1.jsonl", [{"line": 9, "reason": "c"}, {"line": 10, "reason": "d"}])
    store.write_rejected("j", "u2.jsonl", [{"line": 2, "reason": "e"}])
    store.write_rejected("j", "u2.jsonl", [])
    rows = list(store.iter_rejected("j"))
    assert [(r["line"], r["reason"]) for r in rows] == [(2, "a"), (3, "b"), (9, "c"), (10, "d"), (2, "e")]
    assert list(store.iter_rejected("none")) == []


def test_rejected_rows_come_by_upload_oldest_first_after_those_of_older_jobs(tmp_path: Path) -> None:
    store = Storage(tmp_path)
    legacy = Path(store.url("j", "rejected.jsonl"))  # one appended file, before this layout
    legacy.parent.mkdir(parents=True)
    legacy.write_text('{"line": 4, "reason": "old"}\n{"line": 4, "reason": "old"}\nnot json\n')
    first = store.write_input("j", [b"{}\n"])
    second = store.write_input("j", [b"{}\n"])
    store.write_rejected("j", second, [{"line": 1, "reason": "second"}])
    store.write_rejected("j", first, [{"line": 7, "reason": "first"}])
    rows = list(store.iter_rejected("j"))
    assert [(r["line"], r["reason"][:12]) for r in rows] == [
        (4, "old"),
        (None, "unreadable e"),
        (7, "first"),
        (1, "second"),
    ]


def test_names_and_urls_are_checked(tmp_path: Path) -> None:
    store = Storage(tmp_path)
    with pytest.raises(InvalidSpecError, match="invalid job id"):
        store.url("../etc")
    for bad in ("../x.jsonl", ".hidden.jsonl", "a/b.jsonl"):
        with pytest.raises(StorageError, match="bad stored name"):
            store.open_input("j", bad)
    assert Storage(str(tmp_path)).root == str(tmp_path.resolve())
    assert Storage(f"file://{tmp_path}").is_local
    remote = Storage("s3://bucket/some/prefix/")
    assert (remote.root, remote.is_local) == ("s3://bucket/some/prefix", False)
    assert remote.url("j", "manifest.json") == "s3://bucket/some/prefix/jobs/j/manifest.json"
    with pytest.raises(ConfigError, match="cannot open storage"):
        Storage("nosuchprotocol://x/y")


# The coordinator, a worker, an export and the report on S3 -----------------------------------------


# Every prompt is short; the seed makes the simulator's outputs reproducible.
SPEC = make_spec(
    short_max_new_tokens=300,
    long_max_new_tokens=300,
    long_threshold_tokens=100_000,
    sampling={"sampling_seed": SEED},
)


def _dataset(n: int, bad_lines: set[int]) -> list[str]:
    """``n`` lines; the 1-based ``bad_lines`` cannot become prompts."""
    lines = []
    for line in range(1, n + 1):
        if line in bad_lines:
            lines.append(json.dumps({"id": f"bad{line}", "messages": [{"role": "wizard", "content": "x"}]}))
        else:
            lines.append(
                json.dumps({"id": f"q{line}", "messages": [{"role": "user", "content": f"Q {line}?"}]})
            )
    return lines


def _post(client: TestClient, lines: list[str], job_id: str) -> Any:
    body = ("\n".join(lines) + "\n").encode()
    data = {"spec": json.dumps(SPEC), "job_id": job_id}
    return client.post("/jobs", data=data, files={"dataset": ("d.jsonl", body, "application/jsonl")})


def test_uploads_over_the_limit_leave_nothing_and_ingestion_resumes_on_s3(
    s3_url: str, redis_url: str, redis_client: redis.Redis
) -> None:
    storage = Storage(s3_url)
    settings = CoordinatorSettings(redis_url=redis_url, storage=s3_url, namespace=NS, enqueue_chunk=3)
    small = settings.model_copy(update={"max_upload_bytes": 100})
    with TestClient(create_app(small)) as client:
        assert _post(client, _dataset(10, set()), "big").status_code == 413
    assert storage.input_names("big") == []

    # An ingestion stopped after its first chunk (a coordinator shut down) resumes from its
    # checkpoint when the next coordinator starts, reading the upload from S3 again.
    keys = Keys(NS)
    jobs = JobStore(redis_client, keys)
    jobs.create("job", JobSpec.model_validate(SPEC))
    data = ("\n".join(_dataset(10, {2, 5})) + "\n").encode()
    name = storage.write_input("job", [data[:40], data[40:]])
    redis_client.hset(keys.job("job"), mapping={"ingest_input": name, "ingest_line": 0})
    # As a submit leaves a job: its manifest written (a job without one is not resumed).
    storage.write_manifest("job", {"job_id": "job", "incarnation": jobs.incarnation("job")})
    enqueue = EnqueueOptions(result_ttl_s=600, failure_ttl_s=600, max_worker_losses=3)
    ingestor = Ingestor(redis_client, keys, jobs, storage, IngestOptions(chunk=3, enqueue=enqueue))
    ingestor.run("job", name, StopAfter(1 + 5))  # chunk 1-3 flushed; lines 4-5 read, not flushed
    assert (jobs.progress("job").state, jobs.ingest_line("job")) == (JobState.INGESTING, 3)

    coordinator = Coordinator(settings, redis_client)
    coordinator.start()
    wait_until(lambda: jobs.progress("job").state is not JobState.INGESTING, 30, "the resumed ingestion")
    coordinator.close()
    progress = jobs.progress("job")
    assert (progress.state, progress.accepted, progress.rejected) == (JobState.RUNNING, 8, 2)
    assert [r["line"] for r in coordinator.rejected("job", limit=100)] == [2, 5]
    assert [r["line"] for r in coordinator.rejected("job", limit=1)] == [2]
    rejected_objects = fsspec.filesystem("s3").ls(storage.url("job", "rejected"))
    assert len(rejected_objects) == 2  # one per chunk that had rejected rows


async def test_a_job_on_s3_end_to_end(
    s3_url: str, redis_url: str, redis_client: redis.Redis, tmp_path: Path, tokenizer_path: str
) -> None:
    storage = Storage(s3_url)
    settings = CoordinatorSettings(redis_url=redis_url, storage=s3_url, namespace=NS, enqueue_chunk=4)
    lines = _dataset(14, {3, 9})
    with TestClient(create_app(settings)) as client:
        response = _post(client, lines, "job")
        assert response.status_code == 202, response.text
        job = wait_ingested(client, "job")
        assert (job["total"], job["rejected"], job["rows"]) == (12, 2, 14)
        errors = client.get("/jobs/job/errors", params={"kind": "rejected"}).json()["errors"]
        assert [e["line"] for e in errors] == [3, 9] and "wizard" in errors[0]["reason"]
    assert storage.read_manifest("job") is not None
    [upload] = storage.input_names("job")
    with storage.open_input("job", upload) as fh:
        assert fh.read().decode().splitlines() == lines

    with running_simulator(tokenizer_path=tokenizer_path, time_scale=0.0, context_len=4096) as url:
        worker_settings = fast_worker_settings(redis_url, storage, NS, shard_max_records=5)
        worker = Worker(worker_settings, [ServerSpec("s0", url)], burst=True, install_signal_handlers=False)
        await worker.main()
    assert JobStore(redis_client, Keys(NS)).progress("job").state is JobState.COMPLETED

    # Every record read back from S3 is exactly what the simulator generated.
    spec = JobSpec.model_validate(SPEC)
    renderer = get_renderer(tokenizer_path, spec.chat_template, False, "{}")
    special = SpecialIds.from_tokenizer(renderer.tokenizer)
    records = {r["sample_id"]: r for b in storage.iter_record_batches("job") for r in b.to_pylist()}
    good = [json.loads(line) for line in lines if "wizard" not in line]
    assert sorted(records) == sorted(row["id"] for row in good)
    for row in good:
        prompt_ids = renderer.render(row["messages"])
        expected = expected_output(prompt_ids, max_new_tokens=300, seed=SEED, special=special)
        assert records[row["id"]]["input_ids"] == prompt_ids + expected.output_ids
    assert len(storage.list_commits("job")) >= 3  # shards of at most 5 records

    out = tmp_path / "specforge.jsonl"
    stats = export_job(storage, "job", ExportFormat.SPECFORGE, out)
    exported = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert (stats.written, sorted(exported)) == (12, sorted(records))
    assert all(exported[k]["input_ids"] == records[k]["input_ids"] for k in records)
    conversations = tmp_path / "conversations.jsonl"
    stats = export_job(storage, "job", ExportFormat.CONVERSATIONS, conversations)
    rows = [json.loads(line) for line in conversations.read_text().splitlines()]
    assert rows and stats.dropped["no_input"] == 0
    by_id = {row["id"]: row for row in good}
    for row in rows:  # the messages come back from the upload on S3
        assert row["conversations"][:-1] == by_id[row["id"]]["messages"]

    report = build_report(storage, "job")
    assert (report.unique, report.checks["rejected_rows"].found) == (12, 2)
