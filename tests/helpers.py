"""Test helpers shared across packages: waiting, job specs, simulators, fast worker settings,
ingestion, processes."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar, cast

import httpx
import redis
import uvicorn
from fastapi.testclient import TestClient

from datagen.control.enqueue import EnqueueOptions
from datagen.control.jobs import JobStore
from datagen.control.keys import Keys
from datagen.errors import ConfigError
from datagen.local.processes import ChildProcesses, child_env
from datagen.local.redis_server import LocalRedis, free_port
from datagen.prompts.tokenization import bundled_tokenizer_path, default_chat_template_path
from datagen.records.schema import Record
from datagen.records.storage import Storage
from datagen.settings import CoordinatorSettings, WorkerSettings
from datagen.spec import JobSpec
from datagen.states import JobState, ServerState
from service.app import create_app
from service.ingest import IngestOptions, Ingestor
from simulator.config import SimConfig
from simulator.server import uvicorn_config

STARTUP_TIMEOUT_S = 15.0
# How long stopped child processes get to exit before they are killed.
STOP_TIMEOUT_S = 30.0
POLL_INTERVAL_S = 0.1
INGEST_TIMEOUT_S = 30.0
# The simulator's context length: what a job submitted before any worker has reported one gives.
SIM_CONTEXT_LEN = 32768

T = TypeVar("T")


def wait_until(
    predicate: Callable[[], T | None],
    timeout_s: float,
    what: str,
    *,
    interval_s: float = POLL_INTERVAL_S,
    on_timeout: Callable[[], str] | None = None,
) -> T:
    """Poll ``predicate`` until it returns something truthy, and return that. After ``timeout_s``
    the test fails naming ``what``, followed by ``on_timeout()`` (process logs, say) if given."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            detail = f"\n{on_timeout()}" if on_timeout is not None else ""
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}{detail}")
        time.sleep(interval_s)
    return value


def make_spec(**overrides: Any) -> dict[str, Any]:
    """A job spec as clients submit it: the bundled tokenizer, the shipped R1 template and the
    simulator's context length (``context_len=None`` leaves it to what workers report), with
    ``overrides`` on top."""
    return {
        "tokenizer": bundled_tokenizer_path(),
        "chat_template": str(default_chat_template_path()),
        "context_len": SIM_CONTEXT_LEN,
        **overrides,
    }


def wait_ingested(client: TestClient, job_id: str, timeout_s: float = INGEST_TIMEOUT_S) -> dict[str, Any]:
    """The job as ``GET /jobs/{job_id}`` shows it once its ingestion has ended."""

    def ingested() -> dict[str, Any] | None:
        job: dict[str, Any] = client.get(f"/jobs/{job_id}").json()
        return job if job["state"] != JobState.INGESTING else None

    return wait_until(ingested, timeout_s, f"job {job_id} to finish ingesting", interval_s=0.05)


@contextmanager
def running_simulator(**overrides: object) -> Iterator[str]:
    """Serve a simulator on a free loopback port; yields its base URL."""
    config = SimConfig(port=free_port(), **overrides)  # type: ignore[arg-type]
    server = uvicorn.Server(uvicorn_config(config))
    thread = threading.Thread(target=server.run, name=f"sim-{config.port}", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{config.port}"
    what = f"the simulator on port {config.port} to start"
    wait_until(lambda: server.started or not thread.is_alive(), STARTUP_TIMEOUT_S, what, interval_s=0.02)
    if not server.started:
        raise RuntimeError(f"simulator on port {config.port} did not start")
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=10)


# Worker settings that make every interval short, so tests run in seconds.
FAST_WORKER: dict[str, Any] = {
    "metrics_port": 0,
    "commit_interval_s": 0.05,
    "heartbeat_interval_s": 0.5,
    "poll_interval_s": 0.02,
    "retry_base_s": 0.01,
    "retry_max_s": 0.05,
    "health_interval_s": 0.2,
    "health_timeout_s": 0.3,
    "control_interval_s": 0.1,
    "controller_interval_s": 0.2,
    "reaper_interval_s": 0.5,
    "drain_timeout_s": 5,
}


def fast_worker_settings(
    redis_url: str, storage: Storage, namespace: str, **overrides: Any
) -> WorkerSettings:
    values = dict(FAST_WORKER, redis_url=redis_url, storage=str(storage.root), namespace=namespace)
    values.update(overrides)
    return WorkerSettings(**values)


def ingest_rows(
    redis_client: redis.Redis,
    storage: Storage,
    keys: Keys,
    job_id: str,
    spec: JobSpec,
    rows: list[dict[str, Any]],
    *,
    max_worker_losses: int = 3,
) -> None:
    """Create a job and ingest ``rows`` the way the coordinator does, synchronously."""
    jobs = JobStore(redis_client, keys)
    jobs.create(job_id, spec)
    data = "".join(json.dumps(r) + "\n" for r in rows).encode("utf-8")
    input_name = storage.write_input(job_id, [data])
    enqueue = EnqueueOptions(result_ttl_s=600, failure_ttl_s=600, max_worker_losses=max_worker_losses)
    options = IngestOptions(chunk=50, enqueue=enqueue)
    Ingestor(redis_client, keys, jobs, storage, options).run(job_id, input_name, threading.Event())


class ProcessStack(ChildProcesses):
    """``python -m datagen …`` child processes with logs under ``tmp``; ``stop()`` ends them all."""

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
        command = [sys.executable, "-m", "datagen", *args]
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


def make_record(sample_id: str, input_ids: list[int], prompt_len: int, **fields: Any) -> Record:
    """A record with plausible values for every column the test does not care about."""
    values: dict[str, Any] = {
        "job_id": "job1",
        "turn": 0,
        "gen": 0,
        "partition": "default",
        "cls": "short",
        "finish_type": "stop",
        "finish_matched": "1",
        "finish_length": None,
        "max_new_tokens": 16,
        "server": "s",
        "tokenizer": "tok",
        "sampling_params": "{}",
        "rid": "r",
        "worker": "w",
        "attempts": 1,
        "cached_tokens": 0,
        "num_retractions": 0,
        "e2e_latency_s": 0.1,
        "enqueued_at_ms": 1,
        "started_at_ms": 2,
        "finished_at_ms": 3,
        **fields,
    }
    return Record(sample_id=sample_id, input_ids=input_ids, prompt_len=prompt_len, **values)


@contextmanager
def serve_coordinator(settings: CoordinatorSettings, *, log_level: str = "critical") -> Iterator[str]:
    """The coordinator app over real HTTP on a free loopback port, in a thread; yields its URL."""
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level=log_level)
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, STARTUP_TIMEOUT_S, "the coordinator to start", interval_s=0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


class StopAfter(threading.Event):
    """A stop signal that trips after ``checks`` looks (ingestion looks once before the run and once
    per row read): an ingestion stopped part way, for real."""

    def __init__(self, checks: int) -> None:
        super().__init__()
        self.left = checks

    def is_set(self) -> bool:
        self.left -= 1
        return self.left < 0 or super().is_set()
