"""Storage read with suspicion (issue 36): a ``deleted.json`` or ``cancelled.json`` planted in a job's
folder, or another job's manifest copied over its own, is refused with one log line (or a 409
naming the file) instead of acted on: a live job is not dropped at coordinator start, a lost one is
not rebuilt cancelled, and ``recover`` answers 409 with nothing dropped. Over real HTTP, real Redis,
files planted in a real storage directory."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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

NS = "pf"
ROWS = 5
REBUILD_TIMEOUT_S = 30.0
STORAGE_LOGGER = "datagen.records.manifests"


@pytest.fixture
def settings(redis_url: str, tmp_path: Path) -> CoordinatorSettings:
    return CoordinatorSettings(redis_url=redis_url, storage=str(tmp_path / "store"), namespace=NS)


@contextmanager
def _coordinator(settings: CoordinatorSettings) -> Iterator[httpx.Client]:
    """A coordinator started now (its start holds every stored job to Redis), over real HTTP."""
    with serve_coordinator(settings) as url, httpx.Client(base_url=url) as http:
        yield http


def _submit(http: httpx.Client, job_id: str) -> dict[str, Any]:
    rows = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"question {i}"}]} for i in range(ROWS)]
    response = http.post(
        "/jobs",
        data={"spec": json.dumps(make_spec()), "job_id": job_id},
        files={"dataset": ("d.jsonl", "".join(json.dumps(r) + "\n" for r in rows), "application/jsonl")},
    )
    assert response.status_code == 202, response.text

    def ingested() -> dict[str, Any] | None:
        job: dict[str, Any] = http.get(f"/jobs/{job_id}").json()
        return job if job["state"] != "ingesting" else None

    return wait_until(ingested, INGEST_TIMEOUT_S, f"job {job_id} to be ingested")


def _job_dir(settings: CoordinatorSettings, job_id: str) -> Path:
    return Path(settings.storage) / "jobs" / job_id


def _incarnation(settings: CoordinatorSettings, job_id: str) -> str:
    manifest = json.loads((_job_dir(settings, job_id) / "manifest.json").read_text())
    return str(manifest["incarnation"])


def _job_state(redis_client: redis.Redis, job_id: str) -> dict[str, bytes | None]:
    """Every key of the job, serialized by Redis itself."""
    return {key: redis_client.dump(key) for key in Keys(NS).job_keys(job_id)}


def _now_ms() -> int:
    return int(time.time() * 1000)


# What is planted as jobs/j1/<name>: each names something else than j1's own ending.
def _other_jobs_marker(settings: CoordinatorSettings) -> bytes:
    """A genuine marker of job j2 (deleted, files kept), copied in as it is."""
    return (_job_dir(settings, "j2") / "deleted.json").read_bytes()


def _wrong_job_id(settings: CoordinatorSettings) -> bytes:
    body = {
        "job_id": "j2",
        "ending": "deleted",
        "incarnation": _incarnation(settings, "j1"),
        "at_ms": _now_ms(),
    }
    return json.dumps(body).encode()


def _wrong_incarnation(settings: CoordinatorSettings) -> bytes:
    body = {"job_id": "j1", "ending": "deleted", "incarnation": "0" * 32, "at_ms": _now_ms()}
    return json.dumps(body).encode()


def _other_ending(settings: CoordinatorSettings) -> bytes:
    body = {"job_id": "j1", "ending": "cancelled", "incarnation": _incarnation(settings, "j1"), "at_ms": 1}
    return json.dumps(body).encode()


def _not_json(settings: CoordinatorSettings) -> bytes:
    return b"\x00{deleted"


@pytest.mark.parametrize(
    ("plant", "problem"),
    [
        (_other_jobs_marker, "names job 'j2', not j1"),
        (_wrong_job_id, "names job 'j2', not j1"),
        (_wrong_incarnation, "names incarnation '0000"),
        (_other_ending, "says 'cancelled', not 'deleted'"),
        (_not_json, "is not a JSON object"),
    ],
)
def test_a_planted_deleted_marker_does_not_drop_a_live_job_at_coordinator_start(
    settings: CoordinatorSettings,
    redis_client: redis.Redis,
    caplog: pytest.LogCaptureFixture,
    plant: Callable[[CoordinatorSettings], bytes],
    problem: str,
) -> None:
    caplog.set_level(logging.WARNING, logger=STORAGE_LOGGER)
    with _coordinator(settings) as http:
        before = _submit(http, "j1")
        _submit(http, "j2")
        assert http.post("/jobs/j2/cancel").status_code == 200
        assert http.delete("/jobs/j2").status_code == 200  # files kept: j2 has its deleted.json
    marker = _job_dir(settings, "j1") / "deleted.json"
    marker.write_bytes(plant(settings))
    state = _job_state(redis_client, "j1")

    with _coordinator(settings) as http:  # its start holds every stored job to Redis
        after = http.get("/jobs/j1").json()
        assert http.get("/jobs/j2").status_code == 404  # j2's own marker is honoured

    assert (after["state"], after["total"], after["queued"], after["rebuilt"]) == (
        before["state"],
        ROWS,
        ROWS,
        None,
    )
    assert _job_state(redis_client, "j1") == state
    refusals = [r.getMessage() for r in caplog.records if r.name == STORAGE_LOGGER]
    assert len(refusals) == 1, refusals
    assert refusals[0].startswith(f"{marker} {problem}"), refusals
    assert "refused, not acted on" in refusals[0]


def test_a_planted_cancelled_marker_does_not_bring_a_lost_job_back_cancelled(
    settings: CoordinatorSettings, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=STORAGE_LOGGER)
    with _coordinator(settings) as http:
        _submit(http, "j1")
        body = {
            "job_id": "j2",
            "ending": "cancelled",
            "incarnation": _incarnation(settings, "j1"),
            "at_ms": 1,
        }
        (_job_dir(settings, "j1") / "cancelled.json").write_text(json.dumps(body))
        redis_client.flushall()  # as a Redis restarted without persistence

        def rebuilt() -> dict[str, Any] | None:
            response = http.get("/jobs/j1")
            job: dict[str, Any] = response.json()
            return job if response.status_code == 200 and job["state"] != "ingesting" else None

        job = wait_until(rebuilt, REBUILD_TIMEOUT_S, "job j1 to be rebuilt")
    assert (job["state"], job["total"], job["queued"]) == ("running", ROWS, ROWS)
    assert job["rebuilt"]["reason"] == "Redis lost its data"
    refusals = [r.getMessage() for r in caplog.records if r.name == STORAGE_LOGGER]
    assert len(refusals) == 1 and "cancelled.json names job 'j2', not j1" in refusals[0], refusals


def test_a_marker_from_before_markers_named_their_job_is_still_honoured(
    settings: CoordinatorSettings, redis_client: redis.Redis
) -> None:
    # Written by the previous release: {incarnation, at_ms}. Its incarnation is the manifest's, which
    # no other job's marker can hold, so it is the job's own (Redis went back to before the delete).
    with _coordinator(settings) as http:
        _submit(http, "j1")
    old = {"incarnation": _incarnation(settings, "j1"), "at_ms": _now_ms()}
    (_job_dir(settings, "j1") / "deleted.json").write_text(json.dumps(old))
    with _coordinator(settings) as http:
        assert http.get("/jobs/j1").status_code == 404
    assert not any(redis_client.exists(key) for key in Keys(NS).job_keys("j1"))


def test_recover_with_another_jobs_manifest_is_a_409_naming_the_file_and_drops_nothing(
    settings: CoordinatorSettings, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=STORAGE_LOGGER)
    with _coordinator(settings) as http:
        _submit(http, "j1")
        _submit(http, "j2")
        manifest = _job_dir(settings, "j1") / "manifest.json"
        manifest.write_bytes((_job_dir(settings, "j2") / "manifest.json").read_bytes())
        state = _job_state(redis_client, "j1")

        response = http.post("/jobs/j1/recover")

        assert response.status_code == 409, response.text
        body = response.json()
        assert body["type"] == "ForeignFileError" and "\n" not in body["error"], body
        assert body["error"].startswith(f"{manifest} names job 'j2', not j1: refused, not acted on"), body
        assert _job_state(redis_client, "j1") == state
        job = http.get("/jobs/j1").json()
        assert (job["state"], job["total"], job["queued"], job["rebuilt"]) == ("running", ROWS, ROWS, None)

        # Redis loses its data: j2 comes back, j1 is left alone (not rebuilt from j2's manifest).
        redis_client.flushall()

        def j2_rebuilt() -> bool:
            response = http.get("/jobs/j2")
            return response.status_code == 200 and response.json()["state"] == "running"

        wait_until(j2_rebuilt, REBUILD_TIMEOUT_S, "job j2 to be rebuilt")
        assert http.get("/jobs/j1").status_code == 404
        assert http.post("/jobs/j1/recover").status_code == 409
    left_alone = [r.getMessage() for r in caplog.records if r.getMessage().startswith("job j1 left alone")]
    assert left_alone and f"{manifest} names job 'j2', not j1" in left_alone[0], left_alone
