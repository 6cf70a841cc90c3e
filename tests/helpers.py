"""Test helpers shared across packages: a simulator served over real HTTP from a thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import uvicorn

from datagen.redis_server import free_port
from simulator.config import SimConfig
from simulator.server import uvicorn_config

STARTUP_TIMEOUT_S = 15.0


@contextmanager
def running_simulator(**overrides: object) -> Iterator[str]:
    """Serve a simulator on a free loopback port; yields its base URL."""
    config = SimConfig(port=free_port(), **overrides)  # type: ignore[arg-type]
    server = uvicorn.Server(uvicorn_config(config))
    thread = threading.Thread(target=server.run, name=f"sim-{config.port}", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{config.port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError(f"simulator on port {config.port} did not start")
        time.sleep(0.02)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def wait_until(predicate: object, timeout_s: float = 30.0, interval_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(interval_s)
    raise AssertionError(f"condition not met within {timeout_s} s")


def health(url: str) -> int:
    return httpx.get(f"{url}/health", timeout=2).status_code
