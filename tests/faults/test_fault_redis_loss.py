"""Issue 22: Redis is working state, storage is the truth.

Over real processes (Redis, a simulator, a coordinator, a worker), Redis itself misbehaves as it
does when run without persistence, restored from a snapshot, or failed over to a lagging replica:

1. SIGKILLed and restarted **empty** mid-job, nothing else restarted. The worker publishes its
   servers again within seconds (submits are refused until some worker has), the coordinator
   sees the epoch gone and rebuilds the job from storage, and it completes with every prompt's
   record exactly once in the export, token-exact; only prompts in flight at the loss may have
   been generated twice.
2. SIGKILLed and restarted from an **older snapshot** (an RDB saved part way). The coordinator
   sees the epoch's sequence go back, rebuilds the job; no prompt whose record was committed
   before the loss is generated again, and the job completes without any restart.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

import httpx
import pytest

from tests.support.faults import HTTP_TIMEOUT_S, POLL_S, FaultStack, all_records, check_final_state, rows_for
from tests.support.wait import wait_until

pytestmark = pytest.mark.faults

PROMPTS = 600
MAX_NEW_TOKENS = 200
CONCURRENCY = 16
# What the issue asks: the servers are published again within 15 s of Redis coming back.
REPUBLISH_BUDGET_S = 15.0
COMPLETE_TIMEOUT_S = 240.0


def _servers(stack: FaultStack) -> list[str]:
    try:
        body = httpx.get(f"{stack.coordinator_url}/servers", timeout=HTTP_TIMEOUT_S).json()
    except httpx.HTTPError:
        return []
    return [s["name"] for s in body.get("servers", [])]


def _job_or_none(stack: FaultStack, job_id: str) -> dict[str, object] | None:
    try:
        response = httpx.get(f"{stack.coordinator_url}/jobs/{job_id}", timeout=HTTP_TIMEOUT_S)
    except httpx.HTTPError:
        return None
    return response.json() if response.status_code == 200 else None  # type: ignore[no-any-return]


def _start(make_stack: Callable[..., FaultStack], namespace: str) -> tuple[FaultStack, str, list]:
    stack = make_stack(namespace)
    stack.add_sim("a", time_scale=0.02)
    stack.start_coordinator()
    stack.start_worker("worker", ["a"], concurrency=CONCURRENCY)
    wait_until(lambda: _servers(stack) == ["a"], 30, "the worker to publish its server", interval_s=POLL_S)
    rows = rows_for(PROMPTS)
    job_id = stack.submit(rows, max_new_tokens=MAX_NEW_TOKENS)
    return stack, job_id, rows


def test_redis_restarted_empty_mid_job(make_stack: Callable[..., FaultStack]) -> None:
    stack, job_id, rows = _start(make_stack, "lost")
    wait_until(
        lambda: stack.job(job_id)["done"] >= PROMPTS // 4,
        120,
        "a quarter of the job to be done",
        interval_s=POLL_S,
    )

    stack.kill_redis()
    lost_at = time.monotonic()
    # Storage now holds at least what was committed before the loss: the rebuild reads it later.
    committed_before = Counter(
        (r["sample_id"], r["turn"], r["gen"]) for r in all_records(stack.storage, job_id)
    )
    stack.restart_redis()  # no AOF, no snapshot: empty
    waiting_since = time.monotonic()
    wait_until(
        lambda: _servers(stack) == ["a"],
        REPUBLISH_BUDGET_S + 5,
        "the server to be published again",
        interval_s=POLL_S,
        on_timeout=stack.logs,
    )
    back = time.monotonic() - waiting_since
    republished_s = time.monotonic() - lost_at
    wait_until(
        lambda: _job_or_none(stack, job_id) is not None, 30, "the job to be rebuilt", interval_s=POLL_S
    )
    stack.wait_completed(job_id, COMPLETE_TIMEOUT_S)
    whole_s = time.monotonic() - lost_at

    final = check_final_state(stack, job_id, rows, max_new_tokens=MAX_NEW_TOKENS, label="redis lost")
    rebuilt = final.job["rebuilt"]
    print(
        f"  servers published again {republished_s:.1f} s after the loss (waited {back:.1f} s); "
        f"job rebuilt ({rebuilt['reason']}: {rebuilt['committed']} committed), completed "
        f"{whole_s:.1f} s after the loss; generated twice: {final.wasted}"
    )
    assert republished_s <= REPUBLISH_BUDGET_S
    assert rebuilt is not None and rebuilt["reason"] == "Redis lost its data"
    # Only prompts not yet committed when Redis died (generating, or their records waiting for
    # their shard's commit) can have run twice: none with a committed record.
    after = Counter((r["sample_id"], r["turn"], r["gen"]) for r in final.records)
    again = [key for key in committed_before if after[key] > committed_before[key]]
    assert not again, f"{len(again)} prompts with a committed record ran again: {again[:5]}"


def test_redis_restored_from_an_older_snapshot_mid_job(make_stack: Callable[..., FaultStack]) -> None:
    stack, job_id, rows = _start(make_stack, "back")
    wait_until(
        lambda: stack.job(job_id)["done"] >= PROMPTS // 6,
        120,
        "a sixth of the job to be done",
        interval_s=POLL_S,
    )
    stack.redis.save()  # the snapshot Redis will come back with
    wait_until(
        lambda: stack.job(job_id)["done"] >= PROMPTS // 2,
        120,
        "half of the job to be done",
        interval_s=POLL_S,
    )

    stack.kill_redis()
    committed_before = Counter(
        (r["sample_id"], r["turn"], r["gen"]) for r in all_records(stack.storage, job_id)
    )
    stack.restart_redis()  # loads the older snapshot (dump.rdb)
    stack.wait_completed(job_id, COMPLETE_TIMEOUT_S)

    final = check_final_state(stack, job_id, rows, max_new_tokens=MAX_NEW_TOKENS, label="redis rolled back")
    rebuilt = final.job["rebuilt"]
    print(
        f"  done before the loss ~{len(committed_before)}; rebuilt ({rebuilt and rebuilt['reason']}); "
        f"generated twice: {final.wasted}"
    )
    assert rebuilt is not None and rebuilt["reason"] == "Redis went back to an older snapshot"
    # As after a loss: only prompts not yet committed at the kill (generating, or their records
    # waiting for their shard's commit) can have run twice, none with a committed record. Their
    # number is not bounded by the concurrency: the records waiting for a commit come on top, more
    # of them on a loaded machine (18 > 16 in one CI run).
    after = Counter((r["sample_id"], r["turn"], r["gen"]) for r in final.records)
    again = [key for key in committed_before if after[key] > committed_before[key]]
    assert again == [], f"{len(again)} prompts with a committed record were generated again"
