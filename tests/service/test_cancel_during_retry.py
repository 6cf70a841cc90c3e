"""Cancel wins over a running retry: a job whose retry is still reading thousands of failed prompts
is cancelled at once (200 within 1 s), the retry stops at its next slice, and every count stays
whole (done + failed + cancelled = total, failed never negative)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient
from rq import Queue

from datagen.control.jobs import JobStore
from datagen.control.keys import Keys
from datagen.records.storage import Storage
from datagen.settings import CoordinatorSettings
from datagen.spec import JobSpec
from datagen.states import JobState, Priority, PromptClass
from tests.support.ingest import ingest_rows
from tests.support.specs import make_spec
from tests.support.wait import wait_until

NS = "cr"
JOB = "big"
# Enough failed prompts that reading them takes the retry a few seconds on this machine.
FAILED = 6000
CANCEL_BUDGET_S = 1.0


@pytest.fixture
def settings(redis_url: str, tmp_path: Path) -> CoordinatorSettings:
    return CoordinatorSettings(redis_url=redis_url, storage=str(tmp_path), namespace=NS)


def _plant_failures(redis_client: redis.Redis, settings: CoordinatorSettings) -> None:
    """A completed job whose every prompt failed, as workers leave one: each RQ job ``failed`` in
    its class's failed registry, the job counting them failed."""
    keys = Keys(NS)
    rows = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(FAILED)]
    ingest_rows(redis_client, Storage(settings.storage), keys, JOB, JobSpec.model_validate(make_spec()), rows)
    backlog = keys.job_backlog(JOB, PromptClass.SHORT)
    ids = [i.decode() for i in redis_client.lrange(backlog, 0, -1)]
    registry = Queue(keys.queue_name(PromptClass.SHORT), connection=redis_client).failed_job_registry
    expires = time.time() + 3600
    with redis_client.pipeline(transaction=False) as pipe:
        for rq_id in ids:
            pipe.hset(f"rq:job:{rq_id}", "status", "failed")
        pipe.zadd(registry.key, dict.fromkeys(ids, expires))
        pipe.delete(backlog)
        for priority in Priority:
            pipe.zrem(keys.dispatch_jobs(PromptClass.SHORT, priority), JOB)
        pipe.hset(keys.job(JOB), mapping={"failed": len(ids), "state": JobState.COMPLETED.value})
        pipe.hset(keys.job_breakdown(JOB), "failed|default|short", len(ids))
        pipe.execute()


def test_cancel_answers_at_once_during_a_large_retry(
    client: TestClient, redis_client: redis.Redis, settings: CoordinatorSettings
) -> None:
    _plant_failures(redis_client, settings)
    answers: dict[str, Any] = {}

    def retry() -> None:
        answers["retry"] = client.post(f"/jobs/{JOB}/retry")

    thread = threading.Thread(target=retry)
    thread.start()
    lock = Keys(NS).job_retry_lock(JOB)
    wait_until(lambda: redis_client.exists(lock), 10, "the retry to start", interval_s=0.005)
    started = time.perf_counter()
    cancelled = client.post(f"/jobs/{JOB}/cancel")
    took_s = time.perf_counter() - started
    still_retrying = bool(redis_client.exists(lock))
    thread.join(timeout=60)

    assert cancelled.status_code == 200, cancelled.text
    assert took_s < CANCEL_BUDGET_S, f"cancel took {took_s:.2f} s"
    assert still_retrying, "the retry ended before the cancel: the test proves nothing"
    assert answers["retry"].status_code == 200, answers["retry"].text
    job = JobStore(redis_client, Keys(NS)).progress(JOB)
    assert job.state is JobState.CANCELLED
    assert job.failed >= 0 and job.done + job.failed + job.cancelled == job.accepted == FAILED
    assert redis_client.llen(Keys(NS).job_backlog(JOB, PromptClass.SHORT)) == 0
    print(f"\ncancel answered in {took_s * 1000:.0f} ms during a retry of {FAILED} failed prompts")


def test_a_retry_with_nothing_to_put_back_leaves_the_job_completed(
    client: TestClient, redis_client: redis.Redis, settings: CoordinatorSettings
) -> None:
    _plant_failures(redis_client, settings)
    answer = client.post(f"/jobs/{JOB}/retry", params={"reason": "no_such_reason"})
    assert answer.status_code == 200, answer.text
    assert answer.json()["retried_now"] == 0
    assert JobStore(redis_client, Keys(NS)).state(JOB) is JobState.COMPLETED
