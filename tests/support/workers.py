"""Workers in the test process: settings with every interval short, and for the worker component
tests (fleet, control, admission, reaper…) a job of n short prompts ingested into real Redis and a
worker started and stopped by hand."""

from __future__ import annotations

import asyncio
from typing import Any

import redis

from datagen.control.keys import Keys
from datagen.records.storage import Storage
from datagen.settings import WorkerSettings
from datagen.states import PromptClass
from tests.support.ingest import ingest_rows
from tests.support.specs import job_spec
from workers.claim.rqbridge import QueueIdentity
from workers.fleet.servers import ServerSpec
from workers.worker import Worker

__all__ = [
    "FAST_WORKER",
    "KEYS",
    "NOT_MET",
    "NS",
    "WAIT_S",
    "close_left_open",
    "fast_worker_settings",
    "ingest",
    "records",
    "settings",
    "short_identity",
    "start",
    "stop",
]

NS = "eng"
KEYS = Keys(NS)
# What the component tests wait for a condition, and say when it does not come.
WAIT_S = 10.0
NOT_MET = "condition not met in time"

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
# The component tests' jobs: every prompt short, outputs reproducible, the context length left to
# the servers.
COMPONENT_SPEC: dict[str, Any] = {
    "context_len": None,
    "short_max_new_tokens": 400,
    "long_threshold_tokens": 100_000,
    "sampling": {"sampling_seed": 3},
}
COMPONENT_WORKER: dict[str, Any] = {
    "short_concurrency": 4,
    "long_concurrency": 1,
    "drain_timeout_s": 10,
    "kv_controller": False,
}


def fast_worker_settings(
    redis_url: str, storage: Storage, namespace: str, **overrides: Any
) -> WorkerSettings:
    values = dict(FAST_WORKER, redis_url=redis_url, storage=str(storage.root), namespace=namespace)
    values.update(overrides)
    return WorkerSettings(**values)


def ingest(
    redis_client: redis.Redis,
    storage: Storage,
    job_id: str,
    n: int,
    *,
    max_worker_losses: int = 3,
    **spec: Any,
) -> None:
    """Job ``job_id`` of ``n`` prompts ``"prompt number {i}"`` (ids ``p{i}``) in namespace ``NS``."""
    rows = [
        {"id": f"p{i}", "messages": [{"role": "user", "content": f"prompt number {i}"}]} for i in range(n)
    ]
    ingest_rows(
        redis_client,
        storage,
        KEYS,
        job_id,
        job_spec(COMPONENT_SPEC, **spec),
        rows,
        max_worker_losses=max_worker_losses,
    )


def short_identity(redis_client: redis.Redis, name: str) -> QueueIdentity:
    """A registered worker identity ``name`` on namespace ``NS``'s short queue (beats every 0.5 s)."""
    identity = QueueIdentity(KEYS.queue_name(PromptClass.SHORT), name, redis_client, 0.5, f"1-{name}")
    identity.register()
    return identity


def settings(redis_url: str, storage: Storage, **overrides: Any) -> WorkerSettings:
    return fast_worker_settings(redis_url, storage, NS, **{**COMPONENT_WORKER, **overrides})


# Workers `start` made that `stop` has not closed: a test that fails before its `stop` would leave
# one running, and its Redis connections, collected during a later test, fail that one with
# unclosed-socket warnings. tests/workers/conftest.py closes them as each test ends.
_open: list[Worker] = []


async def start(settings: WorkerSettings, servers: dict[str, str], *, burst: bool = False) -> Worker:
    specs = [ServerSpec(name, url) for name, url in servers.items()]
    worker = Worker(settings, specs, burst=burst, install_signal_handlers=False)
    _open.append(worker)
    await worker.start()
    return worker


async def stop(worker: Worker, run: asyncio.Task[None] | None = None) -> None:
    await worker.drain()
    if run is not None:
        await run
    await worker.close()
    _open.remove(worker)


async def close_left_open() -> None:
    """Drain and close every worker `start` made that `stop` has not."""
    while _open:
        worker = _open.pop()
        await worker.drain()
        await worker.close()


def records(storage: Storage, job_id: str) -> list[dict[str, Any]]:
    return [row for batch in storage.iter_record_batches(job_id) for row in batch.to_pylist()]
