"""Jobs ingested the way the coordinator ingests them: synchronously into real Redis, through the
API until ingestion ends, or stopped part way."""

from __future__ import annotations

import json
import threading
from typing import Any

import redis
from fastapi.testclient import TestClient

from datagen.control.enqueue import EnqueueOptions
from datagen.control.jobs import JobStore
from datagen.control.keys import Keys
from datagen.records.storage import Storage
from datagen.spec import JobSpec
from datagen.states import JobState
from service.ingest import IngestOptions, Ingestor
from tests.support.wait import wait_until

__all__ = ["INGEST_TIMEOUT_S", "StopAfter", "ingest_rows", "wait_ingested"]

INGEST_TIMEOUT_S = 30.0
INGEST_POLL_S = 0.05
RESULT_TTL_S = 600
INGEST_CHUNK = 50


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
    enqueue = EnqueueOptions(
        result_ttl_s=RESULT_TTL_S, failure_ttl_s=RESULT_TTL_S, max_worker_losses=max_worker_losses
    )
    options = IngestOptions(chunk=INGEST_CHUNK, enqueue=enqueue)
    Ingestor(redis_client, keys, jobs, storage, options).run(job_id, input_name, threading.Event())


def wait_ingested(client: TestClient, job_id: str, timeout_s: float = INGEST_TIMEOUT_S) -> dict[str, Any]:
    """The job as ``GET /jobs/{job_id}`` shows it once its ingestion has ended."""

    def ingested() -> dict[str, Any] | None:
        job: dict[str, Any] = client.get(f"/jobs/{job_id}").json()
        return job if job["state"] != JobState.INGESTING else None

    return wait_until(ingested, timeout_s, f"job {job_id} to finish ingesting", interval_s=INGEST_POLL_S)


class StopAfter(threading.Event):
    """A stop signal that trips after ``checks`` looks (ingestion looks once before the run and once
    per row read): an ingestion stopped part way, for real."""

    def __init__(self, checks: int) -> None:
        super().__init__()
        self.left = checks

    def is_set(self) -> bool:
        self.left -= 1
        return self.left < 0 or super().is_set()
