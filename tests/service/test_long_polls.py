"""Long polls (``GET /jobs/{id}?wait_s=``) are capped per job and in all, and share one watcher, so
they cannot starve ``/healthz`` (issue 36: 1,000 polls of one job held 1,048 file descriptors and
``/healthz`` took 8.2 s). Over real HTTP, with real jobs in a real Redis."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from datagen.settings import CoordinatorSettings
from service.app import create_app
from service.longpoll import MAX_LONG_POLLS, MAX_LONG_POLLS_PER_JOB, LongPolls
from tests.support.ingest import INGEST_TIMEOUT_S
from tests.support.processes import serve_coordinator
from tests.support.specs import make_spec
from tests.support.wait import wait_until

NS = "lp"
JOBS = MAX_LONG_POLLS // MAX_LONG_POLLS_PER_JOB  # jobs whose polls fill the overall cap
EXTRA = 4
WAIT_S = 5.0
# What /healthz and an answer beyond a cap may take meanwhile (it was 8.2 s): well under the polls'
# WAIT_S, so an answer that waited cannot pass, with room for a loaded CI machine (a capped answer
# took 1.07 s beside the two lanes of slow tests).
PROMPT_ANSWER_S = 2.0
SETTLE_TIMEOUT_S = 20.0


@pytest.fixture
def served(redis_url: str, tmp_path: Path) -> Iterator[tuple[str, FastAPI]]:
    settings = CoordinatorSettings(redis_url=redis_url, storage=str(tmp_path / "store"), namespace=NS)
    app = create_app(settings)
    with serve_coordinator(settings, app=app) as url:
        yield url, app


def _submit(url: str, job_id: str) -> None:
    rows = "".join(
        json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": f"q {i}"}]}) + "\n"
        for i in range(3)
    )
    with httpx.Client(base_url=url) as http:
        answer = http.post(
            "/jobs",
            data={"spec": json.dumps(make_spec()), "job_id": job_id},
            files={"dataset": ("d.jsonl", rows.encode(), "application/jsonl")},
        )
        assert answer.status_code == 202, answer.text
        wait_until(
            lambda: http.get(f"/jobs/{job_id}").json()["state"] == "running",
            INGEST_TIMEOUT_S,
            f"job {job_id} to run",
        )


async def _poll(http: httpx.AsyncClient, job_id: str, wait_s: float) -> tuple[float, httpx.Response]:
    """How long the poll took, and its answer."""
    started = time.monotonic()
    answer = await http.get(f"/jobs/{job_id}", params={"wait_s": wait_s})
    return time.monotonic() - started, answer


async def _poll_until(http: httpx.AsyncClient, job_id: str, wait_s: float) -> tuple[float, httpx.Response]:
    """When the poll was answered (monotonic), and its answer."""
    answer = await http.get(f"/jobs/{job_id}", params={"wait_s": wait_s})
    return time.monotonic(), answer


async def _timed(http: httpx.AsyncClient, path: str) -> float:
    started = time.monotonic()
    assert (await http.get(path)).status_code == 200
    return time.monotonic() - started


async def _until_waiting(polls: LongPolls, count: int) -> None:
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while polls.waiting < count:
        assert time.monotonic() < deadline, f"{polls.waiting} polls waiting, not {count}"
        await asyncio.sleep(0.05)


def _capped(answer: httpx.Response) -> bool:
    return answer.headers.get("x-long-poll") == "capped"


async def test_long_polls_beyond_the_caps_answer_at_once_and_healthz_stays_quick(
    served: tuple[str, FastAPI],
) -> None:
    url, app = served
    for n in range(JOBS + 1):
        _submit(url, f"j{n}")
    polls: LongPolls = app.state.long_polls
    limits = httpx.Limits(max_connections=MAX_LONG_POLLS + 4 * EXTRA, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=WAIT_S + 30) as http:
        # The overall cap filled: MAX_LONG_POLLS_PER_JOB polls on each of JOBS jobs.
        started = time.monotonic()
        waiting = [
            asyncio.create_task(_poll_until(http, f"j{n}", WAIT_S))
            for n in range(JOBS)
            for _ in range(MAX_LONG_POLLS_PER_JOB)
        ]
        await _until_waiting(polls, MAX_LONG_POLLS)

        # Beyond it, on a job at its own cap and on one with no poll yet: answered at once.
        extra = await asyncio.gather(
            *[_poll(http, "j0", WAIT_S) for _ in range(EXTRA)],
            *[_poll(http, f"j{JOBS}", WAIT_S) for _ in range(EXTRA)],
        )
        health_s = [await _timed(http, "/healthz") for _ in range(5)]
        plain_s = await _timed(http, f"/jobs/j{JOBS}")
        assert polls.waiting == MAX_LONG_POLLS
        for took_s, answer in extra:
            assert answer.status_code == 200 and answer.json()["state"] == "running", answer.text
            assert _capped(answer) and took_s < PROMPT_ANSWER_S, (took_s, answer.headers)
        assert max(health_s) < PROMPT_ANSWER_S and plain_s < PROMPT_ANSWER_S, (health_s, plain_s)

        # A job that ends wakes its polls at once (the shared watcher), the others wait on.
        cancelled_at = time.monotonic()
        assert (await http.post("/jobs/j1/cancel")).status_code == 200
        answers = await asyncio.gather(*waiting)
    for n in range(JOBS):
        for answered_at, answer in answers[n * MAX_LONG_POLLS_PER_JOB : (n + 1) * MAX_LONG_POLLS_PER_JOB]:
            assert answer.status_code == 200 and not _capped(answer), answer.headers
            if n == 1:
                assert answer.json()["state"] == "cancelled"
                assert cancelled_at <= answered_at < cancelled_at + PROMPT_ANSWER_S
            else:
                assert answer.json()["state"] == "running" and answered_at - started >= WAIT_S - 0.5
    assert polls.waiting == 0


async def test_one_job_holds_at_most_its_cap_of_waiting_polls(served: tuple[str, FastAPI]) -> None:
    url, app = served
    _submit(url, "one")
    polls: LongPolls = app.state.long_polls
    limits = httpx.Limits(max_connections=MAX_LONG_POLLS_PER_JOB + EXTRA, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=30) as http:
        waiting = [asyncio.create_task(_poll(http, "one", 2.0)) for _ in range(MAX_LONG_POLLS_PER_JOB)]
        await _until_waiting(polls, MAX_LONG_POLLS_PER_JOB)
        extra = await asyncio.gather(*[_poll(http, "one", 2.0) for _ in range(EXTRA)])
        assert all(_capped(answer) and took_s < PROMPT_ANSWER_S for took_s, answer in extra), extra
        answers: list[tuple[float, Any]] = await asyncio.gather(*waiting)
    assert not any(_capped(answer) for _, answer in answers)
    assert min(took_s for took_s, _ in answers) >= 1.5
    # An unknown job is still a 404 at once, whatever wait_s.
    async with httpx.AsyncClient(base_url=url) as http:
        took_s, answer = await _poll(http, "nosuchjob", 5.0)
    assert answer.status_code == 404 and took_s < PROMPT_ANSWER_S
