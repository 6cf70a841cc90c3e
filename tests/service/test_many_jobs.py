"""However many jobs there are: ``GET /jobs`` pages through all of them (never silently stops at
1,000), and a coordinator that starts resumes every job left ingesting, not only the newest 1,000."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from datagen.control.jobs import JobStore
from datagen.control.keys import Keys
from datagen.records.storage import Storage
from datagen.settings import CoordinatorSettings
from datagen.spec import JobSpec
from datagen.states import JobState
from datagen_cli import app as cli
from datagen_cli.client import CoordinatorClient
from service.app import create_app
from tests.support.processes import serve_coordinator
from tests.support.specs import make_spec
from tests.support.wait import wait_until

NS = "many"
JOBS = 250
RESUMED = 1200


@pytest.fixture
def settings(redis_url: str, tmp_path: Path) -> CoordinatorSettings:
    return CoordinatorSettings(redis_url=redis_url, storage=str(tmp_path), namespace=NS)


def _make_jobs(redis_client: redis.Redis, n: int, *, per_ms: int = 1) -> list[str]:
    """``n`` jobs, ``per_ms`` of them made in each millisecond; newest first, as listed."""
    jobs = JobStore(redis_client, Keys(NS))
    spec = JobSpec.model_validate(make_spec())
    ids = [f"j{i:04d}" for i in range(n)]
    for i, job_id in enumerate(ids):
        jobs.create(job_id, spec, created_at_ms=1_000_000 + i // per_ms)
    # Newest first; jobs of one millisecond in reverse id order (Redis's order for equal scores).
    return sorted(ids, key=lambda j: (1_000_000 + int(j[1:]) // per_ms, j), reverse=True)


def test_get_jobs_pages_through_every_job(redis_client: redis.Redis, settings: CoordinatorSettings) -> None:
    expected = _make_jobs(redis_client, JOBS, per_ms=3)  # ties at every cursor
    with TestClient(create_app(settings)) as client:
        seen: list[str] = []
        cursor = None
        pages = 0
        while True:
            params: dict[str, str | int] = {"limit": 100}
            if cursor is not None:
                params["cursor"] = cursor
            body = client.get("/jobs", params=params).json()
            assert body["count"] == JOBS
            seen += [j["id"] for j in body["jobs"]]
            pages += 1
            cursor = body["next"]
            if cursor is None:
                break
        assert pages == 3  # 100, 100, 50: written down, not recomputed
        assert seen == expected
        bad = client.get("/jobs", params={"cursor": "yesterday"})
        assert bad.status_code == 422 and "bad cursor" in bad.json()["error"]
        assert client.get("/jobs", params={"limit": 0}).status_code == 422


def test_the_client_reads_every_page(redis_client: redis.Redis, settings: CoordinatorSettings) -> None:
    expected = _make_jobs(redis_client, 1100)
    with serve_coordinator(settings) as url, CoordinatorClient(url) as client:
        assert [j["id"] for j in client.jobs()] == expected


def test_a_coordinator_resumes_every_job_left_ingesting(
    redis_client: redis.Redis, settings: CoordinatorSettings
) -> None:
    storage = Storage(settings.storage)
    jobs = JobStore(redis_client, Keys(NS))
    row = json.dumps({"id": "only", "messages": [{"role": "user", "content": "hello"}]}) + "\n"
    ids = _make_jobs(redis_client, RESUMED)
    with redis_client.pipeline(transaction=False) as pipe:
        for job_id in ids:
            name = storage.write_input(job_id, [row.encode()])
            # As a submit leaves a job: its manifest written (a job without one is not resumed).
            storage.write_manifest(job_id, {"job_id": job_id, "incarnation": jobs.incarnation(job_id)})
            pipe.hset(Keys(NS).job(job_id), mapping={"ingest_input": name, "ingest_line": 0})
        pipe.execute()
    oldest = ids[-1]
    with TestClient(create_app(settings)):
        wait_until(
            lambda: all(s == b"running" for s in _states(redis_client, ids)),
            300,
            f"all {RESUMED} jobs to be resumed and ingested",
            interval_s=0.5,
        )
    assert jobs.progress(oldest).accepted == 1  # the oldest, beyond the newest 1,000, too


def _states(redis_client: redis.Redis, ids: list[str]) -> list[bytes]:
    with redis_client.pipeline(transaction=False) as pipe:
        for job_id in ids:
            pipe.hget(Keys(NS).job(job_id), "state")
        return pipe.execute()  # type: ignore[no-any-return]


def test_get_jobs_filters_by_state_and_priority_a_page_at_a_time(
    redis_client: redis.Redis, settings: CoordinatorSettings
) -> None:
    jobs = JobStore(redis_client, Keys(NS))
    high = JobSpec.model_validate(make_spec(priority="high"))
    normal = JobSpec.model_validate(make_spec())
    # 1,000 jobs, newest last made: every 100th high priority, every 7th running (the rest stay
    # ingesting, as a coordinator that never ingests them leaves them: no dataset stored).
    for i in range(1000):
        job_id = f"f{i:04d}"
        jobs.create(job_id, high if i % 100 == 0 else normal, created_at_ms=2_000_000 + i)
        if i % 7 == 0:
            assert jobs.transition(job_id, (JobState.INGESTING,), JobState.RUNNING)
    with TestClient(create_app(settings)) as client:
        body = client.get("/jobs", params={"priority": "high", "limit": 3}).json()
        # Written by hand: the newest high-priority jobs are 900, 800, 700.
        assert [j["id"] for j in body["jobs"]] == ["f0900", "f0800", "f0700"]
        assert body["count"] == 1000 and body["next"] is not None
        rest = client.get("/jobs", params={"priority": "high", "cursor": body["next"]}).json()
        assert [j["id"] for j in rest["jobs"]] == [f"f{i:04d}" for i in range(600, -1, -100)]
        assert rest["next"] is None
        # Both filters: high priority and running: 0 and 700 (multiples of 100 and of 7).
        both = client.get("/jobs", params={"priority": "high", "state": "running"}).json()
        assert [j["id"] for j in both["jobs"]] == ["f0700", "f0000"]
        # Repeated filters add up: every running job (143 of them) or a completed one (none).
        running = client.get("/jobs", params=[("state", "running"), ("state", "completed"), ("limit", 1000)])
        assert len(running.json()["jobs"]) == 143
        bad = client.get("/jobs", params={"state": "sleeping"})
        assert bad.status_code == 422 and "state" in bad.text
        # A page of 100 of the 1,000 jobs answers in one round trip per page, not one per job.
        took = []
        for _ in range(20):
            started = time.perf_counter()
            assert client.get("/jobs").status_code == 200
            took.append(time.perf_counter() - started)
        assert sorted(took)[-2] < 0.5, took  # generous: bench/tenants.py measures the p99


def test_the_client_filters_too(redis_client: redis.Redis, settings: CoordinatorSettings) -> None:
    _make_jobs(redis_client, 5)
    with serve_coordinator(settings) as url, CoordinatorClient(url) as client:
        assert client.jobs_page(10, states=["running"])["jobs"] == []
        assert len(client.jobs_page(10, states=["ingesting"], priorities=["normal"])["jobs"]) == 5


def test_datagen_status_filters_and_says_how_many_it_shows(
    redis_client: redis.Redis, settings: CoordinatorSettings
) -> None:
    jobs = JobStore(redis_client, Keys(NS))
    spec = JobSpec.model_validate(make_spec())
    for i in range(12):
        jobs.create(f"s{i:02d}", spec, created_at_ms=3_000_000 + i)
        if i % 3 == 0:
            assert jobs.transition(f"s{i:02d}", (JobState.INGESTING,), JobState.RUNNING)
    runner = CliRunner(env={"COLUMNS": "200"})
    with serve_coordinator(settings) as url:
        running = runner.invoke(cli, ["status", "--coordinator", url, "--state", "running"])
        newest = runner.invoke(cli, ["status", "--coordinator", url, "--limit", "5"])
        bad = runner.invoke(cli, ["status", "--coordinator", url, "--state", "asleep"])
    assert running.exit_code == 0, running.output
    shown = set(re.findall(r"\bs\d\d\b", running.output))
    assert shown == {"s00", "s03", "s06", "s09"}  # written by hand: every third job runs
    assert newest.exit_code == 0, newest.output
    assert set(re.findall(r"\bs\d\d\b", newest.output)) == {"s11", "s10", "s09", "s08", "s07"}
    assert "the newest 5 jobs of 12" in newest.output
    assert bad.exit_code == 2 and "asleep" in bad.output
