"""Issue 5, case 10 (the CI part of ``bench/ingest_load.py``): ingestion memory does not grow with size.

A real coordinator process ingests 10,000 and then 50,000 short prompts, each on a fresh Redis,
with ``DATAGEN_MAX_QUEUED_PER_CLASS=5000`` so that Redis holds a bounded window of the queue. A
thread stands in for the fleet: once the queue first reaches the window (so both sizes start
from a full window), it pops 2,000 prompts a second off the queue and deletes their RQ job hashes,
as finished jobs expire. That is slower than the coordinator ingests (about 2,500 prompts/s when
not waiting), so ingestion keeps waiting for room; without the window the queue would hold some
10,000 more prompts at the larger size. (A worker on a time-scale-0 simulator does about 60
prompts/s on 2 cores, and 20,000 vs 100,000 prompts at 2,000/s would take about 70 s, over this
suite's budget: hence 10k vs 50k.)

Measured per size: the coordinator's peak RSS (``VmHWM`` in ``/proc/<pid>/status``), Redis's
``used_memory_peak``, the time and rate of the ingestion, and the size of the job's rows guard
(``{ns}:job:<id>:rows``), which by design keeps one entry per row (about 60-100 bytes each) so that a
prompt is never enqueued twice and an id is never reused with other content. Bounds: 40,000 more
prompts may add at most 16 MiB of coordinator RSS (a coordinator that held the dataset would add
about 60 MiB) and 160 bytes a prompt in Redis (the rows guard and the dedup state; a queue without the
window would add about 1 KiB a prompt).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from datagen.states import Priority, PromptClass
from tests.support.faults import POLL_S, FaultStack, rows_for
from tests.support.wait import wait_until

pytestmark = pytest.mark.faults

SIZES = (10_000, 50_000)
WINDOW = 5_000
DRAIN_PER_S = 2_000
DRAIN_TICK_S = 0.05
CHUNK = 1_000  # DATAGEN_ENQUEUE_CHUNK's default
MAX_RSS_GROWTH_BYTES = 16 * 1024**2
# The rows guard (about 96 B a row, measured) and the exact-dedup record (12 B a row) are kept for the
# job's life by design; the rest is noise in Redis's peak (measured 108-135 B a prompt in all). A
# queue without the window would add about 1 KiB a prompt.
MAX_REDIS_BYTES_PER_PROMPT = 160


@dataclass
class Run:
    prompts: int
    seconds: float
    coordinator_rss_peak: int
    redis_peak: int
    guard_set_bytes: int
    queue_peak: int

    def line(self) -> str:
        return (
            f"  {self.prompts:>7} prompts: {self.seconds:5.1f} s ({self.prompts / self.seconds:5.0f}/s), "
            f"coordinator peak RSS {self.coordinator_rss_peak / 2**20:6.1f} MiB, Redis peak "
            f"{self.redis_peak / 2**20:5.1f} MiB (rows guard {self.guard_set_bytes / 2**20:4.1f} MiB), "
            f"queue peak {self.queue_peak}"
        )


def _peak_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc: Linux only")


class Drainer:
    """Once the queue is full, pops ``DRAIN_PER_S`` prompts a second and deletes their job hashes."""

    def __init__(self, stack: FaultStack) -> None:
        self.stack = stack
        self.popped = 0
        self.queue_peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _backlog(self) -> str | None:
        """The backlog of the one job being ingested (prompts wait there until dispatched)."""
        keys = self.stack.keys
        jobs = self.stack.redis.zrange(keys.dispatch_jobs(PromptClass.SHORT, Priority.NORMAL), 0, 0)
        return keys.job_backlog(jobs[0].decode(), PromptClass.SHORT) if jobs else None

    def __enter__(self) -> Drainer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        redis = self.stack.redis
        started: float | None = None
        while not self._stop.wait(DRAIN_TICK_S):
            backlog = self._backlog()
            if backlog is None:
                continue
            self.queue_peak = max(self.queue_peak, int(redis.llen(backlog)))
            if started is None:
                if self.queue_peak < WINDOW - CHUNK:
                    continue
                started = time.monotonic()
            due = int((time.monotonic() - started) * DRAIN_PER_S) - self.popped
            ids = redis.lpop(backlog, due) if due > 0 else None
            if ids:
                redis.delete(*[b"rq:job:" + i for i in ids])
                self.popped += len(ids)


def _ingest(make_stack: Callable[..., FaultStack], prompts: int) -> Run:
    env = {"DATAGEN_MAX_QUEUED_PER_CLASS": str(WINDOW), "DATAGEN_LOG_LEVEL": "WARNING"}
    stack = make_stack(f"mem{prompts}", env)
    coordinator = stack.start_coordinator()
    rows = rows_for(prompts)
    with Drainer(stack) as drainer:
        started = time.monotonic()
        job_id = stack.submit(rows, max_new_tokens=100)
        wait_until(lambda: stack.job(job_id)["state"] == "running", 300, "ingestion", interval_s=0.2)
        seconds = time.monotonic() - started
        wait_until(lambda: drainer.popped == prompts, 60, "the drainer to empty the queue", interval_s=POLL_S)
    job = stack.job(job_id)
    assert (job["total"], job["skipped"], job["rejected"]) == (prompts, 0, 0), job
    run = Run(
        prompts,
        seconds,
        _peak_rss_bytes(coordinator.pid),
        int(stack.redis.info("memory")["used_memory_peak"]),
        int(stack.redis.memory_usage(stack.keys.job_rows(job_id)) or 0),
        drainer.queue_peak,
    )
    stack.stop()
    return run


@pytest.mark.timeout(240)
def test_coordinator_and_redis_memory_stay_flat_from_10k_to_50k_prompts(
    make_stack: Callable[..., FaultStack],
) -> None:
    small, large = (_ingest(make_stack, n) for n in SIZES)
    extra = large.prompts - small.prompts
    rss_growth = large.coordinator_rss_peak - small.coordinator_rss_peak
    redis_growth = large.redis_peak - small.redis_peak
    print(f"\n[case 10: ingestion memory, window {WINDOW}]", small.line(), large.line(), sep="\n")
    print(
        f"  growth for {extra} more prompts: coordinator {rss_growth / 2**20:+.1f} MiB, Redis "
        f"{redis_growth / 2**20:+.1f} MiB ({redis_growth / extra:.0f} B a prompt; rows guard "
        f"{(large.guard_set_bytes - small.guard_set_bytes) / extra:.0f} B a prompt)"
    )
    # The queue filled up to the window (so ingestion waited for room) and never past it.
    assert all(WINDOW - CHUNK <= run.queue_peak <= WINDOW for run in (small, large))
    assert rss_growth <= MAX_RSS_GROWTH_BYTES
    assert redis_growth <= MAX_REDIS_BYTES_PER_PROMPT * extra
