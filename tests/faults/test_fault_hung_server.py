"""Issue 28, item 4: a server that hangs mid-request (SIGSTOPped, its connections open).

Two simulated servers run a job; the same stack first runs a job of the same size with both healthy
(the usual time). In a second job server ``a`` is SIGSTOPped once a third of the prompts are done: its
in-flight requests never answer and its ``/health`` probes time out. The health probe marks it down
(``DATAGEN_HEALTH_TIMEOUTS_TO_DOWN`` probes of ``DATAGEN_HEALTH_TIMEOUT_S`` each, about 3.6 s with
``FAST_ENV``) and the worker abandons the requests it had in flight there: they are sent to ``b`` at
once, without charging an attempt, instead of waiting for the read timeout (600 s by default). The
job must finish within twice the usual time, with every prompt stored once and token-exact.

The second case slows the probe down (a 60 s health timeout, as a loaded SGLang may need): nothing
marks the server down during the job, and its requests are rescued by backups instead. A request
outstanding ``HUNG_MARGIN`` times longer than its ``max_new_tokens`` at the server's measured seconds
per token is overdue, and gets a backup on the other server even while the backlog is not empty.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import pytest

from tests.support.faults import POLL_S, FaultStack, check_final_state, rows_for
from tests.support.wait import wait_until

pytestmark = pytest.mark.faults

MAX_NEW_TOKENS = 300
TIME_SCALE = 0.05
CONCURRENCY = 16
PROMPTS = 600
STOP_AT_DONE = PROMPTS // 3
# The job with a stopped server may take at most this multiple of the healthy job's time: the stop
# costs half the capacity for the last two thirds (about 1.5x), the rest is detection. Measured at
# 1.28x and 1.41x on this 2-core machine beside three busy processes (load ~4).
TAIL_FACTOR = 2.0
# Bounds on waits, not measurements: each job takes about 12 s on a quiet machine, and a machine
# under a load of ~10 stretches every process several times over.
HEALTHY_JOB_WAIT_S = 180


def _run_job(stack: FaultStack, prefix: str) -> tuple[str, list[dict[str, object]], float]:
    rows = rows_for(PROMPTS, prefix=prefix)
    started_at = time.monotonic()
    job_id = stack.submit(rows, max_new_tokens=MAX_NEW_TOKENS)
    return job_id, rows, started_at


# The worker's log lines that show which path rescued the hung server's prompts.
ABANDONED = "requests in flight on server a"
BACKED_UP = "its request has run"


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("env", "rescue"),
    [({}, ABANDONED), ({"DATAGEN_HEALTH_TIMEOUT_S": "60"}, BACKED_UP)],
    ids=["probe-marks-down", "overdue-backups"],
)
def test_a_sigstopped_servers_prompts_finish_elsewhere_within_twice_the_usual_time(
    make_stack: Callable[..., FaultStack], env: dict[str, str], rescue: str
) -> None:
    stack = make_stack("sigstop", env)
    for name in ("a", "b"):
        stack.add_sim(name, time_scale=TIME_SCALE)
    stack.start_coordinator()
    stack.start_worker("worker", ["a", "b"], concurrency=CONCURRENCY)

    job_id, rows, started_at = _run_job(stack, "healthy")
    stack.wait_completed(job_id, HEALTHY_JOB_WAIT_S)
    usual_s = time.monotonic() - started_at
    check_final_state(stack, job_id, rows, max_new_tokens=MAX_NEW_TOKENS, label="healthy job")

    sim = stack.sims["a"]
    assert sim.proc is not None
    job_id, rows, started_at = _run_job(stack, "stopped")
    wait_until(
        lambda: stack.job(job_id)["done"] >= STOP_AT_DONE,
        HEALTHY_JOB_WAIT_S,
        "a third of the job",
        interval_s=POLL_S,
    )
    os.kill(sim.proc.pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        done_at_stop = stack.job(job_id)["done"]
        stack.wait_completed(job_id, TAIL_FACTOR * usual_s + 30)
        job_s = time.monotonic() - started_at
    finally:
        os.kill(sim.proc.pid, signal.SIGCONT)
    state = check_final_state(stack, job_id, rows, max_new_tokens=MAX_NEW_TOKENS, label="SIGSTOPped server")
    log = (stack.procs.tmp / "worker.log").read_text(errors="replace")
    print(
        f"\n  {log.count(ABANDONED)} abandon(s), {log.count(BACKED_UP)} backup(s); healthy job "
        f"{usual_s:.1f} s; stopped server a at done={done_at_stop}; job took {job_s:.1f} s "
        f"({job_s / usual_s:.2f}x), {time.monotonic() - stopped_at:.1f} s after the stop; "
        f"{sum(r['server'] == 'a' for r in state.records)} records from a"
    )

    assert done_at_stop < PROMPTS - 4 * CONCURRENCY, "the job ended before the server stopped"
    assert job_s <= TAIL_FACTOR * usual_s
    assert state.max_attempts == 1, "a hung server was charged as an attempt"
    assert rescue in log
