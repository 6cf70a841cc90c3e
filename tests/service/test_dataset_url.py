"""Datasets by reference (``dataset_url``): only under ``DATAGEN_DATASET_ALLOWLIST``, read from an
``s3://`` bucket on a real S3-compatible server (moto's), pinned when submitted, and refused when
they changed before a resumed ingestion reads them again."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis
from fastapi.testclient import TestClient
from rq.job import Job
from rq.serializers import JSONSerializer

from datagen.control.enqueue import EnqueueOptions
from datagen.control.jobs import JobStore
from datagen.control.keys import Keys
from datagen.control.payload import unpack_ids
from datagen.prompts.inputs import ColumnMap, resolve_reference
from datagen.records.storage import Storage
from datagen.settings import CoordinatorSettings
from datagen.spec import JobSpec
from datagen.states import JobState, PromptClass
from service.app import create_app
from service.ingest import IngestOptions, Ingestor
from tests.support.ingest import StopAfter, wait_ingested
from tests.support.s3 import moto_server, s3_bucket
from tests.support.specs import CLASS_LIMITS, make_spec, spec_json
from tests.support.wait import wait_until

NS = "ref"
JOB = "job"
# The DeepSeek tokenizer and datagen/templates/deepseek_r1.jinja, read off once and written by hand.
HI = [0, 128803, 23166, 128804, 128821, 201]
YO = [0, 128803, 76943, 128804, 128821, 201]
ROWS = 100
ENQUEUE = EnqueueOptions(result_ttl_s=600, failure_ttl_s=600, max_worker_losses=3)


@pytest.fixture(scope="module")
def moto_endpoint() -> Iterator[str]:
    with moto_server() as endpoint:
        yield endpoint


@pytest.fixture
def bucket(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    return s3_bucket(moto_endpoint, monkeypatch)


def _settings(redis_url: str, tmp_path: Path, allowlist: str) -> CoordinatorSettings:
    return CoordinatorSettings(
        redis_url=redis_url, storage=str(tmp_path / "store"), namespace=NS, dataset_allowlist=allowlist
    )


def _post(client: TestClient, url: str, **fields: str) -> Any:
    return client.post("/jobs", data={"spec": spec_json(CLASS_LIMITS), "dataset_url": url, **fields})


def _prompt_ids(redis_client: redis.Redis, job_id: str) -> dict[str, list[int]]:
    found = {}
    for cls in PromptClass:
        for rq_id in redis_client.lrange(Keys(NS).job_backlog(job_id, cls), 0, -1):
            text = rq_id.decode() if isinstance(rq_id, bytes) else rq_id
            payload = Job.fetch(text, connection=redis_client, serializer=JSONSerializer).args[0]
            found[payload["sample_id"]] = unpack_ids(payload["prompt_ids"])
    return found


def test_an_empty_allowlist_refuses_every_reference_in_one_line(redis_url: str, tmp_path: Path) -> None:
    with TestClient(create_app(_settings(redis_url, tmp_path, ""))) as client:
        response = _post(client, str(tmp_path / "d.parquet"))
    assert (response.status_code, response.json()["error"]) == (
        400,
        "datasets by reference are off on this coordinator: an operator must list allowed prefixes in "
        "DATAGEN_DATASET_ALLOWLIST, or upload the file instead of giving dataset_url",
    )


@pytest.mark.parametrize(
    "url",
    [
        "s3://data-private/d.parquet",  # a longer bucket name is not under the prefix
        "s3://other/d.parquet",
        "s3://data/../other/d.parquet",
        "{outside}/d.parquet",
        "{allowed}/../d.parquet",  # resolved: outside
        "file://{outside}/d.parquet",
    ],
)
def test_a_reference_outside_the_allowlist_is_refused(redis_url: str, tmp_path: Path, url: str) -> None:
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    for directory in (allowed, outside):
        directory.mkdir()
        pq.write_table(pa.table({"prompt": ["Hi"]}), directory / "d.parquet")
    url = url.format(allowed=allowed, outside=outside)
    with TestClient(create_app(_settings(redis_url, tmp_path, f"s3://data,{allowed}"))) as client:
        response = _post(client, url)
        assert (response.status_code, response.json()["error"]) == (
            400,
            f"dataset_url {url!r} is not allowed on this coordinator; an operator must add it (or a "
            "prefix of it) to DATAGEN_DATASET_ALLOWLIST",
        )
        assert client.get("/jobs").json()["jobs"] == []
        # Under the prefix, the same file is read (a file:// URL too).
        ok = _post(client, f"file://{allowed}/d.parquet")
        assert ok.status_code == 202, ok.text


def test_a_parquet_directory_on_s3(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path, bucket: str
) -> None:
    s3 = fsspec.filesystem("s3")
    with s3.open(f"{bucket}/data/sharegpt/train-00000.parquet", "wb") as fh:
        pq.write_table(
            pa.table({"uid": ["h", "bad"], "conv": [[{"role": "user", "content": "Hi"}], None]}), fh
        )
    with s3.open(f"{bucket}/data/sharegpt/train-00001.parquet", "wb") as fh:
        pq.write_table(pa.table({"uid": ["y"], "conv": [[{"role": "user", "content": "Yo"}]]}), fh)
    url = f"s3://{bucket}/data/sharegpt"
    with TestClient(create_app(_settings(redis_url, tmp_path, f"s3://{bucket}/data/"))) as client:
        response = _post(client, url, messages_column="conv", id_column="uid")
        assert response.status_code == 202, response.text
        job_id = response.json()["id"]
        job = wait_ingested(client, job_id)
        assert (job["rows"], job["total"], job["rejected"]) == (3, 2, 1)
        assert _prompt_ids(redis_client, job_id) == {"h": HI, "y": YO}
        [error] = client.get(f"/jobs/{job_id}/errors").json()["errors"]
        assert (error["line"], error["file"], error["row"]) == (2, "train-00000.parquet", 2)
    # Nothing uploaded: the job's input is the reference, each object pinned by its size and ETag.
    storage = Storage(str(tmp_path / "store"))
    [name] = storage.input_names(job_id)
    assert name.endswith(".ref.json")
    stored = json.loads(Path(storage.url(job_id, "input", name)).read_text())
    assert (stored["url"], stored["format"], stored["columns"]) == (
        url,
        "parquet-dir",
        {"messages": "conv", "id": "uid"},
    )
    assert [sorted(f) for f in stored["files"]] == [["etag", "name", "size"]] * 2


def _part_way(redis_client: redis.Redis, tmp_path: Path, url: str) -> tuple[JobStore, Ingestor, str]:
    """A job of ``url`` whose ingestion stopped after its first chunk (32 of ``ROWS`` rows)."""
    keys = Keys(NS)
    storage = Storage(str(tmp_path / "store"))
    jobs = JobStore(redis_client, keys)
    jobs.create(JOB, JobSpec.model_validate(make_spec()))
    name = storage.write_reference(JOB, resolve_reference(url), ColumnMap())
    ingestor = Ingestor(
        redis_client, keys, jobs, storage, IngestOptions(chunk=1000, enqueue=ENQUEUE, first_chunk_s=60.0)
    )
    assert ingestor.run(JOB, name, StopAfter(1 + 40)) is False
    assert jobs.ingest_line(JOB) == 32
    return jobs, ingestor, name


def _rows_table(last: str) -> pa.Table:
    return pa.table(
        {"id": [f"r{i}" for i in range(ROWS)], "prompt": [f"q{i}" for i in range(ROWS - 1)] + [last]}
    )


def test_a_local_input_that_changed_is_refused_at_resume(redis_client: redis.Redis, tmp_path: Path) -> None:
    path = tmp_path / "rows.parquet"
    pq.write_table(_rows_table("last"), path)
    jobs, ingestor, name = _part_way(redis_client, tmp_path, str(path))
    pq.write_table(_rows_table("changed"), path)  # rewritten: the same rows but the last
    assert ingestor.run(JOB, name, threading.Event()) is False
    progress = jobs.progress(JOB)
    assert progress.state is JobState.FAILED
    assert progress.error is not None and progress.error.startswith(
        f"dataset {path}: rows.parquet changed since it was submitted ("
    )
    assert progress.error.endswith(
        "differ); the job cannot go on from its checkpoint: submit the input as it is under a new job id"
    )
    assert progress.accepted == 32  # nothing of the changed file was enqueued


def test_an_object_that_changed_is_refused_at_resume_and_an_unchanged_one_resumes(
    redis_client: redis.Redis, tmp_path: Path, bucket: str
) -> None:
    s3 = fsspec.filesystem("s3")
    url = f"s3://{bucket}/rows.parquet"
    with s3.open(url, "wb") as fh:
        pq.write_table(_rows_table("last"), fh)
    jobs, ingestor, name = _part_way(redis_client, tmp_path, url)
    assert ingestor.run(JOB, name, StopAfter(1 + 40)) is False  # unchanged: it goes on, 32 more
    assert jobs.ingest_line(JOB) == 32 + 32
    with s3.open(url, "wb") as fh:
        pq.write_table(_rows_table("lost"), fh)  # same size, another ETag
    assert ingestor.run(JOB, name, threading.Event()) is False
    progress = jobs.progress(JOB)
    assert (progress.state, progress.error, progress.accepted) == (
        JobState.FAILED,
        f"dataset {url}: rows.parquet changed since it was submitted (etag differ); the job cannot go on "
        "from its checkpoint: submit the input as it is under a new job id",
        32 + 32,
    )


def test_a_rebuild_from_storage_refuses_an_input_that_changed(redis_url: str, tmp_path: Path) -> None:
    refs = tmp_path / "refs"
    refs.mkdir()
    path = refs / "rows.parquet"
    pq.write_table(_rows_table("last"), path)
    with TestClient(create_app(_settings(redis_url, tmp_path, str(refs)))) as client:
        response = _post(client, str(path), job_id="rebuilt")
        assert response.status_code == 202, response.text
        assert wait_ingested(client, "rebuilt")["total"] == ROWS
        pq.write_table(_rows_table("changed"), path)
        assert client.post("/jobs/rebuilt/recover").status_code == 200
        job = wait_until(
            lambda: (j := client.get("/jobs/rebuilt").json())["state"] == "failed" and j,
            10.0,
            "the rebuilt job's ingestion to refuse the changed input",
        )
        assert job["error"].startswith(f"dataset {path}: rows.parquet changed since it was submitted (")


def test_a_refused_reference_never_echoes_its_password(redis_url: str, tmp_path: Path) -> None:
    with TestClient(create_app(_settings(redis_url, tmp_path, "s3://data"))) as client:
        response = _post(client, "https://reader:s3cr3t@datasets.example.com/d.parquet")
        assert (response.status_code, response.json()["error"]) == (
            400,
            "dataset_url 'https://reader:***@datasets.example.com/d.parquet' is not allowed on this "
            "coordinator; an operator must add it (or a prefix of it) to DATAGEN_DATASET_ALLOWLIST",
        )
