"""Issue 11: prompts finish in batches; a worker SIGKILLed between a shard's commit and the batch's
acknowledgement (records stored, RQ and the job not yet told) loses no prompt and counts none twice.

The first worker holds every acknowledgement for 30 s (``DATAGEN_TEST_ACK_DELAY_S``) and is killed
once shards of it are committed. Its prompts are still started in RQ and running in the job; a
second worker's reaper hands them out again once the dead worker's heartbeat lapses, and they run
again. Each committed prompt then has two records: the job counts it once, and exports keep one.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from datagen.control.keys import Keys
from tests.support.faults import POLL_S, REAP_BUDGET_S, FaultStack, all_records, check_final_state, rows_for
from tests.support.wait import wait_until

pytestmark = pytest.mark.faults

PROMPTS = 120
MAX_NEW_TOKENS = 48
CONCURRENCY = 16
ACK_DELAY_S = "30"


def test_kill_between_shard_commit_and_batch_ack_counts_and_exports_each_prompt_once(tmp_path: Path) -> None:
    stack = FaultStack(tmp_path, "ackkill")
    try:
        stack.add_sim("a", time_scale=0.02)
        stack.start_coordinator()
        rows = rows_for(PROMPTS)
        job_id = stack.submit(rows, max_new_tokens=MAX_NEW_TOKENS)
        stack.procs.env["DATAGEN_TEST_ACK_DELAY_S"] = ACK_DELAY_S
        first = stack.start_worker("worker-1", ["a"], concurrency=CONCURRENCY)
        stack.procs.env.pop("DATAGEN_TEST_ACK_DELAY_S")
        wait_until(
            lambda: len(all_records(stack.storage, job_id)) >= CONCURRENCY,
            60,
            "the first worker to commit shards",
            interval_s=POLL_S,
        )
        # Stored but not acknowledged: nothing is counted, and every stored prompt is still started.
        stored = {r["sample_id"] for r in all_records(stack.storage, job_id)}
        started = stack.started_by(first.pid)
        assert stack.job(job_id)["done"] == 0
        keys = Keys("ackkill")
        started_ids = {m.split(":", 1)[0] for m in started}
        assert {keys.rq_job_id(job_id, s, 0, 0) for s in stored} <= started_ids
        stack.kill(first)
        killed_at = time.monotonic()
        stack.start_worker("worker-2", ["a"], concurrency=CONCURRENCY)
        stack.wait_completed(job_id, REAP_BUDGET_S + 60)
        recovered_s = time.monotonic() - killed_at
        print(f"\n[ack kill] {len(stored)} prompts stored, not acknowledged; done {recovered_s:.1f} s later")
        state = check_final_state(stack, job_id, rows, max_new_tokens=MAX_NEW_TOKENS, label="ack kill")
        # Every prompt the first worker stored (those seen above, and any it committed until the kill)
        # ran again: two records, one count, one export.
        assert state.job["done"] == PROMPTS
        by_first = {r["sample_id"] for r in state.records if f"-{first.pid}-" in r["worker"]}
        assert stored <= by_first
        twice = {s for s in by_first if sum(r["sample_id"] == s for r in state.records) == 2}
        assert twice == by_first
        assert state.wasted == len(by_first)
    finally:
        stack.stop()
