"""Ingestion never waits for room that cannot come: with a queued window
(``DATAGEN_MAX_QUEUED_PER_CLASS``) smaller than the enqueue chunk, chunks are cut to fit the window,
every row is accepted once workers take the backlog, and a job waiting for room says so (on the job
and in the log) while it waits."""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient
from rq import Queue

from datagen.control.dispatch import Claimant, Dispatch
from datagen.control.enqueue import EnqueueOptions
from datagen.control.jobs import JobStore
from datagen.control.keys import Keys
from datagen.records.storage import Storage
from datagen.settings import CoordinatorSettings
from datagen.states import JobState, PromptClass
from service.admit import chunk_limit
from service.ingest import IngestOptions, Ingestor
from tests.support.specs import CLASS_LIMITS, job_spec, spec_json
from tests.support.wait import wait_until

NS = "win"
KEYS = Keys(NS)
JOB = "job"
SHORT = PromptClass.SHORT
ENQUEUE = EnqueueOptions(result_ttl_s=600, failure_ttl_s=600, max_worker_losses=3)
WAIT_S = 30.0
# The reported case: the default chunk (1,000 prompts) and a window below it.
WINDOW = 800
ROWS = 3000
WAITS_LINE = "ingestion waits for room"
RESUMES_LINE = "ingestion resumes after"


@pytest.fixture
def settings(redis_url: str, tmp_path: Path) -> CoordinatorSettings:
    return CoordinatorSettings(
        redis_url=redis_url, storage=str(tmp_path), namespace=NS, max_queued_per_class=WINDOW
    )


def _claimant(redis_client: redis.Redis) -> Claimant:
    queue = Queue(KEYS.queue_name(SHORT), connection=redis_client)
    return Claimant(
        queue_key=queue.key,
        started_key=queue.started_job_registry.key,
        worker_name="drainer",
        execution_id="x",
        ttl_s=600,
    )


def _take_all(dispatch: Dispatch, claimant: Claimant) -> list[str]:
    """A worker takes every queued prompt of the short class: the RQ ids it started."""
    taken: list[str] = []
    while claimed := dispatch.claim_many(SHORT, 100, claimant):
        taken += [c.rq_id for c in claimed]
    return taken


def _backlog(redis_client: redis.Redis, job_id: str) -> int:
    return int(redis_client.llen(KEYS.job_backlog(job_id, SHORT)))


def _messages(caplog: pytest.LogCaptureFixture, fragment: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if fragment in r.getMessage()]


def test_a_chunk_never_holds_more_prompts_than_the_window() -> None:
    assert chunk_limit(1000, 200_000) == 1000  # the window is far away: the configured chunk
    assert chunk_limit(1000, 800) == 800
    assert chunk_limit(1000, 800, samples=4) == 797  # 796 items, then a row of 4 prompts: 800
    assert chunk_limit(10, 4, samples=3) == 2  # one row of 3 prompts fills it: 3 <= 4
    assert chunk_limit(10, 2, samples=3) == 1  # one row outnumbers the window: one row a chunk
    assert chunk_limit(10, 1) == 1


def _job(redis_client: redis.Redis, storage: Storage, rows: int, samples: int) -> str:
    """Job ``JOB`` of ``rows`` short rows, ``samples`` prompts each; returns its upload's name."""
    jobs = JobStore(redis_client, KEYS)
    jobs.create(JOB, job_spec(CLASS_LIMITS, samples=samples))
    lines = [json.dumps({"id": f"r{i}", "prompt": f"q{i}"}) + "\n" for i in range(rows)]
    return storage.write_input(JOB, ["".join(lines).encode()])


def _landed_after(thread: threading.Thread, jobs: JobStore, line: int) -> bool:
    """The ingestion ended, or committed a chunk past ``line``."""
    return not thread.is_alive() or jobs.ingest_line(JOB) > line


def _step_through(redis_client: redis.Redis, ingestor: Ingestor, name: str) -> tuple[list[int], list[str]]:
    """Run the ingestion in a thread; each time it waits for room, note the backlog it waits at and
    take every queued prompt (a worker). Returns those backlogs and the RQ ids taken."""
    jobs, dispatch, claimant = ingestor.jobs, ingestor.dispatch, _claimant(redis_client)
    stop = threading.Event()
    thread = threading.Thread(target=ingestor.run, args=(JOB, name, stop))
    thread.start()
    waited_at: list[int] = []
    taken: list[str] = []
    try:
        while True:
            wait_until(
                lambda: not thread.is_alive() or jobs.progress(JOB).waiting_for_room,
                WAIT_S,
                "ingestion to wait for room or to end",
                interval_s=0.01,
            )
            if jobs.progress(JOB).waiting_for_room is None:
                break  # ingestion ended
            assert jobs.progress(JOB).waiting_for_room == SHORT.value
            waited_at.append(_backlog(redis_client, JOB))
            line = jobs.ingest_line(JOB)  # read before the take, which lets the chunk land
            # One claim of what it waits at (a loop of claims could take the chunk that lands then,
            # and the next one would find room without a wait).
            taken += [c.rq_id for c in dispatch.claim_many(SHORT, waited_at[-1], claimant)]
            wait_until(
                functools.partial(_landed_after, thread, jobs, line),
                WAIT_S,
                "the waiting chunk to land",
                interval_s=0.01,
            )
    finally:
        stop.set()
        thread.join(timeout=WAIT_S)
    return waited_at, taken + _take_all(dispatch, claimant)


@pytest.mark.parametrize(
    ("window", "rows", "samples", "waited_at"),
    [
        # Chunks of 4 (the configured 10 would never fit): 4, 4, then 2; each waits for the 4 before.
        (4, 10, 1, [4, 4]),
        # A chunk of one row of 3 prompts: the next waits while 3 are queued (3 + 3 > 4).
        (4, 3, 3, [3, 3]),
        # One row outnumbers the window: it waits for an empty backlog, and goes whole.
        (2, 3, 3, [3, 3]),
    ],
)
def test_a_window_smaller_than_the_chunk_lets_every_row_in(
    redis_client: redis.Redis, tmp_path: Path, window: int, rows: int, samples: int, waited_at: list[int]
) -> None:
    storage = Storage(str(tmp_path / "data"))
    name = _job(redis_client, storage, rows, samples)
    options = IngestOptions(chunk=10, enqueue=ENQUEUE, max_queued_per_class=window, backpressure_poll_s=0.01)
    ingestor = Ingestor(redis_client, KEYS, JobStore(redis_client, KEYS), storage, options)

    found_waits, taken = _step_through(redis_client, ingestor, name)

    assert found_waits == waited_at
    progress = ingestor.jobs.progress(JOB)
    assert (progress.state, progress.rows, progress.accepted, progress.waiting_for_room) == (
        JobState.RUNNING,
        rows,
        rows * samples,
        None,
    )
    assert len(taken) == len(set(taken)) == rows * samples  # every prompt, once


def test_the_coordinator_ingests_past_a_window_smaller_than_its_chunk(
    client: TestClient, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="service.ingest")
    dispatch, claimant = Dispatch(redis_client, KEYS), _claimant(redis_client)
    rows = "".join(json.dumps({"id": f"r{i}", "prompt": f"q{i}"}) + "\n" for i in range(ROWS)).encode()
    response = client.post(
        "/jobs",
        data={"spec": spec_json(CLASS_LIMITS)},
        files={"dataset": ("d.jsonl", rows, "application/jsonl")},
    )
    assert response.status_code == 202, response.text
    job_id = response.json()["id"]

    # Nobody takes prompts yet: the job fills its window, then waits for room, and says so.
    job = wait_until(
        lambda: (j := client.get(f"/jobs/{job_id}").json())["waiting_for_room"] and j,
        WAIT_S,
        "the job to show that it waits for room",
    )
    assert (job["state"], job["waiting_for_room"]) == ("ingesting", "short")
    assert 0 < job["queued"] == _backlog(redis_client, job_id) <= WINDOW
    # It goes on waiting (the backlog is polled every second), and said so once, not once a poll.
    time.sleep(2.5)
    waits = _messages(caplog, WAITS_LINE)
    assert len(waits) == 1 and not _messages(caplog, RESUMES_LINE)
    assert (
        f"job {job_id}: ingestion waits for room: the short backlog holds {job['queued']} prompts" in waits[0]
    )
    assert f"of a window of {WINDOW} (DATAGEN_MAX_QUEUED_PER_CLASS)" in waits[0]

    # A worker takes prompts as they come: every row gets in, and the window is never exceeded.
    taken: list[str] = []
    most_queued = 0

    def ingested() -> dict[str, Any] | None:
        nonlocal most_queued
        most_queued = max(most_queued, _backlog(redis_client, job_id))
        taken.extend(_take_all(dispatch, claimant))
        now: dict[str, Any] = client.get(f"/jobs/{job_id}").json()
        return now if now["state"] != JobState.INGESTING else None

    job = wait_until(ingested, WAIT_S * 2, "every row to be ingested", interval_s=0.05)
    taken += _take_all(dispatch, claimant)
    assert (job["state"], job["rows"], job["total"], job["rejected"], job["waiting_for_room"]) == (
        "running",
        ROWS,
        ROWS,
        0,
        None,
    )
    assert len(taken) == len(set(taken)) == ROWS
    assert most_queued <= WINDOW
    # Each wait was said once when it began and once when it ended.
    assert len(_messages(caplog, WAITS_LINE)) == len(_messages(caplog, RESUMES_LINE)) >= 1
