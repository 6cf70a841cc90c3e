"""Issue 28, item 2: a 25-s Redis stall must not make live workers look dead.

Redis is frozen with SIGSTOP for 25 s (more than a heartbeat TTL, 19 s here) while a worker
has a full concurrency of prompts in flight, then resumed with SIGCONT. Nobody can write a
heartbeat meanwhile, so every started-registry entry lapses; a reaper that acted on those entries
at once would hand every in-flight prompt back, run it twice and spend one of its worker-loss
retries. The reaper sees the stall (a gap between its own Redis round trips) and claims nothing
until a heartbeat TTL after it, by which time every live worker has beaten again
(``workers/claim/reaper.py``).

Measured: prompts in flight at the stall, prompts the reaper requeued, and prompts generated
twice. None may be generated twice, none requeued as a worker loss, and every prompt that still
has an RQ job hash keeps all its retries. A claim whose reply was lost in the stall (the client
timed out, Redis ran the script on resuming) leaves a started entry no process runs; the reaper
requeues it once the hold ends, uncharged since its worker still beats: that is allowed.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import httpx
import pytest

from datagen_cli.local.redis_server import free_port
from tests.support.faults import HTTP_TIMEOUT_S, POLL_S, FaultStack, check_final_state, rows_for
from tests.support.metrics import metric_value
from tests.support.wait import wait_until

pytestmark = [pytest.mark.faults, pytest.mark.timeout(150)]

PROMPTS = 600
MAX_NEW_TOKENS = 300
# Two workers: one's reaper can run after Redis resumes before the other has beaten again.
WORKERS = 2
CONCURRENCY = 32
STALL_S = 25.0
# Heartbeats every 3 s (a TTL of 19 s, lapsed for all at the stall's end) and reaper passes every
# 0.5 s: after the stall a reaper runs well before the workers' next heartbeats, as in production
# (heartbeats and passes every 10 s, in unrelated phases).
HEARTBEAT_S = 3.0
# The stall comes once this many prompts are in flight (the simulator's queue keeps the two
# workers at about 32-35 together).
BUSY = CONCURRENCY
DEFAULT_MAX_WORKER_LOSSES = 3


def test_redis_stall_reaps_no_live_worker(make_stack: Callable[..., FaultStack]) -> None:
    stack = make_stack("stall", {"DATAGEN_HEARTBEAT_INTERVAL_S": str(HEARTBEAT_S)})
    stack.add_sim("a", time_scale=0.1)
    stack.start_coordinator()
    ports = [free_port() for _ in range(WORKERS)]
    for n, port in enumerate(ports):
        stack.start_worker(f"worker{n}", ["a"], concurrency=CONCURRENCY, metrics_port=port)
    rows = rows_for(PROMPTS)
    job_id = stack.submit(rows, max_new_tokens=MAX_NEW_TOKENS)
    wait_until(
        lambda: stack.job(job_id)["done"] >= 50 and len(stack.started_members()) >= BUSY,
        60,
        "the workers to be busy",
        interval_s=POLL_S,
    )

    in_flight = len(stack.started_members())
    assert stack.redis_server.process is not None
    pid = stack.redis_server.process.pid
    started = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(STALL_S)
    finally:
        os.kill(pid, signal.SIGCONT)
    stack.wait_completed(job_id, 90)
    whole_s = time.monotonic() - started

    texts = [httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=HTTP_TIMEOUT_S).text for port in ports]
    requeued = sum(metric_value(t, "datagen_worker_reaped_total", outcome="requeued") for t in texts)
    uncharged = sum(metric_value(t, "datagen_worker_reaped_total", outcome="uncharged") for t in texts)
    failed = sum(metric_value(t, "datagen_worker_reaped_total", outcome="failed") for t in texts)
    retries = [
        int(value)
        for key in stack.redis.scan_iter(match="rq:job:*")
        if (value := stack.redis.hget(key, "retries_left")) is not None
    ]
    final = check_final_state(stack, job_id, rows, max_new_tokens=MAX_NEW_TOKENS, label="redis stall")
    print(
        f"  in flight at the stall: {in_flight}; requeued by the reaper as worker losses: "
        f"{requeued:.0f}, uncharged: {uncharged:.0f}, failed: {failed:.0f}; generated twice: "
        f"{final.wasted}; completed {whole_s:.1f} s after the stall began; RQ job hashes left: "
        f"{len(retries)}, with a retry spent: {sum(r < DEFAULT_MAX_WORKER_LOSSES for r in retries)}"
    )
    assert in_flight >= BUSY
    assert final.wasted == 0
    assert (requeued, failed) == (0, 0)
    assert all(r == DEFAULT_MAX_WORKER_LOSSES for r in retries)
