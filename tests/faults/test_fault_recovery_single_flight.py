"""Issue 36, items 1 and 2: recovery that cannot double work, and an epoch no clock can fool.

Over real processes (Redis, a simulator, a worker and **two coordinators** of one namespace, the
second with its wall clock 5 s behind):

1. Eight concurrent ``POST /jobs/{id}/recover`` of a running job, split over both coordinators,
   make **one** rebuild: every answer is 200 with that rebuild's note (seven say they joined it),
   the job is counted once (rows, total, done) and completes, and no prompt whose record was
   committed before the recovers runs again. Before: 8 ingestion threads, rows 18,014 for a
   3,000-line file and 5,946 prompts generated again.
2. Redis restarted empty mid-job: one coordinator rebuilds the job, the other takes its settled
   epoch and rebuilds nothing (before, both rebuilt: counts off, a job rebuilt twice), and the job
   completes with the same bar. Before the loss, a minute's worth of the skewed coordinator's
   ticks made no false rollback: the job was not rebuilt.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.support.faults import HTTP_TIMEOUT_S, POLL_S, FaultStack, all_records, check_final_state, rows_for
from tests.support.metrics import metric_value
from tests.support.wait import wait_until

pytestmark = pytest.mark.faults

PROMPTS = 1_200
MAX_NEW_TOKENS = 200
CONCURRENCY = 16
RECOVERS = 8
CLOCK_OFFSET_S = -5.0
COMPLETE_TIMEOUT_S = 240.0


def _servers(url: str) -> list[str]:
    try:
        body = httpx.get(f"{url}/servers", timeout=HTTP_TIMEOUT_S).json()
    except httpx.HTTPError:
        return []
    return [s["name"] for s in body.get("servers", [])]


def _start(make_stack: Callable[..., FaultStack], namespace: str) -> tuple[FaultStack, str, str, list]:
    stack = make_stack(namespace)
    stack.add_sim("a", time_scale=0.02)
    stack.start_coordinator()
    other = stack.start_another_coordinator(clock_offset_s=CLOCK_OFFSET_S)
    stack.start_worker("worker", ["a"], concurrency=CONCURRENCY)
    wait_until(lambda: _servers(other) == ["a"], 30, "the worker to publish its server", interval_s=POLL_S)
    rows = rows_for(PROMPTS)
    job_id = stack.submit(rows, max_new_tokens=MAX_NEW_TOKENS)
    wait_until(
        lambda: stack.job(job_id)["done"] >= PROMPTS // 4, 120, "a quarter of the job", interval_s=POLL_S
    )
    return stack, other, job_id, rows


def _found(url: str, job_id: str) -> bool:
    try:
        return httpx.get(f"{url}/jobs/{job_id}", timeout=HTTP_TIMEOUT_S).status_code == 200
    except httpx.HTTPError:
        return False


def _committed(stack: FaultStack, job_id: str) -> Counter[tuple[str, int, int]]:
    return Counter((r["sample_id"], r["turn"], r["gen"]) for r in all_records(stack.storage, job_id))


def _rebuilds(urls: list[str], reason: str) -> float:
    """Jobs rebuilt for ``reason``, counted by every coordinator together."""
    return sum(
        metric_value(
            httpx.get(f"{url}/metrics", timeout=HTTP_TIMEOUT_S).text,
            "datagen_jobs_rebuilt_total",
            reason=reason,
        )
        for url in urls
    )


def _check(
    stack: FaultStack, job_id: str, rows: list, before: Counter[tuple[str, int, int]], label: str
) -> dict[str, Any]:
    final = check_final_state(stack, job_id, rows, max_new_tokens=MAX_NEW_TOKENS, label=label)
    assert final.job["rows"] == len(rows), final.job
    after = Counter((r["sample_id"], r["turn"], r["gen"]) for r in final.records)
    again = [key for key in before if after[key] > before[key]]
    assert again == [], f"{len(again)} prompts with a committed record were generated again: {again[:5]}"
    # Only prompts in flight at the rebuild may run twice: generating (CONCURRENCY), or generated
    # with their records waiting for their shard's commit (about as many again here), with room.
    assert final.wasted <= 3 * CONCURRENCY + sum(n - 1 for n in before.values()), final.wasted
    rebuilt = final.job["rebuilt"]
    assert rebuilt is not None and rebuilt["rebuilds"] == 1, rebuilt
    print(f"  committed before: {len(before)}; generated twice: {final.wasted}; rebuilt: {rebuilt['reason']}")
    return final.job


def test_concurrent_recovers_over_two_coordinators_rebuild_once(
    make_stack: Callable[..., FaultStack],
) -> None:
    stack, other, job_id, rows = _start(make_stack, "recovers")
    urls = [stack.coordinator_url, other]
    assert stack.job(job_id)["rebuilt"] is None, "a rebuild before any was asked for (a false rollback?)"
    before = _committed(stack, job_id)
    answers: list[httpx.Response] = []
    barrier = threading.Barrier(RECOVERS)

    def recover(url: str) -> None:
        barrier.wait()
        answers.append(httpx.post(f"{url}/jobs/{job_id}/recover", timeout=120))

    threads = [threading.Thread(target=recover, args=(urls[n % 2],)) for n in range(RECOVERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [a.status_code for a in answers] == [200] * RECOVERS, [a.text for a in answers]
    stack.wait_completed(job_id, COMPLETE_TIMEOUT_S)

    assert _rebuilds(urls, "recover") == 1, "the job was rebuilt more than once"
    _check(stack, job_id, rows, before, "8 concurrent recovers")
    bodies = [a.json() for a in answers]
    assert sorted(b["joined"] for b in bodies) == [False] + [True] * (RECOVERS - 1)
    assert len({b["rebuilt"]["at_ms"] for b in bodies}) == 1, "every answer is the one rebuild's"


def test_two_coordinators_after_redis_restarted_empty_rebuild_once(
    make_stack: Callable[..., FaultStack],
) -> None:
    stack, other, job_id, rows = _start(make_stack, "twolost")
    urls = [stack.coordinator_url, other]
    assert stack.job(job_id)["rebuilt"] is None, "a rebuild before the loss (a false rollback?)"
    stack.kill_redis()
    before = _committed(stack, job_id)
    stack.restart_redis()  # no AOF, no snapshot: empty
    lost_at = time.monotonic()
    wait_until(lambda: _found(stack.coordinator_url, job_id), 60, "the job to be rebuilt", interval_s=POLL_S)
    stack.wait_completed(job_id, COMPLETE_TIMEOUT_S)
    print(f"\n  completed {time.monotonic() - lost_at:.1f} s after the loss")

    assert _rebuilds(urls, "lost") == 1, "both coordinators rebuilt the job"
    job = _check(stack, job_id, rows, before, "two coordinators, Redis lost")
    assert job["rebuilt"]["reason"] == "Redis lost its data"
    logs = "".join(stack.procs.log_path(name).read_text() for name in ("coordinator", "coordinator-b"))
    # The other may say "another coordinator is rebuilding jobs from storage" (it saw the loss while
    # the lease was held): only "; rebuilding" is a reconcile of its own.
    assert logs.count("; rebuilding jobs from storage") == 1, "one coordinator reconciles the loss"
    assert "went back to an older snapshot" not in logs, "a false rollback"
