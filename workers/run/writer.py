"""Group commit of records into Parquet shards.

Tasks hand a record to :meth:`RecordWriter.commit` and wait; the writer gathers records per job and
incarnation (a batch) and commits a batch as one shard when it is due:

* early for a batch's first record in this writer (a new job's first record is counted within a
  commit's time, however many jobs run; these go before every other batch), for a record whose job
  has no other prompt in flight in this worker (``in_flight``: its last records, so a small job
  completes as soon as it can), each after ``EARLY_GATHER_S`` so that the records of prompts ending
  together share one shard, and at once for a full shard;
* otherwise ``commit_interval_s`` after the batch began waiting, so that records gather.

Up to ``max_concurrent_commits`` batches of different jobs commit at once, each in a thread; one
job's commits go one at a time, in order. Batches due at once go first, then the others in the order
they began waiting: a new job never queues behind hundreds of small jobs' shards. A pass of the loop
costs the batches it starts or skips, never all that wait.

Only when the shard and its commit file are durable do the waiting tasks resume and finish their RQ
jobs, so an RQ job is never finished for a record that is not stored. A failed commit keeps the
records and tries again with a backoff of its job's own (the other jobs commit at their pace); their
RQ jobs stay started meanwhile. The storage is shared: while a commit fails, every job with records
waiting here shows ``storage_error`` until a commit of its own goes through, and admission
(`workers.claim.admission`) claims no more once :attr:`RecordWriter.pending` reaches
``max_uncommitted_records``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import redis

from datagen.backoff import Backoff
from datagen.clock import now_ms
from datagen.control.payload import counts_in
from datagen.errors import JobNotFoundError, StorageError
from datagen.records.schema import Record, records_to_table
from datagen.records.storage import Storage
from workers.metrics import WorkerMetrics

__all__ = ["MAX_CONCURRENT_COMMITS", "RecordWriter"]

log = logging.getLogger(__name__)

COMMIT_RETRY_MAX_S = 30.0
# Commits of different jobs running at once, each a thread (the Arrow conversion and the write):
# enough to overlap an object store's latency, few enough to leave the default executor to others.
MAX_CONCURRENT_COMMITS = 8
# Batches remembered as having had records here; beyond this the oldest is forgotten, which costs
# at most one early commit of it.
SEEN_BATCHES_MAX = 65_536
# While storage fails, one log line per this interval, not one per failed commit.
ERROR_LOG_INTERVAL_S = 5.0
# A job's first record, or its last ones, wait this long for the records of prompts that end with
# them (one shard, one ack, instead of several): well within the second its first count may take.
EARLY_GATHER_S = 0.05


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
        in_flight: Callable[[str], int] | None = None,
        max_concurrent_commits: int = MAX_CONCURRENT_COMMITS,
    ) -> None:
        self.storage = storage
        self.metrics = metrics
        self.worker_tag = worker_tag
        self.commit_interval_s = commit_interval_s
        self.shard_max_records = shard_max_records
        self.max_concurrent_commits = max_concurrent_commits
        # The job's incarnation now (None: the job is gone); read just before a shard is written.
        self.current_incarnation = current_incarnation
        # The job's prompts in flight in this worker that have not handed their record over yet.
        self.in_flight = in_flight
        self._pending: dict[_Batch, list[_Pending]] = {}
        self._waiting = 0  # records in _pending, kept so that `pending` costs nothing
        # When each batch not being committed began waiting (monotonic s). Insertion order is time
        # order, so a pass stops at the first batch not yet due.
        self._since: dict[_Batch, float] = {}
        # Batches to commit early, each with when it is due (monotonic s): a job's first record
        # (`_first`, served before the others, so a new job never waits behind hundreds of small
        # jobs' last shards), a full shard or a job's last records (`_urgent`).
        self._first: dict[_Batch, float] = {}
        self._urgent: dict[_Batch, float] = {}
        self._seen: dict[_Batch, None] = {}
        self._running: dict[str, asyncio.Task[str | None]] = {}  # per job: its commit now
        self._flushing = False
        self._wake = asyncio.Event()
        self._seq = 0
        self._task: asyncio.Task[None] | None = None
        # Per job: the backoff of its failed commits, and when its next try is due (per job, so a
        # job whose storage fails never slows the commits of the others).
        self._backoffs: dict[str, Backoff] = {}
        self._retry_at: dict[str, float] = {}
        self.on_storage_error = on_storage_error
        self._failing: set[str] = set()
        self._errors: dict[str, str] = {}  # failed commits not yet told to the waiting jobs
        self._error_logged_at = -math.inf

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="record-writer")

    async def commit(self, record: Record, incarnation: str = "") -> None:
        """Return once ``record`` is durably committed. Raises JobNotFoundError when its job was
        deleted (or its id reused by a new job) meanwhile: the record is dropped, not stored."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        key = (record.job_id, incarnation)
        batch = self._pending.setdefault(key, [])
        batch.append(_Pending(record, done))
        self._waiting += 1
        self._since.setdefault(key, time.monotonic())
        first = key not in self._seen
        if first:
            self._seen[key] = None
            if len(self._seen) > SEEN_BATCHES_MAX:
                del self._seen[next(iter(self._seen))]
        now = time.monotonic()
        if len(batch) >= self.shard_max_records:
            self._urgent[key] = now
            self._wake.set()
        elif first:
            # Records of prompts that end together (a small job's) join the same shard.
            self._first.setdefault(key, now + EARLY_GATHER_S)
            self._wake.set()
        elif self._idle(record.job_id):
            self._urgent.setdefault(key, now + EARLY_GATHER_S)
            self._wake.set()
        await asyncio.shield(done)

    def _idle(self, job_id: str) -> bool:
        return self.in_flight is not None and self.in_flight(job_id) <= 0

    @property
    def pending(self) -> int:
        """Records waiting for their commit, of every job."""
        return self._waiting

    def crowded_jobs(self, at_least: int) -> set[str]:
        """The jobs with at least ``at_least`` records waiting for their commit (admission claims
        none of their prompts: one job whose commits fail cannot take the whole budget)."""
        waiting: dict[str, int] = defaultdict(int)
        for (job_id, _), batch in self._pending.items():
            waiting[job_id] += len(batch)
        return {job_id for job_id, n in waiting.items() if n >= at_least}

    async def _loop(self) -> None:
        while True:
            self._wake.clear()
            timeout_s = self._start_due()
            # Not wait_for: on 3.11 it swallows a cancel that meets a wake-up (a commit that just
            # ended), and close() would wait on this loop for ever.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await self._wake.wait()

    def _start_due(self) -> float:
        """Start the commits due, as many as the bound allows: urgent batches first, then those
        whose interval is over. Returns the seconds until the next may be due (a commit that ends
        wakes the loop sooner)."""
        self._report_errors()
        now = time.monotonic()
        next_at = now + self.commit_interval_s
        free = 0 if self._flushing else self.max_concurrent_commits - len(self._running)
        chosen: dict[str, _Batch] = {}
        for early in (self._first, self._urgent):
            for key, due_at in early.items():
                if len(chosen) >= free:
                    break
                if due_at > now:
                    next_at = min(next_at, due_at)
                    continue
                next_at = min(next_at, self._choose(key, now, chosen))
        for key, since in self._since.items():
            if len(chosen) >= free:
                break
            if since + self.commit_interval_s > now:
                next_at = min(next_at, since + self.commit_interval_s)
                break
            next_at = min(next_at, self._choose(key, now, chosen))
        for key in chosen.values():
            self._start(key)
        return max(0.0, next_at - now)

    def _choose(self, key: _Batch, now: float, chosen: dict[str, _Batch]) -> float:
        """Choose ``key`` if its job may commit now; returns when to look again if not (inf: when
        the job's running commit ends, which wakes the loop)."""
        job_id = key[0]
        if job_id in self._running or job_id in chosen:
            return math.inf
        retry_at = self._retry_at.get(job_id, 0.0)
        if retry_at > now:
            return retry_at
        chosen[job_id] = key
        return math.inf

    def _start(self, key: _Batch) -> None:
        job_id = key[0]
        task = asyncio.create_task(self._commit(key), name=f"commit-{job_id}")
        self._running[job_id] = task
        task.add_done_callback(lambda _: self._ended(job_id))

    def _ended(self, job_id: str) -> None:
        self._running.pop(job_id, None)
        self._wake.set()  # a slot is free, and the job may have more waiting

    async def flush(self) -> bool:
        """Commit everything waiting, backoff or not (the final flush): up to the bound at once,
        each job's batches in order. False if some commit failed (its records are kept); then every
        job with records still waiting is told its storage is failing."""
        self._flushing = True
        try:
            while self._running:
                await asyncio.wait(list(self._running.values()))
            by_job: dict[str, list[_Batch]] = defaultdict(list)
            for key in self._pending:
                by_job[key[0]].append(key)
            bound = asyncio.Semaphore(self.max_concurrent_commits)

            async def commit_job(keys: list[_Batch]) -> bool:
                ok = True
                for key in keys:
                    async with bound:
                        ok = await self._commit(key) is None and ok
                return ok

            results = await asyncio.gather(*(commit_job(keys) for keys in by_job.values()))
        finally:
            self._flushing = False
            self._wake.set()
        self._report_errors()
        return all(results)

    async def _commit(self, key: _Batch) -> str | None:
        """Commit the records of one batch waiting now, a shard at a time (those that arrive
        meanwhile wait for the next commit). Returns the error of a failed commit: its records are
        kept, and its job backs off."""
        job_id = key[0]
        self._since.pop(key, None)
        self._first.pop(key, None)
        self._urgent.pop(key, None)
        try:
            await self._commit_shards(key, len(self._pending.get(key, ())))
        except StorageError as exc:
            error = str(exc)
        except Exception as exc:  # a bug must not stop every job's commits: retried like storage
            log.exception("commit of job %s crashed", job_id)
            error = f"commit crashed: {exc!r}"
        else:
            self._backoffs.pop(job_id, None)
            self._retry_at.pop(job_id, None)
            return None
        finally:
            if self._pending.get(key):
                self._since.setdefault(key, time.monotonic())
        self.metrics.commit_errors.inc()
        first_s = min(COMMIT_RETRY_MAX_S, self.commit_interval_s * 2)
        backoff_s = self._backoffs.setdefault(job_id, Backoff(first_s, COMMIT_RETRY_MAX_S)).next_s()
        self._retry_at[job_id] = time.monotonic() + backoff_s
        self._errors[job_id] = error
        return error

    async def _commit_shards(self, key: _Batch, count: int) -> None:
        """Commit the first ``count`` records of one batch, a shard at a time; raises StorageError
        (the records not committed are kept)."""
        job_id, incarnation = key
        while count > 0 and self._pending.get(key):
            batch = self._pending[key][: min(count, self.shard_max_records)]
            count -= len(batch)
            try:
                await self._commit_batch(job_id, incarnation, batch)
            except JobNotFoundError as exc:
                log.info("dropped %d records: %s", len(batch), exc)
                self._take(key, len(batch))
                self._failing.discard(job_id)
                for item in batch:
                    if not item.done.done():
                        item.done.set_exception(exc)
                continue
            self._report(job_id, None)
            self._take(key, len(batch))
            for item in batch:
                if not item.done.done():
                    item.done.set_result(None)

    def _take(self, key: _Batch, n: int) -> None:
        """Forget the first ``n`` records of a batch (committed or dropped)."""
        batch = self._pending[key]
        del batch[:n]
        self._waiting -= n
        if not batch:
            del self._pending[key]
            self._since.pop(key, None)
            self._first.pop(key, None)
            self._urgent.pop(key, None)

    def _report_errors(self) -> None:
        """Tell the jobs of the commits that failed since last time, and every other job with
        records waiting (not committing right now: its own outcome comes in a moment) that is not
        told already: the storage is shared."""
        if not self._errors:
            return
        errors, self._errors = self._errors, {}
        first = next(iter(errors.values()))
        waiting = {job_id for job_id, _ in self._pending if job_id not in self._running}
        now = time.monotonic()
        if now - self._error_logged_at >= ERROR_LOG_INTERVAL_S:
            self._error_logged_at = now
            log.error(
                "commit failed, %d records of %d jobs kept and retried: %s",
                self.pending,
                len({job_id for job_id, _ in self._pending}),
                first,
            )
        for job_id in sorted(waiting):
            if job_id in errors:
                self._report(job_id, errors[job_id])
            elif job_id not in self._failing:
                self._report(job_id, first)

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
        self.storage.commit_shard(job_id, shard, records_to_table(records), info)
        try:
            self._check_live(job_id, incarnation)
        except JobNotFoundError:
            # Deleted before or while the shard was written: a delete removes the job's keys before
            # its files, so either its removal of the files comes after this write, or this check
            # sees it. One check, after the write, is enough: a check before it too would cost every
            # shard a command to spare the rare shard of a deleted job its write.
            self.storage.remove_shard(job_id, shard)
            raise

    def _check_live(self, job_id: str, incarnation: str) -> None:
        """Refuse records of a job deleted meanwhile (or of an earlier job of a reused id: records
        that no longer count in it, `datagen.control.payload.counts_in`), once its shard is written.
        Whatever is left over (a delete that kept its files, a removal that failed) stays out of
        exports all the same: its commit names the old incarnation."""
        if self.current_incarnation is None:
            return
        try:
            current = self.current_incarnation(job_id)
        except redis.RedisError:
            return  # unknown now; the commit's incarnation still keeps exports right
        if not counts_in(incarnation, current):
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
