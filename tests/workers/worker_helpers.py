"""Shared by the worker component tests (fleet, control, admission, reaper): a job of n short
prompts ingested into real Redis, worker settings, and a worker started and stopped by hand."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import redis

from datagen.control.keys import Keys
from datagen.prompts.tokenization import bundled_tokenizer_path, default_chat_template_path
from datagen.records.storage import Storage
from datagen.settings import WorkerSettings
from datagen.spec import JobSpec
from tests.helpers import fast_worker_settings, ingest_rows
from workers.fleet import ServerSpec
from workers.worker import Worker

NS = "eng"
KEYS = Keys(NS)


def ingest(
    redis_client: redis.Redis,
    storage: Storage,
    job_id: str,
    n: int,
    *,
    max_worker_losses: int = 3,
    **spec: Any,
) -> None:
    values: dict[str, Any] = {
        "tokenizer": bundled_tokenizer_path(),
        "chat_template": str(default_chat_template_path()),
        "short_max_new_tokens": 400,
        "long_threshold_tokens": 100_000,
        "sampling": {"sampling_seed": 3},
        **spec,
    }
    rows = [
        {"id": f"p{i}", "messages": [{"role": "user", "content": f"prompt number {i}"}]} for i in range(n)
    ]
    ingest_rows(
        redis_client,
        storage,
        KEYS,
        job_id,
        JobSpec.model_validate(values),
        rows,
        max_worker_losses=max_worker_losses,
    )


def settings(redis_url: str, storage: Storage, **overrides: Any) -> WorkerSettings:
    values = {"short_concurrency": 4, "long_concurrency": 1, "drain_timeout_s": 10, "kv_controller": False}
    return fast_worker_settings(redis_url, storage, NS, **{**values, **overrides})


async def start(settings: WorkerSettings, servers: dict[str, str], *, burst: bool = False) -> Worker:
    specs = [ServerSpec(name, url) for name, url in servers.items()]
    worker = Worker(settings, specs, burst=burst, install_signal_handlers=False)
    await worker.start()
    return worker


async def stop(worker: Worker, run: asyncio.Task[None] | None = None) -> None:
    await worker.drain()
    if run is not None:
        await run
    await worker.close()


def records(storage: Storage, job_id: str) -> list[dict[str, Any]]:
    return [row for batch in storage.iter_record_batches(job_id) for row in batch.to_pylist()]


async def eventually(predicate: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.05)
