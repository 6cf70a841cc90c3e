"""Integrity under operator races, over real processes (issue 16's reproductions): a deleted job
stays deleted, a reused id exports only its own records, concurrent retries never run a prompt
twice nor drive a count negative, and two namespaces cannot share one storage root."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.e2e import (
    FAST_STACK_ENV,
    get_job,
    job_records,
    start_worker,
    submit_job,
    submit_job_result,
)
from tests.support.processes import ProcessStack, coordinator_stack
from tests.support.wait import wait_until

pytestmark = pytest.mark.faults

NS = "race"


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[ProcessStack]:
    # Small chunks: a big upload is still ingesting when the test cancels and deletes it.
    env = {**FAST_STACK_ENV, "DATAGEN_ENQUEUE_CHUNK": "200"}
    with coordinator_stack(tmp_path, NS, env) as stack:
        yield stack


def _keys_of(stack: ProcessStack, job_id: str) -> list[bytes]:
    ours = list(stack.redis.scan_iter(match=f"{NS}:job:{job_id}*"))
    return ours + list(stack.redis.scan_iter(match=f"rq:job:{NS}-{job_id}-*"))


def _post(stack: ProcessStack, path: str, **params: str) -> httpx.Response:
    return httpx.post(f"{stack.coordinator}{path}", params=params, timeout=30)


def test_a_deleted_job_stays_deleted_while_its_ingestion_and_prompts_were_running(
    stack: ProcessStack,
) -> None:
    sim = stack.spawn_sim("sim", "--time-scale", "0.02")
    start_worker(stack, "worker", f"sim={sim}")
    job_id = submit_job(stack, "big", 20_000)
    wait_until(
        lambda: (j := get_job(stack, job_id))["done"] >= 5 and j["state"] == "ingesting",
        60,
        "work",
        on_timeout=stack.logs,
    )

    assert _post(stack, f"/jobs/{job_id}/cancel").status_code == 200
    # The cancel answered after ingestion stopped: nothing it enqueued is left waiting, with no TTL.
    queued = [
        key
        for key in stack.redis.scan_iter(match=f"rq:job:{NS}-{job_id}-*")
        if stack.redis.hget(key, "status") == b"queued" and stack.redis.ttl(key) == -1
    ]
    assert queued == []
    deleted = httpx.delete(f"{stack.coordinator}/jobs/{job_id}", params={"files": "true"}, timeout=30)
    assert deleted.status_code == 200, deleted.text
    # The in-flight prompts run to their end (their heartbeats touch their RQ hashes meanwhile), and
    # ingestion's next chunks, had they landed, would have come back by then.
    wait_until(
        lambda: _keys_of(stack, job_id) == [],
        30,
        "the in-flight prompts to be dropped",
        on_timeout=lambda: f"keys left: {_keys_of(stack, job_id)}\n{stack.logs()}",
    )
    time.sleep(2.0)

    assert httpx.get(f"{stack.coordinator}/jobs/{job_id}", timeout=5).status_code == 404
    listed = httpx.get(f"{stack.coordinator}/jobs", timeout=5).json()["jobs"]
    assert job_id not in {j["id"] for j in listed}
    assert _keys_of(stack, job_id) == []
    assert _post(stack, f"/jobs/{job_id}/cancel").status_code == 404  # not 409 "already failed"
    assert stack.storage.read_manifest(job_id) is None
    assert job_records(stack, job_id) == []  # the in-flight prompts' records were dropped


def test_a_reused_id_exports_only_the_new_jobs_records(stack: ProcessStack) -> None:
    sim = stack.spawn_sim("sim", "--time-scale", "0.05", "--mean-reasoning-tokens", "600")
    start_worker(stack, "worker", f"sim={sim}", "--short-concurrency", "64")
    # Enough prompts that the worker's slow start (16 in flight, then half as many again every
    # controller interval) reaches 40 before the job ends: with 300, a loaded CI machine ran them
    # all with about 15 in flight on average. The job is cancelled long before its end.
    job_id = submit_job(stack, "reuse", 1500)
    wait_until(
        lambda: get_job(stack, job_id)["in_flight"] >= 40, 60, "many prompts in flight", on_timeout=stack.logs
    )

    assert _post(stack, f"/jobs/{job_id}/cancel").status_code == 200
    deleted = httpx.delete(f"{stack.coordinator}/jobs/{job_id}", params={"files": "true"}, timeout=30)
    assert deleted.status_code == 200, deleted.text

    dataset = stack.tmp / "new.jsonl"
    rows = [
        {"id": f"new{i}", "messages": [{"role": "user", "content": f"new question {i}"}]} for i in range(5)
    ]
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = stack.submit(dataset, "--short-max-new-tokens", "64", "--job-id", job_id)
    assert result.returncode == 0, result.stderr + stack.logs()
    wait_until(
        lambda: get_job(stack, job_id)["state"] == "completed", 60, "the new job", on_timeout=stack.logs
    )
    time.sleep(3.0)  # the old job's in-flight prompts end meanwhile; none may land in the new one

    job = get_job(stack, job_id)
    assert (job["total"], job["done"], job["failed"], job["cancelled"]) == (5, 5, 0, 0)
    assert sorted(r["sample_id"] for r in job_records(stack, job_id)) == [f"new{i}" for i in range(5)]
    out = stack.tmp / "export.jsonl"
    exported = stack.cli("export", job_id, "--format", "specforge", "--out", str(out))
    assert exported.returncode == 0, exported.stdout + exported.stderr
    assert len(out.read_text().splitlines()) == 5


def _retry_storm(stack: ProcessStack, job_id: str, stop: threading.Event, seen: list[dict[str, Any]]) -> None:
    """Three parallel retries every half second, as an impatient operator's script would."""
    with ThreadPoolExecutor(max_workers=3) as pool:
        while not stop.is_set():
            answers = list(pool.map(lambda _: _post(stack, f"/jobs/{job_id}/retry").status_code, range(3)))
            seen.append(dict(get_job(stack, job_id), answers=answers))
            stop.wait(0.5)


def test_concurrent_retries_never_run_a_prompt_twice_nor_go_negative(stack: ProcessStack) -> None:
    flaky = stack.spawn_sim("flaky", "--time-scale", "0", "--fail-500-rate", "0.6")
    start_worker(stack, "worker", f"flaky={flaky}", env={"DATAGEN_MAX_ATTEMPTS": "1"})
    job_id = submit_job(stack, "storm", 300)
    stop, seen = threading.Event(), []  # type: ignore[var-annotated]
    storm = threading.Thread(target=_retry_storm, args=(stack, job_id, stop, seen), daemon=True)
    storm.start()
    try:
        wait_until(
            lambda: (j := get_job(stack, job_id))["state"] == "completed" and j["failed"] == 0,
            120,
            "every prompt to succeed through retries",
            on_timeout=stack.logs,
        )
    finally:
        stop.set()
        storm.join(timeout=30)
    assert seen and all(j["failed"] >= 0 and j["queued"] >= 0 for j in seen), seen[-5:]
    assert all(set(j["answers"]) <= {200, 409} for j in seen)  # a retry runs or is refused: no 5xx
    job = get_job(stack, job_id)
    assert (job["done"], job["failed"], job["total"]) == (300, 0, 300)
    assert job["retried"] > 0
    records = job_records(stack, job_id)
    assert len(records) == len({r["sample_id"] for r in records}) == 300  # each generated and stored once


def test_a_retry_racing_a_cancel_keeps_every_count_whole(stack: ProcessStack) -> None:
    flaky = stack.spawn_sim("flaky", "--time-scale", "0.01", "--fail-500-rate", "0.6")
    start_worker(stack, "worker", f"flaky={flaky}", env={"DATAGEN_MAX_ATTEMPTS": "1"})
    job_id = submit_job(stack, "racing", 300)
    stop, seen = threading.Event(), []  # type: ignore[var-annotated]
    storm = threading.Thread(target=_retry_storm, args=(stack, job_id, stop, seen), daemon=True)
    storm.start()
    wait_until(lambda: get_job(stack, job_id)["failed"] >= 20, 60, "failures to retry", on_timeout=stack.logs)
    time.sleep(1.0)
    assert _post(stack, f"/jobs/{job_id}/cancel").status_code == 200
    time.sleep(1.5)
    stop.set()
    storm.join(timeout=30)
    wait_until(
        lambda: get_job(stack, job_id)["in_flight"] == 0,
        30,
        "in-flight prompts to end",
        on_timeout=stack.logs,
    )
    time.sleep(1.0)
    job = get_job(stack, job_id)
    assert job["state"] == "cancelled"
    assert min(j["failed"] for j in [*seen, job]) >= 0
    assert all(set(j["answers"]) <= {200, 409} for j in seen)
    assert job["done"] + job["failed"] + job["cancelled"] == job["total"] == 300, job
    records = job_records(stack, job_id)
    assert len(records) == len({r["sample_id"] for r in records}) == job["done"]


def test_a_second_namespace_cannot_use_the_same_storage(stack: ProcessStack) -> None:
    env = dict(stack.env, DATAGEN_NAMESPACE="other")
    command = [sys.executable, "-m", "datagen_cli", "coordinator", "--port", "0"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    message = " ".join(output.split())  # one message, wrapped at the terminal's width
    assert "Traceback" not in output and message.startswith("error: storage"), output
    assert "belongs to Redis namespace 'race', not 'other'" in message and "(DATAGEN_STORAGE)" in message
    worker = [sys.executable, "-m", "datagen_cli", "worker", "--server", "s=http://127.0.0.1:9", "--burst"]
    result = subprocess.run(worker, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "belongs to Redis namespace 'race'" in " ".join((result.stdout + result.stderr).split())
    # The same id in the first namespace is untouched by any of this.
    assert submit_job_result(stack, "kept", 3, "--context-len", "32768").returncode == 0
