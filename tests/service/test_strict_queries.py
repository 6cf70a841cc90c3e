"""Query parameters are read strictly (issue 36): a cursor or a number that is not written as the
API writes it answers 422 with the one JSON error body, never a 500 or a guess. Over real HTTP."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from datagen.settings import CoordinatorSettings
from tests.support.processes import serve_coordinator

NS = "sq"


@pytest.fixture
def http(redis_url: str, tmp_path: Path) -> Iterator[httpx.Client]:
    settings = CoordinatorSettings(redis_url=redis_url, storage=str(tmp_path), namespace=NS)
    with serve_coordinator(settings) as url, httpx.Client(base_url=url) as client:
        yield client


def _assert_422(response: httpx.Response, fragment: str) -> None:
    assert response.status_code == 422, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert body["type"] == "InvalidRequestError" and fragment in body["error"], body


@pytest.mark.parametrize(
    "cursor",
    [
        "²:x",  # the report: str.isdigit() accepts "²", int() refuses it
        "１２:j1",  # fullwidth digits, which int() would read as 12
        "1_000:j1",
        " 12:j1",
        "+12:j1",
        "12.0:j1",
        "12",
        "12:",
        ":j1",
        "12:a:b",  # a job id never holds ':'
        "12:a-b",
        "12:j1\n",
        "12345678901234567:j1",  # 17 digits: no creation time in ms is that long
        "12:" + "j" * 65,
    ],
)
def test_a_malformed_cursor_is_a_422_that_says_what_to_pass(http: httpx.Client, cursor: str) -> None:
    _assert_422(http.get("/jobs", params={"cursor": cursor}), "pass the `next` of the previous page")


@pytest.mark.parametrize(
    ("path", "name", "value", "fragment"),
    [
        ("/jobs", "limit", "²", "query.limit: Value error, write a whole number in ASCII digits"),
        ("/jobs", "limit", "１０", "query.limit: Value error, write a whole number in ASCII digits"),
        ("/jobs", "limit", "1_0", "query.limit: Value error, write a whole number in ASCII digits"),
        ("/jobs", "limit", " 10", "query.limit: Value error, write a whole number in ASCII digits"),
        ("/jobs", "limit", "10.0", "query.limit: Value error, write a whole number in ASCII digits"),
        ("/jobs", "limit", "0", "query.limit: Input should be greater than or equal to 1"),
        ("/jobs/j1", "wait_s", "²", "query.wait_s: Value error, write a number in ASCII digits"),
        ("/jobs/j1", "wait_s", "1_0", "query.wait_s: Value error, write a number in ASCII digits"),
        ("/jobs/j1", "wait_s", "nan", "query.wait_s: Value error, write a number in ASCII digits"),
        ("/jobs/j1", "wait_s", "-1", "query.wait_s: Value error, write a number in ASCII digits"),
        ("/jobs/j1", "wait_s", "31", "query.wait_s: Input should be less than or equal to 30"),
        ("/jobs/j1/errors", "limit", "１", "query.limit: Value error, write a whole number in ASCII digits"),
        ("/jobs/j1/errors", "limit", "1e3", "query.limit: Value error, write a whole number in ASCII digits"),
    ],
)
def test_a_number_not_written_in_ascii_digits_is_a_422_naming_the_parameter(
    http: httpx.Client, path: str, name: str, value: str, fragment: str
) -> None:
    _assert_422(http.get(path, params={name: value}), fragment)


@pytest.mark.parametrize(
    ("path", "params"),
    [
        ("/jobs", {"limit": "7"}),
        ("/jobs", {"limit": "7", "cursor": "1700000000000:j1"}),
        ("/jobs/j1", {"wait_s": "0.05"}),
        ("/jobs/j1", {"wait_s": "1e-05"}),  # what the Python client sends for 0.00001
        ("/jobs/j1", {"wait_s": ".01"}),
        ("/jobs/j1/errors", {"limit": "10"}),
    ],
)
def test_numbers_and_cursors_as_the_api_writes_them_are_read(
    http: httpx.Client, path: str, params: dict[str, str]
) -> None:
    response = http.get(path, params=params)
    # No job j1: the parameters were read, and the route answered.
    if path == "/jobs":
        assert response.status_code == 200, response.text
        assert json.loads(response.text) == {"jobs": [], "next": None, "count": 0}
    else:
        assert response.status_code == 404, response.text
        assert response.json() == {"error": "no job 'j1'", "type": "JobNotFoundError"}
