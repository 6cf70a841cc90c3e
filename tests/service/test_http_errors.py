"""The HTTP boundary: one error body, errors that keep their class across HTTP, job ids that are
checked before anything is read or made, and spec or row content that never answers 5xx."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient

from datagen.control.jobs import JobStore
from datagen.control.keys import Keys
from datagen.errors import (
    BackendUnavailableError,
    InvalidRequestError,
    InvalidSpecError,
    JobStateError,
    NotFoundError,
    RetryableError,
    UnknownQueueError,
    UnknownServerError,
    UploadTooLargeError,
)
from datagen.prompts.tokenization import bundled_tokenizer_path, default_chat_template_path
from datagen.records.storage import Storage
from datagen.settings import CoordinatorSettings
from datagen_cli.client import CoordinatorClient
from datagen_cli.local.redis_server import LocalRedis
from service.app import create_app
from tests.support.ingest import INGEST_TIMEOUT_S, wait_ingested
from tests.support.processes import serve_coordinator
from tests.support.specs import make_spec
from tests.support.wait import wait_until

NS = "h"
HUGE_INT = "1" + "0" * 5000
GOOD_ROW = json.dumps({"messages": [{"role": "user", "content": "Hi"}]})


def _nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(depth):
        value = {"a": value}
    return value


@pytest.fixture
def settings(redis_url: str, tmp_path: Path) -> CoordinatorSettings:
    return CoordinatorSettings(redis_url=redis_url, storage=str(tmp_path / "store"), namespace=NS)


def _post(
    client: TestClient, body: bytes, spec: str | None = None, job_id: str | None = None, path: str = "/jobs"
) -> Any:
    data = {"spec": spec if spec is not None else json.dumps(make_spec())}
    if job_id is not None:
        data["job_id"] = job_id
    return client.post(path, data=data, files={"dataset": ("d.jsonl", body, "application/jsonl")})


def _assert_error_body(response: Any, status: int, error_type: str, fragment: str) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error", "type"}, body
    assert body["type"] == error_type and fragment in body["error"], body


# -- the schema and its viewers ------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/openapi.json", "/docs", "/redoc"])
def test_the_schema_and_docs_need_the_token_when_one_is_set(settings: CoordinatorSettings, path: str) -> None:
    with TestClient(create_app(settings.model_copy(update={"api_token": "s3cret"}))) as client:
        _assert_error_body(client.get(path), 401, "AuthError", "Authorization: Bearer")
        assert client.get(path).headers["www-authenticate"] == "Bearer"
        assert client.get(path, headers={"Authorization": "Bearer s3cret"}).status_code == 200
    with TestClient(create_app(settings)) as open_client:
        assert open_client.get(path).status_code == 200
    assert "/jobs/{job_id}" in open_client.app.openapi()["paths"]  # type: ignore[attr-defined]


# -- one error body --------------------------------------------------------------------------------


def test_validation_routing_and_size_errors_share_the_error_body(client: TestClient) -> None:
    response = client.post("/jobs", files={"dataset": ("d.jsonl", b"{}", "application/jsonl")})
    _assert_error_body(response, 422, "InvalidRequestError", "body.spec: Field required")
    response = client.get("/jobs/abc/errors", params={"kind": "bogus", "limit": 0})
    _assert_error_body(response, 422, "InvalidRequestError", "query.kind: Input should be 'rejected'")
    assert "query.limit" in response.json()["error"]
    _assert_error_body(client.get("/no/such/route"), 404, "NotFoundError", "no route /no/such/route")
    _assert_error_body(client.put("/jobs"), 405, "InvalidRequestError", "PUT is not allowed on /jobs")
    # Starlette caps a form field at 1 MiB while parsing, before any route code runs.
    _assert_error_body(_post(client, b"", spec="x" * (2 * 1024 * 1024)), 400, "FatalError", "maximum size")


def test_fleet_errors_have_their_own_classes(client: TestClient) -> None:
    _assert_error_body(client.post("/queues/huge/pause"), 404, "UnknownQueueError", "'short' and 'long'")
    _assert_error_body(client.get("/servers/nope"), 404, "UnknownServerError", "no worker has reported")
    _assert_error_body(client.post("/queues/short/explode"), 404, "NotFoundError", "use pause or resume")


def test_redis_down_is_a_503_that_says_so(settings: CoordinatorSettings) -> None:
    with LocalRedis() as own:
        own_settings = settings.model_copy(update={"redis_url": own.url})
        with TestClient(create_app(own_settings)) as client:
            assert client.get("/jobs").status_code == 200
            own.stop()
            response = client.get("/jobs/abc")
    _assert_error_body(response, 503, "BackendUnavailableError", "Redis is unavailable; retry shortly")


# -- job ids ---------------------------------------------------------------------------------------


def test_an_id_with_a_trailing_newline_creates_nothing(
    client: TestClient, settings: CoordinatorSettings
) -> None:
    response = _post(client, (GOOD_ROW + "\n").encode(), job_id="pid\n")
    _assert_error_body(response, 400, "InvalidSpecError", "invalid job id 'pid\\n'")
    assert client.get("/jobs").json()["jobs"] == []
    assert not (Path(settings.storage) / "jobs").exists() or not any(
        (Path(settings.storage) / "jobs").iterdir()
    )
    _assert_error_body(client.get("/jobs/pid%0A"), 400, "InvalidSpecError", "letters, digits or underscores")


JOB_ROUTES = [
    ("GET", "/jobs/{id}"),
    ("GET", "/jobs/{id}/errors"),
    ("GET", "/jobs/{id}/errors?kind=failed"),
    ("POST", "/jobs/{id}/cancel"),
    ("POST", "/jobs/{id}/pause"),
    ("POST", "/jobs/{id}/resume"),
    ("POST", "/jobs/{id}/retry"),
    ("DELETE", "/jobs/{id}"),
]


@pytest.mark.parametrize(("method", "route"), JOB_ROUTES)
def test_an_id_that_would_alias_another_key_is_refused_on_every_route(
    client: TestClient, redis_client: redis.Redis, method: str, route: str
) -> None:
    job_id = _post(client, (GOOD_ROW + "\n").encode(), job_id="basejob1").json()["id"]
    wait_ingested(client, job_id)
    keys_before = sorted(redis_client.keys("*"))
    for alias in ("basejob1:enqueued", "basejob1-x", "basejob1%0A"):
        response = client.request(method, route.format(id=alias))
        _assert_error_body(response, 400, "InvalidSpecError", "invalid job id")
    assert sorted(redis_client.keys("*")) == keys_before
    assert Keys(NS).job("basejob1").encode() in keys_before


# -- spec content ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        (
            json.dumps(make_spec(tokenizer="/models/x\x00")),
            "tokenizer: Value error, must not contain a NUL byte",
        ),
        (
            json.dumps(make_spec(chat_template="t\x00.jinja")),
            "chat_template: Value error, must not contain a NUL",
        ),
        ("[" * 100_000, "nested too deeply"),
        (json.dumps(make_spec(chat_template_kwargs=_nested(500))), "nested more than 16 levels deep"),
        (json.dumps(make_spec())[:-1] + f', "vocab_size": {HUGE_INT}}}', "over 4,300 digits"),
        (
            json.dumps(make_spec(short_max_new_tokens="100")),
            "short_max_new_tokens: Input should be a valid integer",
        ),
        (
            json.dumps(make_spec(trust_remote_code="true")),
            "trust_remote_code: Input should be a valid boolean",
        ),
        (json.dumps(make_spec(samples=True)), "samples: Input should be a valid integer"),
        (
            json.dumps(make_spec(sampling={"top_k": 2**70})),
            "sampling.top_k: Input should be less than or equal",
        ),
    ],
)
@pytest.mark.parametrize("path", ["/jobs", "/jobs/dry-run"])
def test_specs_that_used_to_answer_500_or_be_coerced_get_a_400(
    client: TestClient, spec: str, fragment: str, path: str
) -> None:
    response = _post(client, (GOOD_ROW + "\n").encode(), spec=spec, path=path)
    _assert_error_body(response, 400, "InvalidSpecError", fragment)
    assert client.get("/jobs").json()["jobs"] == []


# -- row content -----------------------------------------------------------------------------------


def test_one_row_with_a_huge_integer_is_rejected_and_the_rest_ingests(client: TestClient) -> None:
    body = "\n".join(
        [GOOD_ROW, json.dumps({"prompt": "x"})[:-1] + f', "n": {HUGE_INT}}}', json.dumps({"prompt": "ok"})]
    ).encode()
    preview = _post(client, body, path="/jobs/dry-run")
    assert preview.status_code == 200, preview.text
    assert [r["line"] for r in preview.json()["rejected"]] == [2]
    job_id = _post(client, body).json()["id"]
    job = wait_ingested(client, job_id)
    assert (job["state"], job["total"], job["rejected"]) == ("running", 2, 1)
    [error] = client.get(f"/jobs/{job_id}/errors", params={"kind": "rejected"}).json()["errors"]
    assert error["line"] == 2 and "more than 4,300 digits" in error["reason"]


def test_a_lone_surrogate_is_rejected_with_what_to_do(client: TestClient) -> None:
    body = b'{"prompt": "broken \\ud83d emoji"}\n' + GOOD_ROW.encode() + b"\n"
    job = wait_ingested(client, _post(client, body).json()["id"])
    assert (job["total"], job["rejected"]) == (1, 1)
    [error] = client.get(f"/jobs/{job['id']}/errors").json()["errors"]
    assert error["line"] == 1
    assert (
        "prompt holds a lone surrogate" in error["reason"]
        and "re-encode the file as UTF-8" in error["reason"]
    )


def test_flagged_rows_can_be_listed(client: TestClient) -> None:
    job = wait_ingested(client, _post(client, (GOOD_ROW + "\n").encode()).json()["id"])
    response = client.get(f"/jobs/{job['id']}/errors", params={"kind": "flagged"})
    assert response.status_code == 200, response.text
    assert response.json() == {"kind": "flagged", "errors": []}
    _assert_error_body(client.get("/jobs/nope/errors?kind=flagged"), 404, "JobNotFoundError", "nope")


def test_stopped_conversations_of_the_current_incarnation_can_be_listed(
    client: TestClient, settings: CoordinatorSettings, redis_client: redis.Redis
) -> None:
    job = wait_ingested(client, _post(client, (GOOD_ROW + "\n").encode()).json()["id"])
    storage = Storage(settings.storage)
    incarnation = JobStore(redis_client, Keys(NS)).incarnation(job["id"])
    now = {"sample_id": "a", "gen": 0, "turn": 1, "turns": 2, "reason": "tool_mismatch", "inc": incarnation}
    storage.write_stopped(job["id"], "a", 0, {**now, "message": "the model called ['f'], the dataset ['g']"})
    storage.write_stopped(job["id"], "b", 0, {**now, "sample_id": "b", "reason": "error", "inc": "older"})
    response = client.get(f"/jobs/{job['id']}/errors", params={"kind": "stopped"})
    assert response.status_code == 200, response.text
    [stop] = response.json()["errors"]
    assert (stop["sample_id"], stop["reason"], stop["turn"]) == ("a", "tool_mismatch", 1)
    _assert_error_body(client.get("/jobs/nope/errors?kind=stopped"), 404, "JobNotFoundError", "nope")


# -- the client keeps the class --------------------------------------------------------------------


@pytest.fixture
def served(settings: CoordinatorSettings) -> Iterator[str]:
    with serve_coordinator(settings.model_copy(update={"max_upload_bytes": 4096})) as url:
        yield url


def _dataset(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text(text)
    return path


def test_the_client_raises_the_class_the_coordinator_raised(served: str, tmp_path: Path) -> None:
    with CoordinatorClient(served) as api:
        with pytest.raises(InvalidSpecError, match="short_max_new_tokens"):
            api.submit(_dataset(tmp_path, GOOD_ROW + "\n"), make_spec(short_max_new_tokens="1"))
        with pytest.raises(UploadTooLargeError, match="DATAGEN_MAX_UPLOAD_BYTES"):
            api.submit(_dataset(tmp_path, GOOD_ROW * 200), make_spec())
        with pytest.raises(UnknownServerError):
            api.set_server_paused("nope", True)
        with pytest.raises(UnknownQueueError):
            api.set_queue_paused("huge", True)
        with pytest.raises(InvalidRequestError, match=r"query\.limit"):
            api.errors("abc", "rejected", limit=0)
        job = api.submit(_dataset(tmp_path, "not json\n"), make_spec())
        wait_until(
            lambda: api.job(job["id"])["state"] != "ingesting", INGEST_TIMEOUT_S, "ingestion", interval_s=0.05
        )
        with pytest.raises(JobStateError, match="nothing to cancel"):  # 409, not an invalid spec
            api.cancel(job["id"])
        with pytest.raises(NotFoundError):
            api.job("nope")


def test_redis_down_comes_back_from_the_client_as_retryable(settings: CoordinatorSettings) -> None:
    with LocalRedis() as own, serve_coordinator(settings.model_copy(update={"redis_url": own.url})) as url:
        own.stop()
        with CoordinatorClient(url) as api, pytest.raises(BackendUnavailableError) as info:
            api.jobs()
    assert isinstance(info.value, RetryableError)


# -- datagen submit --------------------------------------------------------------------------------


def _datagen(*args: str, url: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DATAGEN_")}
    env.update({"DATAGEN_COORDINATOR_URL": url, "HF_HUB_OFFLINE": "1"})
    return subprocess.run(
        [sys.executable, "-m", "datagen_cli", *args], env=env, capture_output=True, text=True, timeout=120
    )


def test_submit_wait_of_a_file_whose_rows_are_all_rejected_fails(served: str, tmp_path: Path) -> None:
    dataset = _dataset(tmp_path, "not json\n[1]\n")
    template = str(default_chat_template_path())
    result = _datagen(
        "submit", str(dataset), "--tokenizer", bundled_tokenizer_path(), "--chat-template", template,
        "--context-len", "32768", "--wait", url=served,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    job_id = result.stdout.strip()
    assert (
        f"no prompt was accepted: all 2 rows were rejected; see why with curl {served}/jobs/{job_id}/errors"
        in (" ".join(result.stderr.split()))
    )


def test_submit_with_a_binary_spec_file_is_one_line(served: str, tmp_path: Path) -> None:
    spec = tmp_path / "spec.bin"
    spec.write_bytes(bytes(range(256)))
    result = _datagen("submit", str(_dataset(tmp_path, GOOD_ROW + "\n")), "--spec", str(spec), url=served)
    assert result.returncode == 3
    assert "Traceback" not in result.stderr
    message = " ".join(result.stderr.split())  # rich wraps long lines at the terminal's width
    assert message.startswith("error: job spec") and message.endswith(
        "is not UTF-8 text (byte 128); give a YAML or JSON spec file"
    )


def test_a_submit_to_a_job_still_ingesting_is_a_conflict(settings: CoordinatorSettings) -> None:
    # A bounded queue keeps the first upload's ingestion waiting, so the second submit meets it.
    bounded = settings.model_copy(update={"max_queued_per_class": 2, "enqueue_chunk": 1})
    rows = "".join(json.dumps({"id": f"r{i}", "prompt": f"q{i}"}) + "\n" for i in range(10)).encode()
    with TestClient(create_app(bounded)) as client:
        assert _post(client, rows, job_id="busy").status_code == 202
        response = _post(client, rows, job_id="busy")
        client.post("/jobs/busy/cancel")  # lets the waiting ingestion end with the test
    _assert_error_body(response, 409, "JobStateError", "still ingesting")
