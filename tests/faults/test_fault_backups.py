"""Issue 12: a worker killed with ``kill -9`` while its backup requests run.

A fast and a slow simulator. Once the fast one has drained the backlog, the worker backs the slow
one's requests up on it (``workers/run/backup.py``); at the first backup the worker is SIGKILLed, with
a primary and its backup in flight for the same prompt. A new worker starts; the reaper hands the
dead worker's prompts back and they run again. The end state must be the usual one: one record
per prompt, exported once, the job's counters agreeing with storage, every record token-exact
(so a backup sent the primary's request), nothing left running on either server.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

import pytest

from tests.support.faults import POLL_S, REAP_BUDGET_S, FaultStack, Sim, check_final_state, rows_for
from tests.support.metrics import metric_value
from tests.support.wait import wait_until

pytestmark = pytest.mark.faults

PROMPTS = 24
MAX_NEW_TOKENS = 300
CONCURRENCY = 4
# A decode step costs 0.02 s x the time scale: up to 1.8 s for 300 tokens on "fast" and 18 s on
# "slow", so the fast server drains the backlog while the slow one still runs its first requests,
# and a backup runs long enough (a second or so) to be killed mid-race.
FAST_SCALE = 0.3
SLOW_SCALE = 3.0
BACKUP_LINE = re.compile(r"backup of (\S+) on fast")
# A closed request is aborted when SGLang next polls for disconnects (every 4 s).
DISCONNECT_POLL_S = 4.0


@pytest.mark.timeout(240)
def test_kill_9_during_backups_counts_and_exports_each_prompt_once(
    make_stack: Callable[..., FaultStack],
) -> None:
    stack = make_stack("bkill")
    stack.add_sim("fast", time_scale=FAST_SCALE)
    stack.add_sim("slow", time_scale=SLOW_SCALE)
    stack.start_coordinator()
    rows = rows_for(PROMPTS)
    job_id = stack.submit(rows, max_new_tokens=MAX_NEW_TOKENS)
    worker = stack.start_worker("worker", ["fast", "slow"], concurrency=CONCURRENCY)
    log_path = stack.procs.log_path("worker")

    def backing_up() -> list[str]:
        return BACKUP_LINE.findall(log_path.read_text(errors="replace"))

    wait_until(lambda: bool(backing_up()), 90, "a backup request", interval_s=0.01, on_timeout=stack.logs)
    stack.kill(worker)
    raced = set(backing_up())
    done_at_kill = stack.job(job_id)["done"]
    log = log_path.read_text(errors="replace")
    ended = {
        rq_id for rq_id in raced if re.search(rf"backup of {re.escape(rq_id)} on fast [a-z]+ after", log)
    }
    assert raced - ended, "every backup had ended before the kill: nothing was killed mid-race"
    assert done_at_kill < PROMPTS

    stack.start_worker("worker", ["fast", "slow"], concurrency=CONCURRENCY)
    stack.wait_completed(job_id, REAP_BUDGET_S + 120)
    state = check_final_state(
        stack, job_id, rows, max_new_tokens=MAX_NEW_TOKENS, label="kill -9 during backup requests"
    )
    print(f"  killed with {len(raced - ended)} backups racing, done={done_at_kill} of {PROMPTS}")
    # A prompt killed mid-race has exactly one record (not merely one after deduplication): the
    # dead worker stored nothing of it, the new worker one answer, its primary's or its backup's.
    for rq_id in raced - ended:
        assert len([r for r in state.records if r["rid"].startswith(f"{rq_id}.")]) == 1, rq_id
    # Nothing of the dead worker's requests, nor of the losers, still runs on either server.
    for sim in stack.sims.values():
        wait_until(
            functools.partial(_idle, sim),
            DISCONNECT_POLL_S + 5,
            f"server {sim.name} to be idle",
            interval_s=POLL_S,
        )


def _idle(sim: Sim) -> bool:
    return metric_value(sim.metrics(), "sglang:num_running_reqs") == 0
