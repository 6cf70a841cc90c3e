"""Ingestion hands out a small first chunk early, then grows its chunks to the configured size;
checkpoints, the rows guard and the counters stay exact across a stop and a resume."""

from __future__ import annotations

import itertools
import json
import threading
from pathlib import Path

import redis

from datagen.control.enqueue import EnqueueOptions
from datagen.control.jobs import JobStore
from datagen.control.keys import Keys
from datagen.records.storage import Storage
from datagen.spec import JobSpec
from datagen.states import JobState, PromptClass
from service.admit import chunk_sizes
from service.ingest import IngestOptions, Ingestor
from tests.support.ingest import StopAfter
from tests.support.specs import make_spec

NS = "first"
JOB = "job"
ROWS = 200
ENQUEUE = EnqueueOptions(result_ttl_s=600, failure_ttl_s=600, max_worker_losses=3)


def test_chunks_double_from_the_first_size_to_the_configured_one() -> None:
    assert list(itertools.islice(chunk_sizes(32, 1000), 7)) == [32, 64, 128, 256, 512, 1000, 1000]
    assert list(itertools.islice(chunk_sizes(32, 3), 3)) == [3, 3, 3]
    assert list(itertools.islice(chunk_sizes(0, 10), 5)) == [1, 2, 4, 8, 10]


def _setup(redis_client: redis.Redis, tmp_path: Path, **options: float) -> tuple[JobStore, Ingestor, str]:
    keys = Keys(NS)
    storage = Storage(str(tmp_path / "data"))
    jobs = JobStore(redis_client, keys)
    jobs.create(JOB, JobSpec.model_validate(make_spec()))
    rows = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(ROWS)]
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    name = storage.write_input(JOB, [data])
    ingestor = Ingestor(
        redis_client, keys, jobs, storage, IngestOptions(chunk=1000, enqueue=ENQUEUE, **options)
    )
    return jobs, ingestor, name


def _backlog(redis_client: redis.Redis) -> list[bytes]:
    return list(redis_client.lrange(Keys(NS).job_backlog(JOB, PromptClass.SHORT), 0, -1))


def test_the_first_chunk_lands_before_the_rest_is_read(redis_client: redis.Redis, tmp_path: Path) -> None:
    # A long deadline: only the size decides here.
    jobs, ingestor, name = _setup(redis_client, tmp_path, first_chunk=32, first_chunk_s=60.0)
    ingestor.run(JOB, name, StopAfter(1 + 40))  # stopped after 40 rows: 32 committed, 8 not
    assert jobs.ingest_line(JOB) == 32
    assert len(_backlog(redis_client)) == jobs.progress(JOB).accepted == 32

    # The resumed run starts after the checkpoint, again small (32, 64, then the other 72 rows).
    ingestor.run(JOB, name, StopAfter(1 + 32 + 64 + 1))
    assert jobs.ingest_line(JOB) == 32 + 32 + 64
    ingestor.run(JOB, name, threading.Event())
    progress = jobs.progress(JOB)
    assert (progress.state, progress.rows, progress.accepted, progress.skipped) == (
        JobState.RUNNING,
        ROWS,
        ROWS,
        0,
    )
    backlog = _backlog(redis_client)
    assert len(backlog) == len(set(backlog)) == ROWS  # every row once


def test_the_first_chunk_goes_out_at_its_deadline(redis_client: redis.Redis, tmp_path: Path) -> None:
    # A deadline already passed: the first chunk goes out with the first prompt; the next is 64.
    jobs, ingestor, name = _setup(redis_client, tmp_path, first_chunk=32, first_chunk_s=0.0)
    ingestor.run(JOB, name, StopAfter(1 + 40))
    assert jobs.ingest_line(JOB) == 1
    assert len(_backlog(redis_client)) == 1


def test_small_configured_chunks_keep_their_size(redis_client: redis.Redis, tmp_path: Path) -> None:
    # chunk=3 is below the first chunk's size: every chunk is 3 rows, and no deadline cuts one short.
    keys = Keys(NS)
    jobs, _, name = _setup(redis_client, tmp_path)
    options = IngestOptions(chunk=3, enqueue=ENQUEUE, first_chunk=32, first_chunk_s=0.0)
    ingestor = Ingestor(redis_client, keys, jobs, Storage(str(tmp_path / "data")), options)
    ingestor.run(JOB, name, StopAfter(1 + 8))
    assert jobs.ingest_line(JOB) == 6
