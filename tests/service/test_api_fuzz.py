"""Schemathesis against the coordinator's OpenAPI schema, over real HTTP: no request gets a 5xx,
neither a generated one nor the hostile specs, ids and rows that once got one."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from datagen.prompts.tokenization import bundled_tokenizer_path
from datagen.settings import CoordinatorSettings
from tests.support.processes import serve_coordinator
from tests.support.specs import make_spec

EXAMPLES_PER_OPERATION = 25
HUGE_INT = "1" + "0" * 5000


@pytest.fixture
def coordinator_url(redis_url: str, tmp_path: Path) -> Iterator[str]:
    settings = CoordinatorSettings(redis_url=redis_url, storage=str(tmp_path), namespace="fuzz")
    with serve_coordinator(settings, log_level="warning") as url:
        yield url


@pytest.fixture
def api_schema(coordinator_url: str) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(f"{coordinator_url}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(
    max_examples=EXAMPLES_PER_OPERATION,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
def test_no_request_gets_a_server_error(case: schemathesis.Case) -> None:
    response = case.call(timeout=30)
    assert response.status_code < 500, (
        f"{case.method} {case.formatted_path}: {response.status_code} {response.text}"
    )


def _deep(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(depth):
        value = {"k": value}
    return value


GOOD_ROWS = b'{"prompt": "hi"}\n'
HOSTILE_SPECS = {
    "nul_in_tokenizer": json.dumps(make_spec(tokenizer=bundled_tokenizer_path() + "\x00")),
    "nul_in_chat_template": json.dumps(make_spec(chat_template="\x00")),
    "nested_100000": "[" * 100_000,
    "kwargs_500_deep": json.dumps(make_spec(chat_template_kwargs=_deep(500))),
    "int_5000_digits": json.dumps(make_spec())[:-1] + f', "vocab_size": {HUGE_INT}}}',
    "string_for_int": json.dumps(make_spec(short_max_new_tokens="100")),
    "top_k_2_70": json.dumps(make_spec(sampling={"top_k": 2**70})),
}
HOSTILE_ROWS = {
    "int_5000_digits": b'{"prompt": "x", "n": ' + HUGE_INT.encode() + b"}\n" + GOOD_ROWS,
    "lone_surrogate": b'{"prompt": "a \\ud800"}\n' + GOOD_ROWS,
    "deep_tools": json.dumps({"prompt": "x", "tools": "[" * 100_000}).encode() + b"\n" + GOOD_ROWS,
}
HOSTILE_IDS = ["pid\n", "basejob1:enqueued", "a-b", "x" * 65, "\x00", "é"]


@pytest.mark.parametrize("path", ["/jobs", "/jobs/dry-run"])
@pytest.mark.parametrize("name", list(HOSTILE_SPECS))
def test_hostile_specs_get_no_server_error(coordinator_url: str, path: str, name: str) -> None:
    files = {"dataset": ("d.jsonl", GOOD_ROWS, "application/jsonl")}
    response = httpx.post(coordinator_url + path, data={"spec": HOSTILE_SPECS[name]}, files=files, timeout=30)
    assert response.status_code == 400, response.text


@pytest.mark.parametrize("path", ["/jobs", "/jobs/dry-run"])
@pytest.mark.parametrize("name", list(HOSTILE_ROWS))
def test_hostile_rows_get_no_server_error(coordinator_url: str, path: str, name: str) -> None:
    files = {"dataset": ("d.jsonl", HOSTILE_ROWS[name], "application/jsonl")}
    response = httpx.post(
        coordinator_url + path, data={"spec": json.dumps(make_spec())}, files=files, timeout=30
    )
    assert response.status_code in (200, 202), response.text


@pytest.mark.parametrize("job_id", HOSTILE_IDS)
def test_hostile_job_ids_get_a_400_on_every_route(coordinator_url: str, job_id: str) -> None:
    with httpx.Client(base_url=coordinator_url, timeout=30) as http:
        files = {"dataset": ("d.jsonl", GOOD_ROWS, "application/jsonl")}
        submitted = http.post("/jobs", data={"spec": json.dumps(make_spec()), "job_id": job_id}, files=files)
        assert submitted.status_code == 400, submitted.text
        quoted = "/jobs/" + quote(job_id, safe="")
        for method, suffix in [("GET", ""), ("GET", "/errors"), ("POST", "/cancel"), ("DELETE", "")]:
            response = http.request(method, quoted + suffix)
            assert response.status_code == 400, (method, suffix, response.text)
        assert http.get("/jobs").json()["jobs"] == []
