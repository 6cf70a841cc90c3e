"""Test helpers shared across packages: simulators, fast worker settings, ingestion, processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, cast

import httpx
import redis
import uvicorn

from datagen.enqueue import EnqueueOptions
from datagen.jobs import JobStore
from datagen.keys import Keys
from datagen.records import Record
from datagen.redis_server import LocalRedis, free_port
from datagen.settings import WorkerSettings
from datagen.spec import JobSpec
from datagen.storage import Storage
from datagen.tokenization import bundled_tokenizer_path, default_chat_template_path
from service.ingest import IngestOptions, Ingestor
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


class ProcessStack:
    """``python -m datagen …`` child processes with logs under ``tmp``; ``stop()`` ends them all."""

    def __init__(self, tmp: Path, env: dict[str, str]) -> None:
        self.tmp = tmp
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("DATAGEN_")}
        self.env.update(env, HF_HUB_OFFLINE="1")
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list[IO[bytes]] = []
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

    def spawn(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        log = open(self.tmp / f"{name}.log", "wb")  # noqa: SIM115 - closed in stop()
        self._logs.append(log)
        command = [sys.executable, "-m", "datagen", *args]
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        self.procs[name] = proc
        return proc

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
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            dead = [name for name, proc in self.procs.items() if proc.poll() is not None]
            assert not dead, f"{dead} exited\n{self.logs()}"
            try:
                if httpx.get(url, timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"{url} did not come up\n{self.logs()}")

    def wait_server_up(self, coordinator: str, name: str, timeout_s: float = STARTUP_TIMEOUT_S * 2) -> None:
        """Until a worker has taken server ``name``: submit's pre-flight checks learn from it."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            servers = httpx.get(f"{coordinator}/servers", timeout=5).json()["servers"]
            if any(s["name"] == name and s["state"] == "up" for s in servers):
                return
            time.sleep(0.1)
        raise AssertionError(f"no worker took server {name}\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(
            f"== {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in self.tmp.glob("*.log")
        )

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in self._logs:
            log.close()


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
