"""A manifest that no longer validates is found before a rebuild drops anything (issue 36):
``POST /jobs/{id}/recover`` answers 409 naming the field and leaves the job as it was, and a
Redis that lost its data still gets back every other job. Over real HTTP."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from datagen.control.keys import Keys
from datagen.settings import CoordinatorSettings
from tests.support.ingest import INGEST_TIMEOUT_S
from tests.support.processes import serve_coordinator
from tests.support.specs import make_spec
from tests.support.wait import wait_until

NS = "rm"
ROWS = 5
# The coordinator checks Redis's epoch every second; a rebuild of these small jobs is quick.
REBUILD_TIMEOUT_S = 30.0


@pytest.fixture
def storage_dir(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.fixture
def http(redis_url: str, storage_dir: Path) -> Iterator[httpx.Client]:
    settings = CoordinatorSettings(redis_url=redis_url, storage=str(storage_dir), namespace=NS)
    with serve_coordinator(settings) as url, httpx.Client(base_url=url) as client:
        yield client


def _submit(http: httpx.Client, job_id: str) -> dict[str, Any]:
    rows = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"question {i}"}]} for i in range(ROWS)]
    body = "".join(json.dumps(r) + "\n" for r in rows).encode()
    response = http.post(
        "/jobs",
        data={"spec": json.dumps(make_spec()), "job_id": job_id},
        files={"dataset": ("d.jsonl", body, "application/jsonl")},
    )
    assert response.status_code == 202, response.text

    def ingested() -> dict[str, Any] | None:
        job: dict[str, Any] = http.get(f"/jobs/{job_id}").json()
        return job if job["state"] != "ingesting" else None

    return wait_until(ingested, INGEST_TIMEOUT_S, f"job {job_id} to be ingested")


def _edit_manifest(storage_dir: Path, job_id: str, edit: Callable[[dict[str, Any]], None]) -> None:
    path = storage_dir / "jobs" / job_id / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


def _job_state(redis_client: redis.Redis, job_id: str) -> dict[str, bytes | None]:
    """Every key of the job, serialized by Redis itself."""
    return {key: redis_client.dump(key) for key in Keys(NS).job_keys(job_id)}


def _spec_field(manifest: dict[str, Any]) -> None:
    manifest["spec"]["short_max_new_tokens"] = 0


def _no_spec(manifest: dict[str, Any]) -> None:
    del manifest["spec"]


def _stop_ids(manifest: dict[str, Any]) -> None:
    manifest["preflight"]["stop_ids"] = "1,2"


def _context_len(manifest: dict[str, Any]) -> None:
    manifest["preflight"]["context_len"] = "big"


@pytest.mark.parametrize(
    ("edit", "fragment"),
    [
        (_spec_field, "invalid job spec: short_max_new_tokens: Input should be greater than or equal to 1"),
        (_no_spec, "spec: expected the job spec as a JSON object"),
        (_stop_ids, "preflight.stop_ids: expected a list of token ids"),
        (_context_len, 'preflight.context_len: expected a whole number, got "big"'),
    ],
)
def test_recover_with_an_invalid_manifest_is_a_409_and_changes_nothing(
    http: httpx.Client,
    redis_client: redis.Redis,
    storage_dir: Path,
    edit: Callable[[dict[str, Any]], None],
    fragment: str,
) -> None:
    before = _submit(http, "j1")
    assert (before["state"], before["total"], before["queued"]) == ("running", ROWS, ROWS)
    _edit_manifest(storage_dir, "j1", edit)
    state = _job_state(redis_client, "j1")

    response = http.post("/jobs/j1/recover")

    assert response.status_code == 409, response.text
    body = response.json()
    assert body["type"] == "JobStateError", body
    assert body["error"].startswith("job j1 cannot be rebuilt: its manifest (")
    assert fragment in body["error"] and "Nothing of the job was changed" in body["error"], body
    assert _job_state(redis_client, "j1") == state
    after = http.get("/jobs/j1").json()
    assert (after["state"], after["total"], after["queued"], after["rebuilt"]) == (
        "running",
        ROWS,
        ROWS,
        None,
    )


def test_a_lost_redis_gets_back_every_job_whose_manifest_validates(
    http: httpx.Client, redis_client: redis.Redis, storage_dir: Path
) -> None:
    _submit(http, "bad")
    _submit(http, "good")
    _edit_manifest(storage_dir, "bad", _spec_field)

    redis_client.flushall()  # as a Redis restarted without persistence

    def rebuilt() -> dict[str, Any] | None:
        response = http.get("/jobs/good")
        job: dict[str, Any] = response.json()
        return job if response.status_code == 200 and job["state"] != "ingesting" else None

    job = wait_until(rebuilt, REBUILD_TIMEOUT_S, "job good to be rebuilt")
    assert (job["state"], job["total"], job["queued"]) == ("running", ROWS, ROWS)
    assert job["rebuilt"]["reason"] == "Redis lost its data"
    assert http.get("/jobs/bad").status_code == 404
    response = http.post("/jobs/bad/recover")
    assert response.status_code == 409 and "short_max_new_tokens" in response.json()["error"], response.text
