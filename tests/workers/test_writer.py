"""The record writer refuses a deleted job's records, looking once their shard is written; it
commits the shards of different jobs at once (up to its bound, one job's in order), and a new job's
first record or a job's last ones without waiting for the interval or for the other jobs."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from datagen.errors import JobNotFoundError, StorageError
from datagen.records.storage import Storage
from tests.support.records import make_record
from tests.support.wait import wait_until_async
from tests.support.workers import NOT_MET
from workers.metrics import WorkerMetrics
from workers.run.writer import RecordWriter

# A remote object store's latency per shard, far above a local disk's.
SLOW_COMMIT_S = 0.02


def _writer(storage: Storage, answers: list[str | None]) -> tuple[RecordWriter, list[str]]:
    """A writer whose view of the job's incarnation is ``answers``, one per look (the last repeats)."""
    looked: list[str] = []

    def current(job_id: str) -> str | None:
        looked.append(job_id)
        return answers[min(len(looked), len(answers)) - 1]

    writer = RecordWriter(
        storage,
        WorkerMetrics(),
        worker_tag="w1",
        commit_interval_s=0.01,
        shard_max_records=10,
        current_incarnation=current,
    )
    return writer, looked


async def test_records_of_a_live_incarnation_are_committed_with_it(storage: Storage) -> None:
    writer, looked = _writer(storage, ["inc1"])
    writer.start()
    await writer.commit(make_record("s1", [1, 2, 3, 4], 2), "inc1")
    assert await writer.close(deadline_s=float("inf"))
    commits = storage.list_commits("job1")  # no manifest: every commit counts
    assert [c["incarnation"] for c in commits] == ["inc1"]
    assert looked == ["job1"]  # once, after the write: one command a shard


@pytest.mark.parametrize(
    ("answers", "what"),
    [
        ([None], "deleted before or while the shard was written"),
        (["inc2"], "its id reused before or while the shard was written"),
    ],
)
async def test_records_of_a_gone_incarnation_are_dropped(
    storage: Storage, answers: list[str | None], what: str
) -> None:
    writer, _ = _writer(storage, answers)
    writer.start()
    with pytest.raises(JobNotFoundError, match="deleted or replaced"):
        await writer.commit(make_record("s1", [1, 2, 3, 4], 2), "inc1")
    assert await writer.close(deadline_s=float("inf"))
    assert storage.list_commits("job1") == [], what
    assert not list(Path(storage.root).glob("jobs/job1/records/*.parquet")), what
    assert writer.pending == 0


class _SlowCommits:
    """The storage's shard commits slowed by ``delay_s``, counting how many run at once (in all, and
    per job); a job in ``failing`` has every commit fail after the delay."""

    def __init__(self, storage: Storage, monkeypatch: pytest.MonkeyPatch, delay_s: float) -> None:
        self.delay_s = delay_s
        self.failing: set[str] = set()
        self.tries: Counter[str] = Counter()
        self.running = self.peak = self.peak_per_job = 0
        self._per_job: Counter[str] = Counter()
        self._lock = threading.Lock()
        real = storage.commit_shard

        def commit_shard(job_id: str, shard: str, table: Any, info: dict[str, Any]) -> str:
            with self._lock:
                self.tries[job_id] += 1
                self.running += 1
                self._per_job[job_id] += 1
                self.peak = max(self.peak, self.running)
                self.peak_per_job = max(self.peak_per_job, self._per_job[job_id])
            try:
                time.sleep(self.delay_s)
                if job_id in self.failing:
                    raise StorageError(f"cannot commit shard {shard} of job {job_id}: read-only")
                return real(job_id, shard, table, info)
            finally:
                with self._lock:
                    self.running -= 1
                    self._per_job[job_id] -= 1

        monkeypatch.setattr(storage, "commit_shard", commit_shard)


def _busy_writer(storage: Storage, **options: Any) -> RecordWriter:
    """A writer whose jobs all have other prompts in flight (their records wait for the interval)."""
    values: dict[str, Any] = {"commit_interval_s": 0.05, "shard_max_records": 100, "in_flight": lambda _: 1}
    writer = RecordWriter(storage, WorkerMetrics(), worker_tag="w1", **(values | options))
    writer.start()
    return writer


def _record(job_id: str, sample_id: str = "s0") -> Any:
    return make_record(sample_id, [1, 2, 3], 2, job_id=job_id)


async def test_a_new_jobs_first_record_does_not_wait_behind_other_jobs(
    storage: Storage, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow = _SlowCommits(storage, monkeypatch, delay_s=0.0)
    writer = _busy_writer(storage)
    old = [f"old{i}" for i in range(200)]
    # Their first records (committed at once, as any job's first); the next ones wait their turn.
    await asyncio.gather(*(writer.commit(_record(job_id)) for job_id in old))
    slow.delay_s = SLOW_COMMIT_S
    waiting = [asyncio.ensure_future(writer.commit(_record(j, f"s{k}"))) for j in old for k in (1, 2)]
    await asyncio.sleep(0.1)  # their interval is over: 200 shards due, 4 s of writes one at a time
    assert writer.pending >= 200
    started = time.monotonic()
    await writer.commit(_record("new"))
    waited_s = time.monotonic() - started
    print(f"new job's first record committed in {waited_s:.3f} s, {writer.pending} records still waiting")
    assert waited_s < 1.0
    slow.delay_s = 0.0
    await asyncio.gather(*waiting)
    assert await writer.close(deadline_s=float("inf"))
    assert [len(storage.list_commits(job_id)) for job_id in ("old0", "new")] == [2, 1]


async def test_a_new_jobs_first_record_goes_before_other_jobs_last_records(
    storage: Storage, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow = _SlowCommits(storage, monkeypatch, delay_s=0.0)
    in_flight = dict.fromkeys((f"small{i}" for i in range(400)), 1)
    writer = _busy_writer(storage, commit_interval_s=30.0, in_flight=lambda job_id: in_flight.get(job_id, 1))
    small = sorted(in_flight)
    await asyncio.gather(*(writer.commit(_record(job_id)) for job_id in small))  # their first records
    slow.delay_s = SLOW_COMMIT_S
    for job_id in small:
        in_flight[job_id] = 0
    # 400 jobs' last records, each due early: 400 shards, a second of writes 8 at a time.
    last = [asyncio.ensure_future(writer.commit(_record(j, "s1"))) for j in small]
    await asyncio.sleep(0.1)
    started = time.monotonic()
    await writer.commit(_record("big"))
    waited_s = time.monotonic() - started
    left = sum(not f.done() for f in last)
    print(f"new job's first record committed in {waited_s:.3f} s; {left} small jobs' last records waiting")
    assert waited_s < 0.3 and left > 100  # ahead of them, not after
    await asyncio.gather(*last)
    assert await writer.close(deadline_s=float("inf"))


async def test_records_ending_together_share_one_shard(storage: Storage) -> None:
    writer = _busy_writer(storage, commit_interval_s=30.0, in_flight=lambda _: 0)
    # A small job's prompts end within a few ms of each other: its first record waits for the rest.
    first = asyncio.ensure_future(writer.commit(_record("small", "s0")))
    await asyncio.sleep(0.01)
    await asyncio.gather(first, writer.commit(_record("small", "s1")), writer.commit(_record("small", "s2")))
    assert len(storage.list_commits("small")) == 1
    assert await writer.close(deadline_s=float("inf"))


async def test_commits_of_different_jobs_overlap_up_to_the_bound(
    storage: Storage, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow = _SlowCommits(storage, monkeypatch, delay_s=SLOW_COMMIT_S)
    writer = _busy_writer(storage, max_concurrent_commits=4)
    jobs = [f"job{i}" for i in range(40)]
    await asyncio.gather(*(writer.commit(_record(job_id, f"s{k}")) for job_id in jobs for k in range(3)))
    assert await writer.close(deadline_s=float("inf"))
    assert 1 < slow.peak <= 4
    assert slow.peak_per_job == 1  # one job's shards one after the other
    for job_id in jobs:
        ids = Counter(r["sample_id"] for b in storage.iter_record_batches(job_id) for r in b.to_pylist())
        assert ids == {"s0": 1, "s1": 1, "s2": 1}


async def test_a_jobs_last_record_is_committed_without_waiting_for_the_interval(storage: Storage) -> None:
    in_flight = {"job1": 2}
    writer = _busy_writer(storage, commit_interval_s=30.0, in_flight=lambda job_id: in_flight[job_id])
    started = time.monotonic()
    await writer.commit(_record("job1", "s1"))  # the job's first record here: at once
    in_flight["job1"] = 1
    second = asyncio.ensure_future(writer.commit(_record("job1", "s2")))
    await asyncio.sleep(0.2)
    assert not second.done()  # another prompt of the job is generating: its record waits to join it
    in_flight["job1"] = 0
    await writer.commit(_record("job1", "s3"))  # the last: both go at once, in one shard
    await second
    assert time.monotonic() - started < 1.0
    assert [c["records"] for c in storage.list_commits("job1")] == [1, 2]
    assert await writer.close(deadline_s=float("inf"))


async def test_a_failing_jobs_backoff_does_not_delay_the_others(
    storage: Storage, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow = _SlowCommits(storage, monkeypatch, delay_s=SLOW_COMMIT_S)
    slow.failing.add("bad")
    reports: list[tuple[str, str | None]] = []
    writer = _busy_writer(
        storage,
        commit_interval_s=0.02,
        max_concurrent_commits=3,  # the failing job holds one at most
        on_storage_error=lambda job_id, error: reports.append((job_id, error)),
    )

    async def three_rounds(prefix: str) -> float:
        started = time.monotonic()
        for k in range(3):  # the first records at once, the others at the interval
            await asyncio.gather(*(writer.commit(_record(f"{prefix}{i}", f"s{k}")) for i in range(10)))
        return time.monotonic() - started

    # The same rounds with no job failing, as a baseline (after a first run of them, whose storage
    # and imports warm up: it takes twice as long): a loaded CI machine once took 2.2 s for what
    # takes 0.4 s here.
    await three_rounds("warm")
    calm_s = await three_rounds("calm")
    bad = asyncio.ensure_future(writer.commit(_record("bad")))
    await wait_until_async(lambda: slow.tries["bad"] >= 2, 5, NOT_MET)  # backing off now
    good_s = await three_rounds("good")
    assert good_s < max(1.0, 3 * calm_s), (good_s, calm_s)
    assert not bad.done() and writer.pending == 1
    last_report = {job_id: error for job_id, error in reports}
    assert last_report.pop("bad") is not None
    assert set(last_report.values()) <= {None}  # told of the shared failure at most until its commit
    assert not await writer.close(deadline_s=0)  # the bad job's record is kept, not lost
    bad.cancel()
