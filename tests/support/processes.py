"""``python -m datagen_cli …`` child processes with their logs, a coordinator stack over a private
Redis, and the coordinator app served in a thread."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import cast

import httpx
import redis
import uvicorn
from fastapi import FastAPI

from datagen.errors import ConfigError
from datagen.prompts.tokenization import bundled_tokenizer_path, default_chat_template_path
from datagen.records.storage import Storage
from datagen.settings import CoordinatorSettings
from datagen.states import ServerState
from datagen_cli.local.processes import ChildProcesses, child_env
from datagen_cli.local.redis_server import LocalRedis, free_port
from service.app import create_app
from tests.support.wait import wait_until

__all__ = [
    "STARTUP_TIMEOUT_S",
    "STOP_TIMEOUT_S",
    "ProcessStack",
    "coordinator_stack",
    "interruptible",
    "serve_coordinator",
]

STARTUP_TIMEOUT_S = 15.0
# How long stopped child processes get to exit before they are killed.
STOP_TIMEOUT_S = 30.0
STARTUP_POLL_S = 0.02
THREAD_JOIN_TIMEOUT_S = 10.0


# Runs as `python -c RESTORE_SIGINT PROGRAM ARGS…`: puts back SIGINT's default action, then execs.
RESTORE_SIGINT = "; ".join(
    [
        "import os, signal, sys",
        "signal.signal(signal.SIGINT, signal.SIG_DFL)",
        "os.execv(sys.argv[1], sys.argv[1:])",
    ]
)


def interruptible(command: list[str]) -> list[str]:
    """``command`` started with SIGINT's default action, so that a test's SIGINT is a Ctrl-C.

    A shell without job control (``scripts/check &``, ``nohup``, a CI runner) starts its background
    commands with SIGINT ignored; an ignored signal stays ignored in every child and across exec, and
    Python then installs no KeyboardInterrupt handler: the child would never see the test's Ctrl-C.
    A default action, unlike a handler, survives the exec."""
    return [sys.executable, "-c", RESTORE_SIGINT, *command]


class ProcessStack(ChildProcesses):
    """``python -m datagen_cli …`` child processes with logs under ``tmp``; ``stop()`` ends them all."""

    def __init__(self, tmp: Path, env: dict[str, str]) -> None:
        super().__init__(tmp, child_env(env), stop_timeout_s=STOP_TIMEOUT_S)
        self.tmp = tmp
        # Set by coordinator_stack().
        self.coordinator = ""
        self.redis: redis.Redis = cast(redis.Redis, None)
        self.storage: Storage = cast(Storage, None)

    def spawn_sim(self, name: str, *options: str) -> str:
        """A ``datagen sim`` on a free port with the bundled tokenizer; returns its URL once healthy."""
        port = free_port()
        self.spawn(name, "sim", "--port", str(port), "--tokenizer", bundled_tokenizer_path(), *options)
        url = f"http://127.0.0.1:{port}"
        self.wait_http(f"{url}/health")
        return url

    def cli(self, *args: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "datagen_cli", *args]
        return subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=timeout_s)

    def submit(self, dataset: Path, *options: str) -> subprocess.CompletedProcess[str]:
        """``datagen submit DATASET`` with the bundled tokenizer and the shipped R1 template."""
        return self.cli(
            "submit",
            str(dataset),
            *("--tokenizer", bundled_tokenizer_path(), "--chat-template", str(default_chat_template_path())),
            *options,
        )

    def wait_http(self, url: str, timeout_s: float = STARTUP_TIMEOUT_S * 4) -> None:
        try:
            super().wait_http(url, timeout_s)
        except ConfigError as exc:
            raise AssertionError(f"{exc}\n{self.logs()}") from exc

    def wait_server_up(self, coordinator: str, name: str, timeout_s: float = STARTUP_TIMEOUT_S * 2) -> None:
        """Until a worker has taken server ``name``: submit's pre-flight checks learn from it."""

        def up() -> bool:
            servers = httpx.get(f"{coordinator}/servers", timeout=5).json()["servers"]
            return any(s["name"] == name and s["state"] == ServerState.UP for s in servers)

        wait_until(up, timeout_s, f"a worker to take server {name}", on_timeout=self.logs)

    def logs(self) -> str:
        return "\n".join(
            f"== {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in self.tmp.glob("*.log")
        )


@contextmanager
def coordinator_stack(tmp: Path, namespace: str, env: dict[str, str] | None = None) -> Iterator[ProcessStack]:
    """A private Redis and a ``datagen coordinator`` process, with short intervals for workers
    spawned later; the stack's ``coordinator``, ``redis`` and ``storage`` point at them."""
    with LocalRedis() as redis_server:
        stack = ProcessStack(
            tmp,
            {
                "DATAGEN_REDIS_URL": redis_server.url,
                "DATAGEN_STORAGE": str(tmp / "data"),
                "DATAGEN_NAMESPACE": namespace,
                "DATAGEN_CONTROL_INTERVAL_S": "0.2",
                "DATAGEN_COMMIT_INTERVAL_S": "0.2",
                "DATAGEN_METRICS_PORT": "0",
                **(env or {}),
            },
        )
        port = free_port()
        stack.coordinator = f"http://127.0.0.1:{port}"
        stack.env["DATAGEN_COORDINATOR_URL"] = stack.coordinator
        stack.redis = redis.Redis.from_url(redis_server.url)
        stack.storage = Storage(tmp / "data")
        try:
            stack.spawn("coordinator", "coordinator", "--port", str(port))
            stack.wait_http(f"{stack.coordinator}/healthz")
            yield stack
        finally:
            stack.stop()
            stack.redis.close()


@contextmanager
def serve_coordinator(
    settings: CoordinatorSettings, *, log_level: str = "critical", app: FastAPI | None = None
) -> Iterator[str]:
    """The coordinator app over real HTTP on a free loopback port, in a thread; yields its URL.
    ``app``: one the test made with ``create_app(settings)``, to look at its state meanwhile."""
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app or create_app(settings), host="127.0.0.1", port=port, log_level=log_level)
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(
        lambda: server.started, STARTUP_TIMEOUT_S, "the coordinator to start", interval_s=STARTUP_POLL_S
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=THREAD_JOIN_TIMEOUT_S)
