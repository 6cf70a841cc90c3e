"""Group commit of records into Parquet shards.

Tasks hand a record to :meth:`RecordWriter.commit` and wait; the writer collects records per
job and commits a shard when it is full or ``commit_interval_s`` has passed. Only when the shard
and its commit file are durable do the waiting tasks resume and finish their RQ jobs, so an RQ
job is never finished for a record that is not stored. A failed commit keeps the records and
tries again with backoff; their RQ jobs stay started meanwhile. The storage is shared: while a
commit fails, every job with records waiting here shows ``storage_error`` until a commit of its own
goes through, and admission (`workers.admission`) claims no more once :attr:`RecordWriter.pending`
reaches ``max_uncommitted_records``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import redis

from datagen.errors import JobNotFoundError, StorageError
from datagen.jobs import now_ms
from datagen.records import Record, records_to_table
from datagen.storage import Storage
from workers.metrics import WorkerMetrics

__all__ = ["RecordWriter"]

log = logging.getLogger(__name__)

COMMIT_RETRY_MAX_S = 30.0


@dataclass
class _Pending:
    record: Record
    done: asyncio.Future[None]


# Records wait per job and incarnation: a shard holds one incarnation's records, named in its commit.
_Batch = tuple[str, str]


class RecordWriter:
    def __init__(
        self,
        storage: Storage,
        metrics: WorkerMetrics,
        *,
        worker_tag: str,
        commit_interval_s: float,
        shard_max_records: int,
        on_storage_error: Callable[[str, str | None], None] | None = None,
        current_incarnation: Callable[[str], str | None] | None = None,
    ) -> None:
        self.storage = storage
        self.metrics = metrics
        self.worker_tag = worker_tag
        self.commit_interval_s = commit_interval_s
        self.shard_max_records = shard_max_records
        self._pending: dict[_Batch, list[_Pending]] = defaultdict(list)
        # The job's incarnation now (None: the job is gone); read just before a shard is written.
        self.current_incarnation = current_incarnation
        self._wake = asyncio.Event()
        self._seq = 0
        self._task: asyncio.Task[None] | None = None
        # Per job: commits failed in a row, and when its next try is due (backoff per job, so a
        # job whose storage fails never slows the commits of the others).
        self._failures: dict[str, int] = {}
        self._retry_at: dict[str, float] = {}
        self.on_storage_error = on_storage_error
        self._failing: set[str] = set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="record-writer")

    async def commit(self, record: Record, incarnation: str = "") -> None:
        """Return once ``record`` is durably committed. Raises JobNotFoundError when its job was
        deleted (or its id reused by a new job) meanwhile: the record is dropped, not stored."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        batch = self._pending[record.job_id, incarnation]
        batch.append(_Pending(record, done))
        if len(batch) >= self.shard_max_records:
            self._wake.set()
        await asyncio.shield(done)

    @property
    def pending(self) -> int:
        """Records waiting for their commit, of every job."""
        return sum(len(b) for b in self._pending.values())

    def crowded_jobs(self, at_least: int) -> set[str]:
        """The jobs with at least ``at_least`` records waiting for their commit (admission claims
        none of their prompts: one job whose commits fail cannot take the whole budget)."""
        waiting: dict[str, int] = defaultdict(int)
        for (job_id, _), batch in self._pending.items():
            waiting[job_id] += len(batch)
        return {job_id for job_id, n in waiting.items() if n >= at_least}

    async def _loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=self.commit_interval_s)
            self._wake.clear()
            await self.flush(due_only=True)

    async def flush(self, *, due_only: bool = False) -> bool:
        """Commit everything pending (``due_only``: not the jobs whose retry backoff still runs);
        False if some commit failed (its records are kept). A job whose commit fails does not hold
        back the others; when one fails, every job with records still waiting is told its storage
        is failing."""
        errors: dict[str, str] = {}
        now = time.monotonic()
        for key in list(self._pending):
            job_id = key[0]
            if due_only and self._retry_at.get(job_id, 0.0) > now:
                continue
            try:
                await self._flush_batch(key)
            except StorageError as exc:
                self.metrics.commit_errors.inc()
                errors[job_id] = str(exc)
                failures = self._failures[job_id] = self._failures.get(job_id, 0) + 1
                backoff_s = min(COMMIT_RETRY_MAX_S, self.commit_interval_s * 2**failures)
                self._retry_at[job_id] = time.monotonic() + backoff_s
            else:
                self._failures.pop(job_id, None)
                self._retry_at.pop(job_id, None)
        if not errors:
            return True
        first = next(iter(errors.values()))
        waiting = {job_id for job_id, _ in self._pending}
        log.error(
            "commit failed, %d records of %d jobs kept and retried: %s", self.pending, len(waiting), first
        )
        for job_id in sorted(waiting):
            self._report(job_id, errors.get(job_id, first))
        return False

    async def _flush_batch(self, key: _Batch) -> None:
        """Commit the records of one job and incarnation, a shard at a time; raises StorageError
        (the records not committed are kept)."""
        job_id, incarnation = key
        while self._pending.get(key):
            batch = self._pending[key][: self.shard_max_records]
            try:
                await self._commit_batch(job_id, incarnation, batch)
            except JobNotFoundError as exc:
                log.info("dropped %d records: %s", len(batch), exc)
                del self._pending[key][: len(batch)]
                self._failing.discard(job_id)
                for item in batch:
                    if not item.done.done():
                        item.done.set_exception(exc)
                continue
            self._report(job_id, None)
            del self._pending[key][: len(batch)]
            for item in batch:
                if not item.done.done():
                    item.done.set_result(None)
        self._pending.pop(key, None)

    def _report(self, job_id: str, error: str | None) -> None:
        """Tell the job's status about a storage failure, and that it is over."""
        if self.on_storage_error is None or (error is None and job_id not in self._failing):
            return
        if error is None:
            self._failing.discard(job_id)
        else:
            self._failing.add(job_id)
        try:
            self.on_storage_error(job_id, error)
        except Exception as exc:  # the status is advisory; the commit retry loop must go on
            log.warning("cannot report the storage state of job %s: %s", job_id, exc)

    async def _commit_batch(self, job_id: str, incarnation: str, batch: list[_Pending]) -> None:
        self._seq += 1
        shard = f"{self.worker_tag}-{self._seq:08d}"
        records = [p.record for p in batch]
        info = {"worker": self.worker_tag, "committed_at_ms": now_ms(), "incarnation": incarnation}
        started = time.perf_counter()
        # Building the Arrow table costs about a microsecond per token: keep it off the event loop.
        await asyncio.to_thread(self._write, job_id, incarnation, shard, records, info)
        self.metrics.records_committed.inc(len(batch))
        log.debug("committed %s (%d records) in %.3f s", shard, len(batch), time.perf_counter() - started)

    def _write(
        self, job_id: str, incarnation: str, shard: str, records: list[Record], info: dict[str, object]
    ) -> None:
        self._check_live(job_id, incarnation)
        self.storage.commit_shard(job_id, shard, records_to_table(records), info)
        try:
            self._check_live(job_id, incarnation)
        except JobNotFoundError:
            # Deleted while the shard was written: a delete removes the job's keys before its files,
            # so either its removal of the files comes after this write, or this check sees it.
            self.storage.remove_shard(job_id, shard)
            raise

    def _check_live(self, job_id: str, incarnation: str) -> None:
        """Refuse records of a job deleted meanwhile (or of an earlier job of a reused id), before
        and after the shard is written. Whatever is left over (a delete that kept its files)
        stays out of exports all the same: its commit names the old incarnation."""
        if self.current_incarnation is None:
            return
        try:
            current = self.current_incarnation(job_id)
        except redis.RedisError:
            return  # unknown now; the commit's incarnation still keeps exports right
        if current is None or current != incarnation:
            raise JobNotFoundError(f"job {job_id} was deleted or replaced by a new job of the same id")

    async def close(self, deadline_s: float) -> bool:
        """Final flush, retried until ``deadline_s`` (monotonic); True if nothing is left."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        while self.pending:
            if await self.flush():
                break
            if time.monotonic() >= deadline_s:
                return False
            await asyncio.sleep(min(1.0, max(0.0, deadline_s - time.monotonic())))
        return True
