"""Issue 5, cases 2 and 3: a simulated SGLang server goes away, or wedges, in the middle of a job.

Case 2: one of two servers is SIGKILLed (its connections refused, in-flight requests reset), stays
down for 10 s, and comes back on the same port with ``--starting-s 3`` (``/health`` answers 503
while it "warms up"). No prompt may fail or be charged an attempt for it, the worker must send it
nothing while it answers 503, and must send it work again within 5 s of its first ``/health`` 200.
A sampler polls the server's ``/health`` and ``/metrics`` (running + waiting + finished requests)
every 50 ms to time that.

Case 3: one of two servers accepts ``/generate`` and never answers (``POST /_sim/chaos
{"hang_generate": true}``) while its ``/health`` stays 200. With a 2 s read timeout the worker's
requests to it time out, are charged an attempt each and retried; every prompt completes, on the
other server. ``DATAGEN_MAX_ATTEMPTS`` is raised to 20 because nothing takes the wedged server out
of rotation: a prompt may be routed to it more than the default 4 times (see the report below).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from datagen_cli.local.redis_server import free_port
from tests.support.faults import POLL_S, FaultStack, Sampler, all_records, check_final_state, rows_for
from tests.support.metrics import metric_value
from tests.support.wait import wait_until

pytestmark = pytest.mark.faults

MAX_NEW_TOKENS = 300
# Time scale 0.05: a request takes about 0.1-0.8 s, so a server holds its 16 slots busy and one
# server alone runs about 30 prompts/s.
TIME_SCALE = 0.05
CONCURRENCY = 16

OUTAGE_PROMPTS = 1000
DOWN_S = 10.0
STARTING_S = 3.0
RESUME_BUDGET_S = 5.0

HANG_PROMPTS = 600
READ_TIMEOUT_S = 1.5
# A router that sends a timed-out prompt elsewhere needs 2 attempts; 10 leaves room for one that
# only breaks ties at random (a prompt then meets the wedged server 10 times in a row with
# probability 2^-10).
HANG_MAX_ATTEMPTS = 10
# Limits are fixed (FAST_ENV turns the KV controller off), so routing is reproducible: with equal
# free slots the first server listed, the wedged one, wins the tie.
HANG_ENV = {
    "DATAGEN_SHORT_READ_TIMEOUT_S": str(READ_TIMEOUT_S),
    "DATAGEN_MAX_ATTEMPTS": str(HANG_MAX_ATTEMPTS),
}


def _activity(sim_url: str) -> tuple[int, float]:
    """(/health status, requests the server has running, waiting or finished)."""
    health = httpx.get(f"{sim_url}/health", timeout=1).status_code
    text = httpx.get(f"{sim_url}/metrics", timeout=1).text
    seen = sum(
        metric_value(text, name)
        for name in ("sglang:num_requests_total", "sglang:num_running_reqs", "sglang:num_queue_reqs")
    )
    return health, seen


def _two_server_stack(
    make_stack: Callable[..., FaultStack], namespace: str, env: dict[str, str]
) -> FaultStack:
    stack = make_stack(namespace, env)
    for name in ("a", "b"):
        stack.add_sim(name, time_scale=TIME_SCALE)
    stack.start_coordinator()
    return stack


def _both_serving(stack: FaultStack, job_id: str, *, done: int) -> bool:
    return stack.job(job_id)["done"] >= done and all(_activity(sim.url)[1] > 0 for sim in stack.sims.values())


@pytest.mark.timeout(180)
def test_a_server_down_for_10_s_costs_no_prompt_and_gets_work_again(
    make_stack: Callable[..., FaultStack],
) -> None:
    stack = _two_server_stack(make_stack, "outage", {})
    rows = rows_for(OUTAGE_PROMPTS)
    job_id = stack.submit(rows, max_new_tokens=MAX_NEW_TOKENS)
    started_at = time.monotonic()
    stack.start_worker("worker", ["a", "b"], concurrency=CONCURRENCY)
    wait_until(lambda: _both_serving(stack, job_id, done=100), 60, "both servers to serve", interval_s=POLL_S)

    sim = stack.sims["a"]
    with Sampler(lambda: _activity(sim.url)) as probe:
        stack.kill(sim.proc)
        killed_at = time.monotonic()
        done_at_kill = stack.job(job_id)["done"]
        time.sleep(max(0.0, killed_at + DOWN_S - time.monotonic()))
        restarted_at = time.monotonic()
        restart_ms = int(time.time() * 1000)
        stack.start_sim("a", "--starting-s", str(STARTING_S), wait_healthy=False)
        wait_until(
            lambda: _samples_after(probe, restarted_at, lambda s: s[1] > 0),
            60,
            "work on server a",
            interval_s=POLL_S,
        )
        done_at_return = stack.job(job_id)["done"]
        stack.wait_completed(job_id, 120)
    job_s = time.monotonic() - started_at

    after = [(t, v) for t, v in probe.samples if t >= restarted_at and v is not None]
    warming = [t for t, (health, _) in after if health == 503]
    healthy_at = next(t for t, (health, _) in after if health == 200)
    busy_at = next(t for t, (_, seen) in after if seen > 0)
    unreachable_s = next(t for t, v in after if v is not None) - killed_at
    state = check_final_state(
        stack, job_id, rows, max_new_tokens=MAX_NEW_TOKENS, label="case 2: server down 10 s"
    )
    late = [r for r in state.records if r["server"] == "a" and r["finished_at_ms"] > restart_ms]
    print(
        f"  killed at done={done_at_kill}; unreachable {unreachable_s:.1f} s; /health 503 for "
        f"{(healthy_at - warming[0]) if warming else 0:.1f} s; first request {busy_at - healthy_at:+.2f} s "
        f"after its first /health 200; done={done_at_return} then; {len(late)} records from it after "
        f"the restart; job took {job_s:.1f} s"
    )

    assert done_at_return < OUTAGE_PROMPTS - 2 * CONCURRENCY, "the job ended before the server came back"
    assert unreachable_s >= DOWN_S and warming, "the outage and the warm-up did not happen as planned"
    # Nothing went to the server while its /health said 503, and dispatch resumed within 5 s of 200.
    assert all(seen == 0 for t, (_, seen) in after if t < warming[-1])
    assert busy_at - healthy_at <= RESUME_BUDGET_S
    assert late, "no record came from the restarted server"
    assert state.max_attempts == 1, "an outage was charged as an attempt"
    assert state.wasted == 0  # no worker died: nothing ran twice


def _samples_after(sampler: Sampler, at: float, predicate: Callable[[Any], bool]) -> bool:
    return any(t >= at and v is not None and predicate(v) for t, v in list(sampler.samples))


@pytest.mark.timeout(180)
def test_a_wedged_server_times_out_and_its_prompts_complete_elsewhere(
    make_stack: Callable[..., FaultStack],
) -> None:
    stack = _two_server_stack(make_stack, "hang", HANG_ENV)
    rows = rows_for(HANG_PROMPTS)
    job_id = stack.submit(rows, max_new_tokens=MAX_NEW_TOKENS)
    metrics_port = free_port()
    started_at = time.monotonic()
    stack.start_worker("worker", ["a", "b"], concurrency=CONCURRENCY, metrics_port=metrics_port)
    wait_until(lambda: _both_serving(stack, job_id, done=50), 60, "both servers to serve", interval_s=POLL_S)

    hung_ms = int(time.time() * 1000)
    response = httpx.post(f"{stack.sims['a'].url}/_sim/chaos", json={"hang_generate": True}, timeout=5)
    assert response.status_code == 200, response.text
    done_at_hang = stack.job(job_id)["done"]
    stack.wait_completed(job_id, 150)
    job_s = time.monotonic() - started_at
    metrics = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text

    records = all_records(stack.storage, job_id)
    timeouts = metric_value(metrics, "datagen_worker_retries_total", reason="RequestTimeoutError")
    sent_to_hung = metric_value(metrics, "datagen_worker_requests_total", server="a", outcome="retryable")
    retried = [r for r in records if r["attempts"] > 1]
    from_a = [r for r in records if r["server"] == "a"]
    print(
        f"\n  wedged at done={done_at_hang}; {timeouts:.0f} request timeouts ({sent_to_hung:.0f} requests "
        f"to the wedged server); {len(retried)} prompts needed more than one attempt (max "
        f"{max(r['attempts'] for r in records)}); {len(from_a)} records from it; job took {job_s:.1f} s"
    )
    state = check_final_state(
        stack, job_id, rows, max_new_tokens=MAX_NEW_TOKENS, label="case 3: wedged server"
    )

    assert done_at_hang < HANG_PROMPTS - 4 * CONCURRENCY, "the job ended before the server wedged"
    assert timeouts >= 1 and retried
    # A request sent after the wedge never answers, so every record from it was answered within a
    # read timeout of the wedge (plus a moment between the answer and the record's timestamp).
    assert all(r["finished_at_ms"] <= hung_ms + READ_TIMEOUT_S * 1000 + 500 for r in from_a)
    assert all(r["server"] == "b" for r in retried)
    assert state.wasted == 0


@pytest.mark.timeout(120)
def test_a_prompt_timed_out_on_a_wedged_server_is_retried_on_the_other(
    make_stack: Callable[..., FaultStack],
) -> None:
    """The smallest form of case 3: one prompt, server ``a`` wedged from the start, ``b`` idle.

    Every attempt of the prompt is charged (a timeout is not a server fault), so it must move to
    ``b`` before ``DATAGEN_MAX_ATTEMPTS`` (3 here) run out.
    """
    stack = _two_server_stack(make_stack, "hang1", dict(HANG_ENV, DATAGEN_MAX_ATTEMPTS="3"))
    response = httpx.post(f"{stack.sims['a'].url}/_sim/chaos", json={"hang_generate": True}, timeout=5)
    assert response.status_code == 200, response.text
    rows = rows_for(1)
    job_id = stack.submit(rows, max_new_tokens=MAX_NEW_TOKENS)
    stack.start_worker("worker", ["a", "b"], concurrency=CONCURRENCY)
    stack.wait_completed(job_id, 60)
    state = check_final_state(stack, job_id, rows, max_new_tokens=MAX_NEW_TOKENS, label="case 3, one prompt")
    assert [r["server"] for r in state.records] == ["b"]
