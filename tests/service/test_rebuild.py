"""Storage is the truth: a coordinator rebuilds the jobs a Redis lost, rolled back or holds behind,
from their manifests, uploads and committed records; deleted jobs stay deleted, cancelled ones stay
cancelled; and an ingestion rides out a storage outage instead of failing its job.

No worker runs here: records are committed by hand, as a worker commits them, so the counts can
be written down."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from datagen.control.jobs import JobStore
from datagen.control.keys import Keys
from datagen.control.redistext import as_texts
from datagen.records.files import ObjectFiles
from datagen.records.schema import records_to_table
from datagen.records.storage import Storage
from datagen.settings import CoordinatorSettings
from datagen.states import PromptClass
from datagen_cli import app as cli
from datagen_cli.client import CoordinatorClient
from service.app import create_app
from service.lifecycle import JobControls
from tests.support.ingest import wait_ingested
from tests.support.processes import serve_coordinator
from tests.support.records import make_record
from tests.support.specs import make_spec
from tests.support.wait import wait_until

NS = "rb"
ROWS = 20
# The coordinator checks Redis's epoch every second; a rebuild of these small jobs is quick.
REBUILD_TIMEOUT_S = 30.0


@pytest.fixture
def settings(redis_url: str, tmp_path: Path) -> CoordinatorSettings:
    return CoordinatorSettings(redis_url=redis_url, storage=str(tmp_path), namespace=NS)


def _rows(n: int = ROWS) -> bytes:
    rows = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"question {i}"}]} for i in range(n)]
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def _submit(client: TestClient, job_id: str, body: bytes | None = None) -> dict[str, Any]:
    response = client.post(
        "/jobs",
        data={"spec": json.dumps(make_spec()), "job_id": job_id},
        files={"dataset": ("d.jsonl", body or _rows(), "application/jsonl")},
    )
    assert response.status_code == 202, response.text
    return wait_ingested(client, job_id)


def _commit(storage: Storage, job_id: str, sample_ids: list[str]) -> None:
    """Records of ``sample_ids`` committed for the job's current incarnation, as a worker would."""
    manifest = storage.read_manifest(job_id)
    assert manifest is not None
    records = [make_record(s, [1, 2, 3, 4, 5], 3, job_id=job_id) for s in sample_ids]
    info = {"worker": "w", "committed_at_ms": 1, "incarnation": manifest["incarnation"]}
    storage.commit_shard(job_id, f"w-{job_id}", records_to_table(records), info)


def _backlog_samples(redis_client: redis.Redis, job_id: str) -> list[str]:
    """The RQ ids waiting in the job's backlog, as the sample digests they end in."""
    ids = as_texts(redis_client.lrange(Keys(NS).job_backlog(job_id, PromptClass.SHORT), 0, -1))
    return sorted(i.rsplit("-", 3)[1] for i in ids)


def _wait_rebuilt(client: TestClient, job_id: str) -> dict[str, Any]:
    def rebuilt() -> dict[str, Any] | None:
        response = client.get(f"/jobs/{job_id}")
        if response.status_code != 200:
            return None
        job: dict[str, Any] = response.json()
        return job if job["rebuilt"] and job["state"] != "ingesting" else None

    return wait_until(rebuilt, REBUILD_TIMEOUT_S, f"job {job_id} to be rebuilt", interval_s=0.1)


def test_a_job_that_redis_lost_is_rebuilt_from_storage(
    client: TestClient, redis_client: redis.Redis, settings: CoordinatorSettings
) -> None:
    _submit(client, "j1")
    storage = Storage(settings.storage)
    _commit(storage, "j1", ["r0", "r1", "r2", "r3", "r4"])
    before = _backlog_samples(redis_client, "j1")
    assert len(before) == ROWS
    # RQ's tools list both queues: named at the coordinator's start, not by every chunk.
    queues = {b"rq:queue:rb-short", b"rq:queue:rb-long"}
    assert redis_client.smembers("rq:queues") == queues

    redis_client.flushall()  # as a Redis restarted without persistence
    job = _wait_rebuilt(client, "j1")
    wait_until(lambda: redis_client.smembers("rq:queues") == queues, 10, "the queues to be named again")
    # 20 rows, 5 committed by hand: 15 run again, none of the 5.
    assert (job["state"], job["rows"], job["total"], job["done"], job["queued"]) == ("running", 20, 20, 5, 15)
    assert job["rebuilt"]["reason"] == "Redis lost its data"
    assert job["rebuilt"]["committed"] == 5
    after = _backlog_samples(redis_client, "j1")
    assert len(after) == 15 and set(after) < set(before)
    assert [j["id"] for j in client.get("/jobs").json()["jobs"]] == ["j1"]


def test_deleted_jobs_stay_deleted_and_cancelled_jobs_stay_cancelled(
    client: TestClient, redis_client: redis.Redis, settings: CoordinatorSettings
) -> None:
    _submit(client, "kept")
    _submit(client, "stopped")
    assert client.post("/jobs/stopped/cancel").status_code == 200
    _submit(client, "gone")
    assert client.post("/jobs/gone/cancel").status_code == 200
    _commit(Storage(settings.storage), "gone", ["r0"])
    assert client.delete("/jobs/gone").status_code == 200  # its files stay

    redis_client.flushall()
    _wait_rebuilt(client, "kept")
    stopped = _wait_rebuilt(client, "stopped")
    assert (stopped["state"], stopped["queued"]) == ("cancelled", 0)
    assert redis_client.llen(Keys(NS).job_backlog("stopped", PromptClass.SHORT)) == 0
    assert client.get("/jobs/gone").status_code == 404

    # Its files are all that is left: deleting them is the way to reuse the id (was a dead end).
    refused = client.post(
        "/jobs",
        data={"spec": json.dumps(make_spec()), "job_id": "gone"},
        files={"dataset": ("d.jsonl", _rows(), "application/jsonl")},
    )
    assert refused.status_code == 409 and "datagen delete gone --files" in refused.json()["error"]
    deleted = client.delete("/jobs/gone", params={"files": "true"})
    assert deleted.status_code == 200 and deleted.json()["files_deleted"] is True
    assert _submit(client, "gone")["total"] == ROWS


def test_a_redis_that_went_back_in_time_is_seen_and_the_job_rebuilt(
    client: TestClient, redis_client: redis.Redis, settings: CoordinatorSettings
) -> None:
    _submit(client, "j1")
    _commit(Storage(settings.storage), "j1", ["r0", "r1", "r2"])
    # What a restored snapshot looks like to the coordinator: the same epoch, an older sequence.
    redis_client.hset(Keys(NS).epoch(), "seq", 0)
    job = _wait_rebuilt(client, "j1")
    assert job["rebuilt"]["reason"] == "Redis went back to an older snapshot"
    assert (job["total"], job["done"], job["queued"]) == (20, 3, 17)


def test_a_coordinator_that_starts_on_an_emptied_redis_rebuilds_its_jobs(
    redis_client: redis.Redis, settings: CoordinatorSettings
) -> None:
    with TestClient(create_app(settings)) as client:
        _submit(client, "j1")
    _commit(Storage(settings.storage), "j1", ["r7"])
    redis_client.flushall()
    with TestClient(create_app(settings)) as client:
        job = _wait_rebuilt(client, "j1")
        assert job["rebuilt"]["reason"] == "Redis had no data at coordinator start"
        assert (job["total"], job["done"]) == (20, 1)


def test_recover_rebuilds_one_job_on_request(
    client: TestClient, redis_client: redis.Redis, settings: CoordinatorSettings
) -> None:
    _submit(client, "j1")
    _commit(Storage(settings.storage), "j1", ["r0", "r1"])
    # Counted done in Redis as the records' acks would have: nothing to rebuild by itself.
    redis_client.hset(Keys(NS).job("j1"), "done", 2)
    response = client.post("/jobs/j1/recover")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["rebuilt"]["committed"] == 2 and body["rebuilt"]["done_before"] == 2
    job = wait_ingested(client, "j1")
    assert (job["total"], job["done"], job["queued"]) == (20, 2, 18)
    assert client.post("/jobs/nope/recover").status_code == 404


def test_an_ingestion_rides_out_a_storage_outage(
    client: TestClient, monkeypatch: pytest.MonkeyPatch, settings: CoordinatorSettings
) -> None:
    # Every row is rejected (empty content), so each chunk writes an object under rejected/.
    body = "".join(json.dumps({"id": f"x{i}", "messages": []}) + "\n" for i in range(60)).encode()
    real_write = ObjectFiles.write
    until = time.monotonic() + 10.0  # a 10-s read-only window

    def read_only(self: ObjectFiles, path: str, write: Any) -> None:
        if "rejected" in path and time.monotonic() < until:
            raise OSError(30, "Read-only file system", path)
        real_write(self, path, write)

    monkeypatch.setattr(ObjectFiles, "write", read_only)
    response = client.post(
        "/jobs",
        data={"spec": json.dumps(make_spec()), "job_id": "ro"},
        files={"dataset": ("d.jsonl", body, "application/jsonl")},
    )
    assert response.status_code == 202, response.text
    shown = wait_until(
        lambda: client.get("/jobs/ro").json()["storage_error"], 10, "the outage to show on the job"
    )
    assert "Read-only file system" in shown
    job = wait_ingested(client, "ro", timeout_s=60)
    assert (job["state"], job["rows"], job["rejected"], job["storage_error"]) == ("completed", 60, 60, None)
    assert (
        len(client.get("/jobs/ro/errors", params={"kind": "rejected", "limit": 100}).json()["errors"]) == 60
    )


def test_datagen_recover_and_status_say_what_a_rebuild_kept(
    redis_client: redis.Redis, settings: CoordinatorSettings, tmp_path: Path
) -> None:
    dataset = tmp_path / "rows.jsonl"
    dataset.write_bytes(_rows())
    with serve_coordinator(settings) as url:
        client = CoordinatorClient(url)
        client.submit(dataset, make_spec(), job_id="j1")
        wait_until(lambda: client.job("j1")["state"] == "running", REBUILD_TIMEOUT_S, "j1 to be ingested")
        _commit(Storage(settings.storage), "j1", ["r0", "r1", "r2"])
        runner = CliRunner(env={"COLUMNS": "200"})
        recovered = runner.invoke(cli, ["recover", "j1"], env={"DATAGEN_COORDINATOR_URL": url})
        assert recovered.exit_code == 0, recovered.output
        assert "job j1: rebuilt from storage: 3 prompts have committed records" in recovered.output
        wait_until(lambda: client.job("j1")["state"] == "running", REBUILD_TIMEOUT_S, "j1 to be ingested")
        shown = runner.invoke(cli, ["status", "--coordinator", url])
        client.close()
    assert shown.exit_code == 0, shown.output
    assert (
        "(asked for (datagen recover)): 3 prompts kept their committed records, the other 17 run again"
        in (shown.output.replace("\n", " "))
    )


def test_a_job_whose_uploads_are_gone_is_rebuilt_from_its_records_alone(
    client: TestClient, redis_client: redis.Redis, settings: CoordinatorSettings
) -> None:
    _submit(client, "j1")
    _commit(Storage(settings.storage), "j1", ["r0", "r1", "r2", "r3"])
    for upload in (Path(settings.storage) / "jobs" / "j1" / "input").iterdir():
        upload.unlink()  # e.g. removed to save space once the job ran
    redis_client.flushall()
    job = _wait_rebuilt(client, "j1")
    assert (job["state"], job["total"], job["done"], job["queued"]) == ("completed", 4, 4, 0)


def test_a_job_newer_than_a_snapshot_restored_while_no_coordinator_ran_is_rebuilt(
    redis_client: redis.Redis, settings: CoordinatorSettings
) -> None:
    with TestClient(create_app(settings)) as client:
        _submit(client, "old")
        snapshot_seq = int(redis_client.hget(Keys(NS).epoch(), "seq") or 0)  # the "snapshot"
        # A tick of the epoch between the two jobs: the newer one names a later epoch.
        wait_until(lambda: int(redis_client.hget(Keys(NS).epoch(), "seq") or 0) > snapshot_seq, 10, "a tick")
        _submit(client, "new")
    _commit(Storage(settings.storage), "new", ["r5"])
    # Redis back at the snapshot: the newer job is not there, the epoch's sequence is older.
    JobControls(redis_client, Keys(NS), JobStore(redis_client, Keys(NS)), Storage(settings.storage)).forget(
        "new"
    )
    redis_client.hset(Keys(NS).epoch(), "seq", snapshot_seq)
    with TestClient(create_app(settings)) as client:
        job = _wait_rebuilt(client, "new")
        assert job["rebuilt"]["reason"].startswith("Redis went back to an older snapshot")
        assert (job["total"], job["done"]) == (20, 1)
        assert client.get("/jobs/old").json()["rebuilt"] is None
