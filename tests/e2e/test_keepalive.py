"""The servers this project starts from its CLI (`datagen sim`, `datagen coordinator`) answer
requests on a kept-alive connection at once: with Nagle's algorithm left on, each response waited
~40 ms for the client's delayed ACK, which every poll, submit and simulated ``/generate`` paid."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import httpx

from tests.support.processes import coordinator_stack

REQUESTS = 30
# Without TCP_NODELAY the median was 44 ms on this machine (48 ms for the coordinator's GET /jobs);
# with it, a few ms.
MEDIAN_LIMIT_S = 0.02


def _median_s(client: httpx.Client, url: str) -> float:
    client.get(url).raise_for_status()  # the connection is open from here on
    took = []
    for _ in range(REQUESTS):
        started = time.perf_counter()
        client.get(url).raise_for_status()
        took.append(time.perf_counter() - started)
    return statistics.median(took)


def test_kept_alive_connections_answer_without_a_delayed_ack_stall(tmp_path: Path) -> None:
    with coordinator_stack(tmp_path, "keepalive") as stack:
        sim = stack.spawn_sim("sim")
        with httpx.Client(timeout=10) as client:
            sim_s = _median_s(client, f"{sim}/metrics")
            coordinator_s = _median_s(client, f"{stack.coordinator}/jobs")
    assert sim_s < MEDIAN_LIMIT_S, f"datagen sim: median {sim_s * 1000:.1f} ms per kept-alive request"
    assert coordinator_s < MEDIAN_LIMIT_S, f"coordinator: median {coordinator_s * 1000:.1f} ms"
