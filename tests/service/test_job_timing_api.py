"""A job's time to first record and tail as `GET /jobs/{id}` and the coordinator's gauges show them:
a job run end to end (coordinator API, a worker, the simulator), and fixed timestamps for the gauges."""

from __future__ import annotations

import json
from pathlib import Path

import redis
from fastapi.testclient import TestClient

from datagen.control.jobs import JobStore
from datagen.control.keys import Keys
from datagen.records.storage import Storage
from datagen.settings import CoordinatorSettings
from datagen.spec import JobSpec
from service.app import create_app
from service.fleetview import FleetView
from service.metrics import CoordinatorMetrics
from tests.support.ingest import wait_ingested
from tests.support.sim import running_simulator
from tests.support.specs import make_spec
from tests.support.workers import fast_worker_settings
from workers.fleet.servers import ServerSpec
from workers.worker import Worker

NS = "timing"
ROWS = 40


async def test_a_job_run_end_to_end_shows_its_start_and_tail(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path, tokenizer_path: str
) -> None:
    storage = Storage(str(tmp_path / "data"))
    settings = CoordinatorSettings(redis_url=redis_url, storage=str(storage.root), namespace=NS)
    rows = "".join(json.dumps({"id": f"r{i}", "prompt": f"question {i}"}) + "\n" for i in range(ROWS))
    with TestClient(create_app(settings)) as client:
        response = client.post(
            "/jobs",
            data={"spec": json.dumps(make_spec(short_max_new_tokens=16))},
            files={"dataset": ("d.jsonl", rows.encode(), "application/jsonl")},
        )
        assert response.status_code == 202, response.text
        job_id = response.json()["id"]
        before = wait_ingested(client, job_id)
        assert (before["time_to_first_record_s"], before["tail_s"]) == (None, None)  # no worker yet

        with running_simulator(tokenizer_path=tokenizer_path, time_scale=0.0, context_len=4096) as url:
            worker_settings = fast_worker_settings(redis_url, storage, NS)
            worker = Worker(
                worker_settings, [ServerSpec("s0", url)], burst=True, install_signal_handlers=False
            )
            await worker.main()
        job = client.get(f"/jobs/{job_id}").json()
        [listed] = [j for j in client.get("/jobs").json()["jobs"] if j["id"] == job_id]

    assert (job["state"], job["done"]) == ("completed", ROWS)
    raw = {
        k.decode(): int(v)
        for k, v in redis_client.hgetall(Keys(NS).job(job_id)).items()
        if k.endswith(b"_ms")
    }
    created, first, tail_from, finished = (
        raw[f] for f in ("created_at_ms", "first_record_at_ms", "tail_from_ms", "finished_at_ms")
    )
    assert created < first <= tail_from <= finished
    assert job["time_to_first_record_s"] == round((first - created) / 1000, 3)
    assert job["tail_s"] == round((finished - tail_from) / 1000, 3)
    assert listed["time_to_first_record_s"] == job["time_to_first_record_s"]
    assert listed["tail_s"] == job["tail_s"]


def _gauges(metrics: CoordinatorMetrics, job_id: str) -> tuple[float | None, float | None]:
    return (
        metrics.registry.get_sample_value("datagen_job_first_record_seconds", {"job": job_id}),
        metrics.registry.get_sample_value("datagen_job_tail_seconds", {"job": job_id}),
    )


def test_the_gauges_answer_before_and_after_the_first_record(redis_client: redis.Redis) -> None:
    keys = Keys(NS)
    jobs = JobStore(redis_client, keys)
    jobs.create("j", JobSpec(tokenizer="tok"))
    metrics = CoordinatorMetrics(fleet=FleetView(redis_client, keys), jobs=jobs)
    # No record yet: the wait so far (the job was made just now), and no tail.
    waited, tail = _gauges(metrics, "j")
    assert waited is not None and 0 < waited < 60 and tail == 0.0

    # Fixed timestamps: 2.5 s to the first record, and a tail that began long ago (still running).
    created = int(redis_client.hget(keys.job("j"), "created_at_ms") or 0)
    redis_client.hset(
        keys.job("j"), mapping={"first_record_at_ms": created + 2500, "tail_from_ms": created - 1000}
    )
    first_s, tail_s = _gauges(metrics, "j")
    assert first_s == 2.5
    assert tail_s is not None and tail_s >= 1.0  # at least the second before creation, and growing

    redis_client.hset(keys.job("j"), "state", "completed")  # an ended job's series are gone
    assert _gauges(metrics, "j") == (None, None)
