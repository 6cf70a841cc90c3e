"""Storage that cannot be written (every shard write raises EROFS, as a read-only mount does; tests
run as root, so chmod proves nothing): a real worker on the simulator claims no more once its
uncommitted records reach ``max_uncommitted_records``, every job with records waiting shows
``storage_error``, and once storage is back both jobs complete with every record exactly once."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

import pytest
import redis

from datagen.control.jobs import JobStore
from datagen.records.files import ObjectFiles
from datagen.records.storage import Storage
from datagen.states import JobState
from tests.support.records import make_record
from tests.support.sim import running_simulator
from tests.support.wait import wait_until_async
from tests.support.workers import KEYS, NOT_MET, ingest, records, settings, start, stop
from workers.metrics import WorkerMetrics
from workers.run.writer import RecordWriter

JOBS = ("a", "b")
N = 200  # prompts per job: far more than the bound
CONCURRENCY = 8
BOUND = 40
OUTAGE_S = 5.0


def _read_only_while(monkeypatch: pytest.MonkeyPatch, failing: Any) -> None:
    """Every storage write whose path ``failing(path)`` accepts raises EROFS."""
    real_write = ObjectFiles.write

    def write(self: ObjectFiles, path: str, body: Any) -> None:
        if failing(path):
            raise OSError(30, "Read-only file system", path)
        real_write(self, path, body)

    monkeypatch.setattr(ObjectFiles, "write", write)


async def test_one_jobs_failing_commits_hold_back_no_other_job(
    storage: Storage, monkeypatch: pytest.MonkeyPatch
) -> None:
    _read_only_while(monkeypatch, lambda path: "/jobs/bad/" in path)
    reports: list[tuple[str, str | None]] = []
    writer = RecordWriter(
        storage,
        WorkerMetrics(),
        worker_tag="w1",
        commit_interval_s=0.01,
        shard_max_records=10,
        on_storage_error=lambda job_id, error: reports.append((job_id, error)),
    )
    writer.start()
    bad = asyncio.ensure_future(writer.commit(make_record("s1", [1, 2, 3], 2, job_id="bad")))
    await writer.commit(make_record("s2", [1, 2, 3], 2, job_id="good"))  # committed all the same
    await wait_until_async(lambda: reports, 5, NOT_MET)
    assert not bad.done() and writer.pending == 1
    assert {job_id for job_id, error in reports if error is not None} == {"bad"}
    assert not await writer.close(deadline_s=0)  # the bad job's record is still kept, not lost
    bad.cancel()


async def test_a_read_only_storage_bounds_what_the_worker_claims(
    redis_client: redis.Redis, storage: Storage, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for job_id in JOBS:
        ingest(redis_client, storage, job_id, N, short_max_new_tokens=16)
    read_only = False
    _read_only_while(monkeypatch, lambda _: read_only)
    jobs = JobStore(redis_client, KEYS)
    values = {"short_concurrency": CONCURRENCY, "max_uncommitted_records": BOUND}
    with running_simulator(time_scale=0.0) as url:
        worker = await start(settings(redis_url, storage, **values), {"s": url})
        read_only = True  # from the first claim on (the worker's start writes to storage)
        run = asyncio.create_task(worker.run())
        peak_in_flight = peak_uncommitted = 0
        errors: set[str] = set()
        deadline = time.monotonic() + OUTAGE_S
        while time.monotonic() < deadline:
            progress = [jobs.progress(job_id) for job_id in JOBS]
            peak_in_flight = max(peak_in_flight, sum(p.in_flight for p in progress))
            peak_uncommitted = max(peak_uncommitted, worker.writer.pending)
            errors |= {j for j, p in zip(JOBS, progress, strict=True) if p.storage_error is not None}
            await asyncio.sleep(0.02)
        print(f"peak in flight {peak_in_flight}, peak uncommitted {peak_uncommitted}")
        assert errors == set(JOBS)  # both jobs wait on the storage, and both say so
        # The bound, and the prompts generating when it was reached (one claim's worth at most).
        assert peak_uncommitted <= BOUND + CONCURRENCY
        assert peak_in_flight <= BOUND + CONCURRENCY
        assert all(jobs.progress(job_id).done == 0 for job_id in JOBS)  # nothing acked without its record
        read_only = False
        await wait_until_async(
            lambda: all(jobs.progress(job_id).state is JobState.COMPLETED for job_id in JOBS), 45, NOT_MET
        )
        await stop(worker, run)
    for job_id in JOBS:
        progress = jobs.progress(job_id)
        assert (progress.done, progress.storage_error) == (N, None)
        ids = Counter(row["sample_id"] for row in records(storage, job_id))
        assert len(ids) == N and set(ids.values()) == {1}


async def test_a_job_whose_storage_fails_takes_half_the_budget_and_the_others_go_on(
    redis_client: redis.Redis, storage: Storage, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for job_id in JOBS:
        ingest(redis_client, storage, job_id, N, short_max_new_tokens=16)
    broken = True
    _read_only_while(monkeypatch, lambda path: broken and "/jobs/a/" in path)
    jobs = JobStore(redis_client, KEYS)
    values = {"short_concurrency": CONCURRENCY, "max_uncommitted_records": BOUND}
    with running_simulator(time_scale=0.0) as url:
        worker = await start(settings(redis_url, storage, **values), {"s": url})
        run = asyncio.create_task(worker.run())
        # Job b completes while a's commits fail: a holds at most half the budget (and what was
        # generating when it got there), never all of it.
        await wait_until_async(lambda: jobs.progress("b").state is JobState.COMPLETED, 45, NOT_MET)
        stuck = jobs.progress("a")
        assert stuck.done == 0 and stuck.storage_error is not None
        assert stuck.in_flight <= BOUND // 2 + CONCURRENCY
        broken = False
        await wait_until_async(lambda: jobs.progress("a").state is JobState.COMPLETED, 45, NOT_MET)
        await stop(worker, run)
    for job_id in JOBS:
        ids = Counter(row["sample_id"] for row in records(storage, job_id))
        assert len(ids) == N and set(ids.values()) == {1}
