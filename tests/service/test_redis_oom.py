"""Redis out of memory is said as such (`datagen.control.redismemory`): a real Redis with
``maxmemory-policy noeviction`` pushed over its ``maxmemory``. No route answers 500: every write Redis
refuses is a 503 ``RedisOutOfMemoryError`` that names the limit and what to change, with a
Retry-After; reads still answer; ``/healthz``, ``/metrics`` and ``datagen status`` show it; an
ingestion waits and says the same; and raising the limit lets jobs go on."""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from datagen.control.redismemory import RECENT_REFUSAL_S, RedisMemory, RefusedWrites, health_json
from datagen.settings import CoordinatorSettings
from datagen_cli import app as cli
from datagen_cli.local.redis_server import LocalRedis
from service.app import create_app
from tests.support.ingest import INGEST_TIMEOUT_S, wait_ingested
from tests.support.processes import serve_coordinator
from tests.support.specs import make_spec
from tests.support.wait import wait_until

NS = "oom"
ROWS = 20
# Filler that takes Redis over the limit set below it.
JUNK_KEYS, JUNK_BYTES = 300, 10_000
OVER_LIMIT_BYTES = 1_000_000
# Path parameters of every route; a DELETE names the cancelled job (deleting a running one is a 409).
PATH_VALUES = {"job_id": "running", "name": "short", "action": "pause"}
UPLOAD_ROUTES = {"/jobs", "/jobs/dry-run"}
# Writes Redis must refuse at the limit; each must answer the 503 that says why.
MUST_REFUSE = [
    ("POST", "/jobs"),
    ("POST", "/jobs/running/pause"),
    ("POST", "/jobs/running/cancel"),
    ("POST", "/jobs/running/retry"),
    ("POST", "/queues/short/pause"),
]
READS = ["/jobs", "/jobs/running", "/jobs/running/errors", "/queues", "/servers", "/healthz", "/metrics"]


def _rows(n: int) -> bytes:
    return "".join(
        json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": f"question number {i}"}]}) + "\n"
        for i in range(n)
    ).encode()


def _submit(client: TestClient, job_id: str | None, rows: int = ROWS, path: str = "/jobs") -> Any:
    data = {"spec": json.dumps(make_spec())} | ({"job_id": job_id} if job_id else {})
    return client.post(path, data=data, files={"dataset": ("d.jsonl", _rows(rows), "application/jsonl")})


@pytest.fixture(scope="module")
def own_redis() -> Iterator[LocalRedis]:
    """A Redis of this module's own: its maxmemory must not reach other tests."""
    with LocalRedis() as server:
        yield server


@pytest.fixture
def redis_client(own_redis: LocalRedis) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(own_redis.url)
    client.config_set("maxmemory", 0)
    client.config_set("maxmemory-policy", "noeviction")
    client.flushall()
    yield client
    client.config_set("maxmemory", 0)
    client.close()


@pytest.fixture
def settings(own_redis: LocalRedis, redis_client: redis.Redis, tmp_path: Path) -> CoordinatorSettings:
    return CoordinatorSettings(redis_url=own_redis.url, storage=str(tmp_path / "store"), namespace=NS)


def _fill_over_the_limit(client: redis.Redis) -> None:
    for i in range(JUNK_KEYS):
        client.set(f"junk:{i}", b"x" * JUNK_BYTES)
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory", used - OVER_LIMIT_BYTES)
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        client.set("one-more", "x")


def _every_route(client: TestClient) -> list[tuple[str, str, Any]]:
    """Each route of the app called once per method (both actions of pause/resume routes)."""
    answers = []
    for route in client.app.routes:  # type: ignore[attr-defined]
        if not isinstance(route, APIRoute):
            continue
        for method in sorted(route.methods):
            actions = ["pause", "resume"] if "{action}" in route.path else ["pause"]
            for action in actions:
                values = PATH_VALUES | {"action": action}
                if method == "DELETE":
                    values["job_id"] = "cancelled"
                path = route.path.format(**values)
                if method == "POST" and route.path in UPLOAD_ROUTES:
                    answer = _submit(client, None, path=path)
                else:
                    answer = client.request(method, path)
                answers.append((method, path, answer))
    return answers


def test_no_route_answers_500_when_redis_is_out_of_memory(
    redis_client: redis.Redis, settings: CoordinatorSettings
) -> None:
    with TestClient(create_app(settings)) as client:
        for job_id in ("running", "cancelled"):
            assert _submit(client, job_id).status_code == 202
            wait_ingested(client, job_id)
        assert client.post("/jobs/cancelled/cancel").status_code == 200
        _fill_over_the_limit(redis_client)

        answers = _every_route(client)
        by_call = {(method, path): answer for method, path, answer in answers}
        failures = [f"{m} {p}: {a.status_code} {a.text[:200]}" for m, p, a in answers if a.status_code >= 500]
        refused = [a for a in failures if " 503 " in a and "RedisOutOfMemoryError" in a]
        assert failures == refused, "\n".join(failures)  # no 500, no other 5xx
        for call in MUST_REFUSE:
            answer = by_call[call]
            assert answer.status_code == 503, (call, answer.text)
            body = answer.json()
            assert body["type"] == "RedisOutOfMemoryError"
            assert body["error"].startswith("Redis is out of memory (maxmemory "), body
            assert "raise maxmemory, or lower DATAGEN_MAX_QUEUED_PER_CLASS" in body["error"]
            assert answer.headers["Retry-After"] == "30"
        for path in READS:
            assert by_call[("GET", path)].status_code == 200, path

        redis_state = client.get("/healthz").json()["redis"]
        assert redis_state["out_of_memory"] is True and redis_state["maxmemory_policy"] == "noeviction"
        assert redis_state["problems"][0].startswith("Redis is out of memory")
        metrics = client.get("/metrics").text
        assert "datagen_redis_out_of_memory 1.0" in metrics
        refusals = next(
            line for line in metrics.splitlines() if line.startswith("datagen_redis_oom_refusals_total")
        )
        assert float(refusals.split()[1]) >= len(MUST_REFUSE)

        # Raised: the same requests go through, and a new job runs.
        redis_client.config_set("maxmemory", 0)
        assert client.post("/jobs/running/pause").status_code == 200
        assert _submit(client, "after").status_code == 202
        job = wait_ingested(client, "after")
        assert (job["state"], job["total"]) == ("running", ROWS)
        assert client.get("/healthz").json()["redis"]["out_of_memory"] is False


def test_datagen_status_says_redis_is_out_of_memory(
    redis_client: redis.Redis, settings: CoordinatorSettings
) -> None:
    with serve_coordinator(settings) as url:
        _fill_over_the_limit(redis_client)
        result = CliRunner(env={"COLUMNS": "200"}).invoke(cli, ["status", "--coordinator", url])
    assert result.exit_code == 0, result.output
    assert "policy noeviction" in result.output
    assert "Redis is out of memory (maxmemory " in result.output, result.output


def test_ingestion_waits_while_redis_is_out_of_memory_and_says_so(
    redis_client: redis.Redis, settings: CoordinatorSettings, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="service.ingest")
    rows = 3000  # megabytes in Redis: the limit is reached part way
    with TestClient(create_app(settings)) as client:
        used = int(redis_client.info("memory")["used_memory"])
        redis_client.config_set("maxmemory", used + 400_000)
        assert _submit(client, "big", rows).status_code == 202

        def waiting() -> bool:
            return any("Redis is out of memory (maxmemory" in r.getMessage() for r in caplog.records)

        wait_until(waiting, INGEST_TIMEOUT_S, "ingestion to hit maxmemory")
        job = client.get("/jobs/big").json()
        assert job["state"] == "ingesting" and job["total"] < rows
        health = client.get("/healthz").json()["redis"]
        assert health["out_of_memory"] is True and health["refused_writes"] >= 1, health
        assert health["last_refused_write_at_ms"] is not None, health
        redis_client.config_set("maxmemory", 0)
        job = wait_ingested(client, "big")
    assert (job["state"], job["total"]) == ("running", rows)
    messages = [r.getMessage() for r in caplog.records if "out of memory" in r.getMessage()]
    assert "raise maxmemory, or lower DATAGEN_MAX_QUEUED_PER_CLASS; ingestion resumes in" in messages[0]
    assert not any("unreachable" in r.getMessage() for r in caplog.records)


def test_healthz_says_out_of_memory_while_writes_were_refused_of_late(
    redis_client: redis.Redis, settings: CoordinatorSettings
) -> None:
    # Reported (issue 36): /healthz said out_of_memory false while ingestion had been refused for
    # two minutes: a refused write is never stored, so Redis's memory at rest can be under its limit.
    with TestClient(create_app(settings)) as client:
        assert _submit(client, "running").status_code == 202
        wait_ingested(client, "running")
        before = client.get("/healthz").json()["redis"]
        assert (before["out_of_memory"], before["refused_writes"], before["last_refused_write_at_ms"]) == (
            False,
            0,
            None,
        )
        _fill_over_the_limit(redis_client)
        asked_ms = int(time.time() * 1000)
        assert client.post("/jobs/running/pause").status_code == 503
        # Memory freed below the limit (as workers' finished prompts free it), the limit still set.
        redis_client.delete(*[f"junk:{i}" for i in range(JUNK_KEYS)])
        memory = redis_client.info("memory")
        assert 0 < int(memory["used_memory"]) < int(memory["maxmemory"])

        health = client.get("/healthz").json()["redis"]
        assert health["out_of_memory"] is True and health["refused_writes"] == 1, health
        assert asked_ms <= health["last_refused_write_at_ms"] <= int(time.time() * 1000)
        assert health["problems"][0].startswith("Redis is out of memory (maxmemory "), health
        assert re.search(r"\(a write was refused \d+ s ago\)$", health["problems"][0]), health
        assert "datagen_redis_oom_refusals_total 1.0" in client.get("/metrics").text

        redis_client.config_set("maxmemory", 0)  # lifted: nothing can be refused now
        health = client.get("/healthz").json()["redis"]
        assert (health["out_of_memory"], health["problems"], health["refused_writes"]) == (False, [], 1)


def test_a_refusal_older_than_the_window_no_longer_says_out_of_memory() -> None:
    memory = RedisMemory(used_bytes=500, max_bytes=1000, policy="noeviction")
    refused = RefusedWrites()
    assert health_json(memory, refused, now_ms=10**12)["out_of_memory"] is False
    refused.note()
    assert refused.last_at_ms is not None
    window_ms = int(RECENT_REFUSAL_S * 1000)
    assert health_json(memory, refused, now_ms=refused.last_at_ms + window_ms)["out_of_memory"] is True
    late = health_json(memory, refused, now_ms=refused.last_at_ms + window_ms + 1)
    assert (late["out_of_memory"], late["problems"], late["refused_writes"]) == (False, [], 1)
