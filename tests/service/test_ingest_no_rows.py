"""A run that starts on a job no chunk has landed a row for reads nothing of the job before its
first chunk lands (`service.ingest._NoRows`): neither its rows guard nor its seen records. Should
rows land meanwhile, that chunk lands nothing (the landing checks the job's ``rows`` counter) and
the run starts over from what they left, so no row is enqueued twice. A last chunk found landed
already still ends the ingestion."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import pytest
import redis

from datagen.control.enqueue import EnqueueOptions
from datagen.control.jobs import IngestFacts, JobStore
from datagen.control.keys import Keys
from datagen.records.storage import Storage
from datagen.states import JobState, PromptClass
from service.ingest import IngestOptions, Ingestor
from tests.support.specs import job_spec

NS = "norows"
JOB = "job1"
ROWS = 5
ENQUEUE = EnqueueOptions(result_ttl_s=600, failure_ttl_s=600, max_worker_losses=3)


def _landed_by_another_run(redis_client: redis.Redis, tmp_path: Path) -> tuple[JobStore, str, IngestFacts]:
    """A job whose five rows another run landed (leaving it ingesting, as if more uploads followed),
    and what a run starting before that read of it: no row landed, nothing of the input read."""
    jobs = JobStore(redis_client, Keys(NS))
    jobs.create(JOB, job_spec())
    rows = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"question {i}"}]} for i in range(ROWS)]
    storage = Storage(str(tmp_path / "data"))
    name = storage.write_input(JOB, ["".join(json.dumps(r) + "\n" for r in rows).encode()])
    before = jobs.ingest_facts(JOB)
    assert before is not None and (before.rows, before.ingest_line) == (0, 0)
    assert _ingestor(redis_client, tmp_path, chunk=100).run(JOB, name, threading.Event(), finish=False)
    return jobs, name, before


def _ingestor(redis_client: redis.Redis, tmp_path: Path, *, chunk: int) -> Ingestor:
    keys = Keys(NS)
    storage = Storage(str(tmp_path / "data"))
    options = IngestOptions(chunk=chunk, enqueue=ENQUEUE, first_chunk=chunk)
    return Ingestor(redis_client, keys, JobStore(redis_client, keys), storage, options)


def _assert_landed_once(redis_client: redis.Redis, jobs: JobStore) -> None:
    progress = jobs.progress(JOB)
    assert (progress.rows, progress.accepted, progress.skipped, progress.state) == (
        5,
        5,
        0,
        JobState.RUNNING,
    )
    assert redis_client.llen(Keys(NS).job_backlog(JOB, PromptClass.SHORT)) == 5


def test_a_run_that_assumed_no_rows_starts_over_when_rows_landed_meanwhile(
    redis_client: redis.Redis, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    jobs, name, before = _landed_by_another_run(redis_client, tmp_path)
    # Chunks of 2: its first chunk (lines 1-2, not the checkpoint's id) reads no guard, finds
    # `rows` at 5, not 0, and lands nothing; the run reads the job again and goes on after line 5.
    with caplog.at_level(logging.INFO, logger="service.ingest"):
        assert _ingestor(redis_client, tmp_path, chunk=2).run(JOB, name, threading.Event(), facts=before)
    assert "starts over" in caplog.text
    _assert_landed_once(redis_client, jobs)


def test_a_last_chunk_found_landed_still_ends_the_ingestion(
    redis_client: redis.Redis, tmp_path: Path
) -> None:
    jobs, name, before = _landed_by_another_run(redis_client, tmp_path)
    # The same chunk as the other run's (lines 1-5): landed before, which did not end the ingestion.
    assert _ingestor(redis_client, tmp_path, chunk=100).run(JOB, name, threading.Event(), facts=before)
    _assert_landed_once(redis_client, jobs)
