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


def test_a_submit_to_a_job_without_its_manifest_is_checked_after_the_create_and_leaves_nothing_if_refused(
    redis_client: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    """A submit to an id with no manifest looks for a job of it only when the create finds one (a new
    job costs no read before its create). A job made without its manifest (its coordinator died
    before writing it) is found then: a submit of another spec is refused as before, and its upload
    is not left in storage, where a rebuild would ingest it."""
    settings = CoordinatorSettings(redis_url=redis_url, storage=str(tmp_path), namespace=NS)
    storage = Storage(settings.storage)
    jobs = JobStore(redis_client, Keys(NS))
    row = json.dumps({"id": "only", "messages": [{"role": "user", "content": "hello"}]}) + "\n"
    name = storage.write_input("half", [row.encode()])
    jobs.create_job("half", JobSpec.model_validate(make_spec()), fields=jobs.ingest_input_fields(name, None))
    with TestClient(create_app(settings)) as client:
        response = client.post(
            "/jobs",
            data={"spec": json.dumps(make_spec(short_max_new_tokens=99)), "job_id": "half"},
            files={"dataset": ("d.jsonl", row.encode(), "application/jsonl")},
        )
        assert response.status_code == 400, response.text
        assert response.json()["error"] == (
            "job half exists with a different spec; submit with the same spec to append, or use a new job id"
        )
        assert storage.input_names("half") == [name]
        assert jobs.cancel("half")
        response = client.post(
            "/jobs",
            data={"spec": json.dumps(make_spec()), "job_id": "half"},
            files={"dataset": ("d.jsonl", row.encode(), "application/jsonl")},
        )
        assert response.status_code == 409, response.text
        assert response.json()["error"] == "job half was cancelled; submit under a new job id"
        assert storage.input_names("half") == [name]
        # Nor what went beside the refused uploads (how to read them): only the first input's.
        folder = Path(storage.url("half").removeprefix("file://")) / "input"
        assert {p.name.split(".", 1)[0] for p in folder.iterdir()} == {name.split(".", 1)[0]}
