"""A submit names its upload in the same command that creates the job, before it writes the job's
manifest: a coordinator that resumes ingestions (at its start) leaves a job whose manifest is not
written yet (or never will be: its submit's coordinator died), so that nothing runs that storage
could not rebuild; once the manifest is there, the job resumes."""

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
from datagen.states import JobState
from service.app import create_app
from tests.support.specs import make_spec
from tests.support.wait import wait_until

NS = "resman"


def test_a_job_without_its_manifest_is_not_resumed_until_it_has_one(
    redis_client: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    settings = CoordinatorSettings(redis_url=redis_url, storage=str(tmp_path), namespace=NS)
    storage = Storage(settings.storage)
    jobs = JobStore(redis_client, Keys(NS))
    row = json.dumps({"id": "only", "messages": [{"role": "user", "content": "hello"}]}) + "\n"
    name = storage.write_input("half", [row.encode()])
    made = jobs.create_job(
        "half", JobSpec.model_validate(make_spec()), fields=jobs.ingest_input_fields(name, None)
    )
    app = create_app(settings)
    with TestClient(app):
        ingests = app.state.coordinator.ingests
        # Resumed at start: not this one (no thread ingests it, nothing of it landed).
        with ingests.lock:
            assert not ingests.running("half")
        assert jobs.state("half") is JobState.INGESTING
        assert jobs.progress("half").rows == 0
        storage.write_manifest("half", {"job_id": "half", "incarnation": made.incarnation})
        ingests.resume()
        wait_until(lambda: jobs.state("half") is not JobState.INGESTING, 60, "the job to be ingested")
    assert jobs.progress("half").accepted == 1
