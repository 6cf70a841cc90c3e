"""The servers this project starts from its CLI (`datagen sim`, `datagen coordinator`) answer
requests on a kept-alive connection at once: with Nagle's algorithm left on, each response waited
~40 ms for the client's delayed ACK, which every poll, submit and simulated ``/generate`` paid. And
the coordinator keeps an idle connection open longer than a client's pool does
(`datagen_cli.serve.API_KEEP_ALIVE_S`)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from tests.support.processes import coordinator_stack

REQUESTS = 30
# Linux delays an ACK by at least 40 ms (TCP_DELACK_MIN): with Nagle's algorithm on, every response
# written in two parts waits that long, so even the fastest of the requests took 44 ms (48 ms for the
# coordinator's GET /jobs). With TCP_NODELAY it takes a few ms. The fastest request, not the median,
# is compared: a loaded machine slows some requests, but not all 30 by tens of ms.
FASTEST_LIMIT_S = 0.03
# Past uvicorn's default keep-alive (5 s), well inside the coordinator's.
IDLE_S = 6.5


def _fastest_s(client: httpx.Client, url: str) -> float:
    client.get(url).raise_for_status()  # the connection is open from here on
    took = []
    for _ in range(REQUESTS):
        started = time.perf_counter()
        client.get(url).raise_for_status()
        took.append(time.perf_counter() - started)
    return min(took)


def test_kept_alive_connections_answer_without_a_delayed_ack_stall(tmp_path: Path) -> None:
    with coordinator_stack(tmp_path, "keepalive") as stack:
        sim = stack.spawn_sim("sim")
        with httpx.Client(timeout=10) as client:
            sim_s = _fastest_s(client, f"{sim}/metrics")
            coordinator_s = _fastest_s(client, f"{stack.coordinator}/jobs")
    assert sim_s < FASTEST_LIMIT_S, f"datagen sim: fastest {sim_s * 1000:.1f} ms per kept-alive request"
    assert coordinator_s < FASTEST_LIMIT_S, f"coordinator: fastest {coordinator_s * 1000:.1f} ms"


def test_an_idle_connection_outlives_a_clients_pool_expiry(tmp_path: Path) -> None:
    # httpx keeps an idle connection 5 s; a server that closed it at 5 s too could close it in
    # the instant a client sent a request on it, which then read a connection reset (one of 1,001
    # concurrent submits did, in a CI run of tests/e2e/test_first_submits.py).
    limits = httpx.Limits(keepalive_expiry=60)
    with (
        coordinator_stack(tmp_path, "idle") as stack,
        httpx.Client(base_url=stack.coordinator, timeout=30, limits=limits) as http,
    ):
        first = _client_address(http.get("/healthz"))
        time.sleep(IDLE_S)
        second = _client_address(http.get("/healthz"))
    assert second == first, "the coordinator closed the idle connection"


def _client_address(response: httpx.Response) -> object:
    """The client's end of the connection that carried ``response`` (read while it is open)."""
    assert response.status_code == 200, response.text
    return response.extensions["network_stream"].get_extra_info("client_addr")
