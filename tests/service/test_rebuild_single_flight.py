"""Issue 36, item 2: a job is rebuilt at most once at a time, by every coordinator together.

- Concurrent recovers over real HTTP join the one that runs: one rebuild, the same answer for all,
  the counts of one recover.
- The rebuild's lease is a fencing token: a rebuilder that lost it writes no hash, and the ingest
  fence admits one ingestion run only (a rebuild's, or one that took the job's ingestion over), so
  an older run lands nothing more.

No worker runs here: records are committed by hand, as a worker commits them."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from datagen.control.enqueue import EnqueueOptions
from datagen.control.jobs import JobStore
from datagen.control.keys import Keys
from datagen.control.leases import Fencing, LeaseLostError, Leases
from datagen.records.schema import records_to_table
from datagen.records.storage import Storage
from datagen.settings import CoordinatorSettings
from datagen.spec import JobSpec
from datagen.states import JobState, PromptClass
from service.ingest import IngestOptions, Ingestor
from tests.support.metrics import metric_value
from tests.support.processes import serve_coordinator
from tests.support.records import make_record
from tests.support.specs import make_spec
from tests.support.wait import wait_until

NS = "sf"
ROWS = 200
COMMITTED = 30
RECOVERS = 8
TIMEOUT_S = 60.0


@pytest.fixture
def settings(redis_url: str, tmp_path: Path) -> CoordinatorSettings:
    return CoordinatorSettings(redis_url=redis_url, storage=str(tmp_path), namespace=NS)


def _rows(n: int = ROWS) -> bytes:
    rows = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"question {i}"}]} for i in range(n)]
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def _commit(storage: Storage, job_id: str, sample_ids: list[str]) -> None:
    manifest = storage.read_manifest(job_id)
    assert manifest is not None
    records = [make_record(s, [1, 2, 3, 4, 5], 3, job_id=job_id) for s in sample_ids]
    info = {"worker": "w", "committed_at_ms": 1, "incarnation": manifest["incarnation"]}
    storage.commit_shard(job_id, f"w-{job_id}", records_to_table(records), info)


def _job(url: str, job_id: str) -> dict[str, Any]:
    return httpx.get(f"{url}/jobs/{job_id}", timeout=10).json()  # type: ignore[no-any-return]


def test_concurrent_recovers_join_one_rebuild(
    settings: CoordinatorSettings, redis_client: redis.Redis
) -> None:
    storage = Storage(settings.storage)
    with serve_coordinator(settings) as url:
        response = httpx.post(
            f"{url}/jobs",
            data={"spec": json.dumps(make_spec()), "job_id": "j1"},
            files={"dataset": ("d.jsonl", _rows(), "application/jsonl")},
            timeout=30,
        )
        assert response.status_code == 202, response.text
        wait_until(lambda: _job(url, "j1")["state"] == "running", TIMEOUT_S, "j1 to be ingested")
        _commit(storage, "j1", [f"r{i}" for i in range(COMMITTED)])

        answers: list[httpx.Response] = []
        barrier = threading.Barrier(RECOVERS)

        def recover() -> None:
            barrier.wait()
            answers.append(httpx.post(f"{url}/jobs/j1/recover", timeout=TIMEOUT_S))

        threads = [threading.Thread(target=recover) for _ in range(RECOVERS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert [a.status_code for a in answers] == [200] * RECOVERS, [a.text for a in answers]
        job = wait_until(
            lambda: (j := _job(url, "j1"))["state"] == "running" and j, TIMEOUT_S, "j1 to be ingested again"
        )
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert metric_value(metrics, "datagen_jobs_rebuilt_total", reason="recover") == 1, (
        "rebuilt more than once"
    )
    # One recover's counts: every row once, the committed ones done, the rest queued once.
    counts = (job["rows"], job["total"], job["done"], job["queued"])
    assert counts == (ROWS, ROWS, COMMITTED, ROWS - COMMITTED)
    backlog = redis_client.lrange(Keys(NS).job_backlog("j1", PromptClass.SHORT), 0, -1)
    assert len(backlog) == len(set(backlog)) == ROWS - COMMITTED
    bodies = [a.json() for a in answers]
    assert sorted(b["joined"] for b in bodies) == [False] + [True] * (RECOVERS - 1)
    assert len({json.dumps(b["rebuilt"], sort_keys=True) for b in bodies}) == 1, "one rebuild's note"
    assert bodies[0]["rebuilt"]["rebuilds"] == 1


def test_a_rebuilder_that_lost_its_lease_writes_nothing(redis_client: redis.Redis) -> None:
    keys = Keys(NS)
    jobs, leases = JobStore(redis_client, keys), Leases(redis_client)
    spec = JobSpec.model_validate(make_spec())
    jobs.create("j2", spec)
    before = redis_client.hgetall(keys.job("j2"))
    stale = leases.try_acquire(keys.job_rebuild_lease("j2"))
    assert stale is not None
    redis_client.delete(keys.job_rebuild_lease("j2"))  # it expired while its holder stalled
    newer = leases.try_acquire(keys.job_rebuild_lease("j2"))
    assert newer is not None
    with pytest.raises(LeaseLostError):
        stale.check()
    with pytest.raises(LeaseLostError):
        jobs.create("j2", spec, incarnation="x", replace=True, rebuild=stale.fencing)
    assert redis_client.hgetall(keys.job("j2")) == before, "the stale rebuilder wrote the hash"
    assert jobs.create("j2", spec, incarnation="x", replace=True, rebuild=newer.fencing)
    assert jobs.rebuild_token("j2") == newer.token
    assert jobs.ingest_fence("j2") == f"x/{newer.token}"
    with pytest.raises(LeaseLostError):
        jobs.create("j2", spec, incarnation="x", replace=True, rebuild=Fencing(newer.key, "forged"))


def test_an_ingestion_taken_over_lands_nothing_more(redis_client: redis.Redis, tmp_path: Path) -> None:
    keys = Keys(NS)
    jobs, storage = JobStore(redis_client, keys), Storage(tmp_path)
    jobs.create("j3", JobSpec.model_validate(make_spec()))
    incarnation = jobs.incarnation("j3")
    assert incarnation
    first = jobs.take_ingest("j3", incarnation)
    second = jobs.take_ingest("j3", incarnation)
    assert first and second and first != second and jobs.ingest_fence("j3") == second
    assert jobs.take_ingest("j3", "another") is None
    dataset = tmp_path / "rows.jsonl"
    dataset.write_bytes(_rows(20))
    enqueue = EnqueueOptions(result_ttl_s=600, failure_ttl_s=600, max_worker_losses=3)
    ingestor = Ingestor(redis_client, keys, jobs, storage, IngestOptions(chunk=50, enqueue=enqueue))

    assert not ingestor.run("j3", dataset, threading.Event(), fence=first)
    assert jobs.progress("j3").accepted == 0, "the run that lost the fence enqueued"
    assert ingestor.run("j3", dataset, threading.Event(), fence=second)
    progress = jobs.progress("j3")
    assert (progress.state, progress.accepted) == (JobState.RUNNING, 20)
