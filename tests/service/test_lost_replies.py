"""Every control-plane write whose reply can be lost is safe to send again: a proxy in front of the
real Redis lets the command through, loses its reply and cuts the connection, and redis-py sends it
again on a new one. Counts must still equal the file's rows; an id must stay usable."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient
from redis.backoff import NoBackoff
from redis.retry import Retry

from datagen.control.enqueue import EnqueueOptions
from datagen.control.jobs import JobStore
from datagen.control.keys import Keys
from datagen.control.scripts import source
from datagen.records.storage import Storage
from datagen.settings import CoordinatorSettings
from datagen.states import JobState, PromptClass
from datagen_cli.local.redis_server import LocalRedis
from service.app import create_app
from service.ingest import IngestOptions, Ingestor
from tests.support.ingest import wait_ingested
from tests.support.redisproxy import ReplyDropper, reply_dropper
from tests.support.specs import job_spec, make_spec

NS = "lost"
JOB = "job1"
ROWS = 300
ENQUEUE = EnqueueOptions(result_ttl_s=600, failure_ttl_s=600, max_worker_losses=3)


@pytest.fixture
def proxy(redis_server: LocalRedis, redis_url: str) -> Iterator[ReplyDropper]:
    with reply_dropper(redis_server.port) as dropper:
        yield dropper


@pytest.fixture
def proxied(proxy: ReplyDropper) -> Iterator[redis.Redis]:
    """A client as the services make one (no retries of its own: a lost reply is an error)."""
    client = redis.Redis.from_url(proxy.url)
    yield client
    client.close()


@pytest.fixture
def resending(proxy: ReplyDropper) -> Iterator[redis.Redis]:
    """A client that sends a command again on a new connection when its reply is lost."""
    client = redis.Redis.from_url(proxy.url, retry=Retry(NoBackoff(), 3))
    yield client
    client.close()


def test_a_create_whose_reply_is_lost_creates_the_job_once(
    proxy: ReplyDropper, resending: redis.Redis, redis_client: redis.Redis
) -> None:
    jobs = JobStore(resending, Keys(NS))
    redis_client.script_load(source("create"))  # so that the first EVALSHA is the create itself
    proxy.drop_reply(b"EVALSHA")
    assert jobs.create(JOB, job_spec()) is True
    assert proxy.dropped == 1
    # Sent twice, answered "created" twice: the job is whole, with one incarnation.
    progress = JobStore(redis_client, Keys(NS)).progress(JOB)
    assert progress.state is JobState.INGESTING
    assert redis_client.zscore(Keys(NS).jobs_index(), JOB) is not None
    fence, incarnation = redis_client.hmget(Keys(NS).job(JOB), ["ingest_fence", "incarnation"])
    assert fence == incarnation
    # A second, separate create of the id is a resubmission, not a new job.
    assert jobs.create(JOB, job_spec()) is False


def test_a_half_created_job_is_made_whole_not_a_permanent_409(redis_client: redis.Redis) -> None:
    # What an older version's two-command create left when its second command never ran.
    keys = Keys(NS)
    redis_client.hset(keys.job(JOB), "created_at_ms", 1)
    jobs = JobStore(redis_client, keys)
    assert jobs.create(JOB, job_spec()) is True
    assert jobs.state(JOB) is JobState.INGESTING


@pytest.mark.parametrize(
    ("operation", "sources", "target"),
    [
        ("cancel", (JobState.INGESTING,), JobState.CANCELLED),
        ("fail", (JobState.INGESTING,), JobState.FAILED),
        ("restart_ingest", (JobState.RUNNING,), JobState.INGESTING),
        ("finish_ingest", (JobState.INGESTING,), JobState.RUNNING),
    ],
)
def test_a_transition_whose_reply_is_lost_answers_as_the_first_time(
    proxy: ReplyDropper,
    resending: redis.Redis,
    redis_client: redis.Redis,
    operation: str,
    sources: tuple[JobState, ...],
    target: JobState,
) -> None:
    jobs = JobStore(resending, Keys(NS))
    assert jobs.create(JOB, job_spec())
    for script in ("transition", "finish_ingest"):
        redis_client.script_load(source(script))  # the first EVALSHA is then the transition itself
    if sources[0] is JobState.RUNNING:
        redis_client.hset(Keys(NS).job(JOB), "state", JobState.RUNNING.value)
    # Each is one EVALSHA (finish_ingest's moves the job and applies the completion rule at once).
    proxy.drop_reply(b"EVALSHA")
    answer = {
        "cancel": lambda: jobs.cancel(JOB),
        "fail": lambda: jobs.fail(JOB, "broken"),
        "restart_ingest": lambda: jobs.restart_ingest(JOB),
        "finish_ingest": lambda: jobs.finish_ingest(JOB),
    }[operation]()
    assert proxy.dropped == 1
    assert answer in (True, None)  # moved (None: the operation answers nothing)
    state = JobStore(redis_client, Keys(NS)).state(JOB)
    # A job with nothing accepted completes as ingestion finishes.
    assert state is (JobState.COMPLETED if target is JobState.RUNNING else target)


def _ingestor(client: redis.Redis, tmp_path: Path) -> tuple[Ingestor, str]:
    keys = Keys(NS)
    storage = Storage(str(tmp_path / "data"))
    jobs = JobStore(client, keys)
    rows = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"question {i}"}]} for i in range(ROWS)]
    name = storage.write_input(JOB, ["".join(json.dumps(r) + "\n" for r in rows).encode()])
    options = IngestOptions(chunk=100, enqueue=ENQUEUE, first_chunk=100)
    return Ingestor(client, keys, jobs, storage, options), name


@pytest.mark.parametrize("lost", [1, 2, 3])
def test_an_ingestion_chunk_whose_reply_is_lost_is_applied_once(
    proxy: ReplyDropper, proxied: redis.Redis, redis_client: redis.Redis, tmp_path: Path, lost: int
) -> None:
    JobStore(redis_client, Keys(NS)).create(JOB, job_spec())
    ingestor, name = _ingestor(proxied, tmp_path)
    # Each chunk lands in one script: lose the reply of the first ``lost`` of its calls (the first
    # chunk's, sent again on a new connection, which finds it landed; or, should the client give
    # up, the run resumes after its checkpoint).
    landing = redis_client.script_load(source("ingest_land"))
    proxy.drop_reply(landing.encode(), times=lost)
    ingestor.run(JOB, name, threading.Event())
    assert proxy.dropped == lost
    progress = JobStore(redis_client, Keys(NS)).progress(JOB)
    # 300 rows, hand-counted: three chunks of 100.
    assert (progress.rows, progress.accepted, progress.skipped) == (300, 300, 0)
    backlog = redis_client.lrange(Keys(NS).job_backlog(JOB, PromptClass.SHORT), 0, -1)
    assert len(backlog) == len(set(backlog)) == 300


def test_a_submit_whose_create_lost_its_reply_can_be_sent_again(
    proxy: ReplyDropper, redis_client: redis.Redis, tmp_path: Path
) -> None:
    # The coordinator talks to Redis through the proxy; the create's reply is lost once.
    settings = CoordinatorSettings(redis_url=proxy.url, storage=str(tmp_path / "data"), namespace=NS)
    redis_client.script_load(source("create"))
    body = "".join(
        json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": f"q{i}"}]}) + "\n"
        for i in range(10)
    ).encode()

    def submit(client: TestClient) -> Any:
        return client.post(
            "/jobs",
            data={"spec": json.dumps(make_spec()), "job_id": JOB},
            files={"dataset": ("d.jsonl", body, "application/jsonl")},
        )

    with TestClient(create_app(settings)) as client:
        proxy.drop_reply(b"tokenizer_identity")  # only the create's arguments name this field
        first = submit(client)
        assert proxy.dropped == 1
        assert first.status_code == 503, first.text
        assert "Redis" in first.json()["error"]
        # What the issue saw: every later submit of the id answered 409. Now it is simply sent again.
        again = submit(client)
        assert again.status_code == 202, again.text
        job = wait_ingested(client, JOB)
        assert (job["rows"], job["total"]) == (10, 10)
        manifest = Storage(settings.storage).read_manifest(JOB)
        assert manifest is not None
        assert manifest["incarnation"] == redis_client.hget(Keys(NS).job(JOB), "incarnation").decode()
