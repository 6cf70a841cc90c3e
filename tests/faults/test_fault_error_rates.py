"""Issue 5, case 4: a server that fails 20 % of requests (7 % 503, 7 % 500, 6 % aborted mid-way).

The job must complete with every record token-exact (an aborted request's partial output is never
stored), and the errors must be counted where an operator looks: the worker's
``datagen_worker_retries_total{reason=...}`` on its ``--metrics-port``. The counts are checked
against the rates (within ±50 %, about four standard deviations at this size) and against the
records: 503s are server faults and cost no attempt, 500s and aborts cost one each, so the
attempts stored in the records add up to exactly the 500s and aborts the worker retried.

``DATAGEN_MAX_ATTEMPTS`` is 8: 13 % of requests are charged, so a prompt fails only if eight
charged errors hit it in a row (about 0.14^8 ≈ 1.5e-7 per prompt); with the default of 4 (about
4e-4 per prompt) a job of this size would fail a prompt in roughly one run of four.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
import pytest

from datagen_cli.local.redis_server import free_port
from tests.support.faults import FaultStack, check_final_state, rows_for
from tests.support.metrics import metric_value

pytestmark = pytest.mark.faults

PROMPTS = 800
MAX_NEW_TOKENS = 300
CONCURRENCY = 32
RATES = {"ServerUnavailableError": 0.07, "ServerError": 0.07, "GenerationAbortedError": 0.06}
CHARGED = ("ServerError", "GenerationAbortedError")
TOLERANCE = 0.5


@pytest.mark.timeout(180)
def test_a_server_failing_20_percent_of_requests_completes_the_job(
    make_stack: Callable[..., FaultStack],
) -> None:
    stack = make_stack("errors", {"DATAGEN_MAX_ATTEMPTS": "8"})
    flags = {"fail_503_rate": 0.07, "fail_500_rate": 0.07, "abort_rate": 0.06}
    sim = stack.add_sim("sim", time_scale=0.02, **flags)
    stack.start_coordinator()
    rows = rows_for(PROMPTS)
    job_id = stack.submit(rows, max_new_tokens=MAX_NEW_TOKENS)
    metrics_port = free_port()
    started_at = time.monotonic()
    stack.start_worker("worker", ["sim"], concurrency=CONCURRENCY, metrics_port=metrics_port)
    stack.wait_completed(job_id, 150)
    job_s = time.monotonic() - started_at
    metrics = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
    sim_aborted = metric_value(sim.metrics(), "sglang:num_aborted_requests_total")

    retries = {
        reason: metric_value(metrics, "datagen_worker_retries_total", reason=reason) for reason in RATES
    }
    requests = {
        outcome: metric_value(metrics, "datagen_worker_requests_total", outcome=outcome)
        for outcome in ("ok", "retryable", "fatal")
    }
    sent = sum(requests.values())
    downs = metric_value(metrics, "datagen_worker_retries_total") - sum(retries.values())
    print(
        f"\n  {sent:.0f} requests for {PROMPTS} prompts: {requests}; retries by reason {retries} "
        f"(other reasons: {downs:.0f}); the simulator counted {sim_aborted:.0f} aborts; "
        f"job took {job_s:.1f} s"
    )
    state = check_final_state(stack, job_id, rows, max_new_tokens=MAX_NEW_TOKENS, label="case 4: 20% errors")

    assert requests["ok"] == len(state.records) and requests["fatal"] == 0
    assert requests["retryable"] == sum(retries.values()) and downs == 0
    for reason, rate in RATES.items():
        expected = rate * sent
        assert (1 - TOLERANCE) * expected <= retries[reason] <= (1 + TOLERANCE) * expected, (reason, retries)
    # 503s cost no attempt; every 500 and abort cost exactly one.
    assert sum(r["attempts"] - 1 for r in state.records) == sum(retries[reason] for reason in CHARGED)
    assert sim_aborted == retries["GenerationAbortedError"]
    assert state.wasted == 0
