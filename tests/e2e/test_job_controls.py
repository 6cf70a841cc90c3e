"""Operator controls end to end over real processes: cancel, pause one job, retry, delete,
priorities and weighted fair share, against the simulator."""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from datagen.prompts.tokenization import bundled_tokenizer_path, default_chat_template_path, get_renderer
from simulator.model import SpecialIds, expected_output
from tests.support.e2e import (
    FAST_STACK_ENV,
    MAX_NEW,
    SEED,
    get_job,
    job_records,
    start_worker,
    submit_job,
    submit_job_result,
)
from tests.support.processes import ProcessStack, coordinator_stack
from tests.support.wait import wait_until

pytestmark = pytest.mark.e2e

NS = "ctl"


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[ProcessStack]:
    env = {**FAST_STACK_ENV, "COLUMNS": "200"}  # `datagen status` tables unwrapped
    with coordinator_stack(tmp_path, NS, env) as stack:
        yield stack


def _sim(stack: ProcessStack, name: str, *options: str) -> str:
    return stack.spawn_sim(name, *options)


def _ingested(stack: Any, job_id: str) -> bool:
    return get_job(stack, job_id)["state"] != "ingesting"


def _cli_ok(stack: Any, *args: str) -> str:
    result: subprocess.CompletedProcess[str] = stack.cli(*args)
    assert result.returncode == 0, result.stdout + result.stderr
    # Messages go to stderr, tables to stdout; rich wraps lines at the terminal width.
    return " ".join((result.stdout + result.stderr).split())


# Cancel -------------------------------------------------------------------------------------------
def test_cancel_with_work_in_flight_keeps_records_and_dispatches_nothing_more(stack: Any) -> None:
    sim = _sim(stack, "sim", "--time-scale", "0.02")
    start_worker(stack, "worker", f"sim={sim}")
    job_id = submit_job(stack, "big", 300)
    wait_until(
        lambda: (j := get_job(stack, job_id))["done"] >= 5 and j["in_flight"] >= 4,
        60,
        "work in flight",
        on_timeout=stack.logs,
    )

    out = _cli_ok(stack, "cancel", job_id)
    dropped = int(re.search(r"(\d+) queued prompts dropped", out).group(1))  # type: ignore[union-attr]
    assert dropped > 0, out
    wait_until(
        lambda: get_job(stack, job_id)["in_flight"] == 0,
        30,
        "in-flight prompts to finish",
        on_timeout=stack.logs,
    )
    time.sleep(1.0)  # their commits
    job = get_job(stack, job_id)
    assert job["state"] == "cancelled"
    assert job["done"] + job["cancelled"] + job["failed"] == job["total"] == 300
    assert job["cancelled"] == dropped
    done = job["done"]
    records = job_records(stack, job_id)
    assert len(records) == len({r["sample_id"] for r in records}) == done  # in-flight ones were kept
    time.sleep(2.0)
    assert get_job(stack, job_id)["done"] == done  # nothing more was dispatched
    queues = httpx.get(f"{stack.coordinator}/queues", timeout=5).json()["queues"]
    assert all(q["queued"] == 0 for q in queues)
    # Cancelling again is harmless; a cancelled job takes no more data.
    _cli_ok(stack, "cancel", job_id)
    result = submit_job_result(stack, job_id, 300)
    assert result.returncode != 0
    assert "was cancelled; submit under a new job id" in " ".join(result.stderr.split())


def test_cancel_abort_in_flight_aborts_the_requests_at_the_server(stack: Any) -> None:
    # Slow requests (seconds each), so that finishing them would take far longer than aborting.
    sim = _sim(stack, "slow", "--time-scale", "0.3", "--mean-reasoning-tokens", "3000")
    start_worker(stack, "worker", f"slow={sim}")
    job_id = submit_job(stack, "slow", 40, "--short-max-new-tokens", "4000")
    wait_until(
        lambda: get_job(stack, job_id)["in_flight"] >= 8, 60, "8 prompts in flight", on_timeout=stack.logs
    )
    assert get_job(stack, job_id)["done"] == 0

    started = time.monotonic()
    body = httpx.post(
        f"{stack.coordinator}/jobs/{job_id}/cancel", params={"abort_in_flight": "true"}, timeout=10
    )
    assert body.status_code == 200, body.text
    assert body.json()["dropped"] == 40 - body.json()["in_flight"] - body.json()["done"]
    wait_until(
        lambda: get_job(stack, job_id)["in_flight"] == 0,
        10,
        "in-flight prompts to be aborted",
        on_timeout=stack.logs,
    )
    assert time.monotonic() - started < 10
    job = get_job(stack, job_id)
    assert (job["state"], job["done"], job["cancelled"]) == ("cancelled", 0, 40)
    assert job_records(stack, job_id) == []

    def running() -> float:
        text = httpx.get(f"{sim}/metrics", timeout=5).text
        match = re.search(r"^sglang:num_running_reqs\{[^}]*\} (\S+)$", text, re.MULTILINE)
        return float(match.group(1)) if match else -1.0

    wait_until(lambda: running() == 0.0, 10, "the server to drop the aborted requests", on_timeout=stack.logs)


# Pause one job ------------------------------------------------------------------------------------
def test_pause_one_of_two_running_jobs(stack: Any) -> None:
    sim = _sim(stack, "sim", "--time-scale", "0.02")
    start_worker(stack, "worker", f"sim={sim}")
    first, second = submit_job(stack, "first", 80), submit_job(stack, "second", 80)
    wait_until(lambda: get_job(stack, first)["done"] >= 5, 60, "the first job to run", on_timeout=stack.logs)

    out = _cli_ok(stack, "pause", first)
    assert f"job {first}: paused" in out
    wait_until(
        lambda: get_job(stack, first)["in_flight"] == 0,
        20,
        "the paused job's in-flight prompts",
        on_timeout=stack.logs,
    )
    held = get_job(stack, first)
    assert held["paused"] and held["queued"] > 0 and held["share"]["target"] == 0.0
    second_before = get_job(stack, second)["done"]
    time.sleep(3.0)
    assert get_job(stack, first)["done"] == held["done"]  # nothing of the paused job ran
    assert get_job(stack, second)["done"] > second_before  # the other job kept running

    _cli_ok(stack, "resume", "--job", first)
    wait_until(
        lambda: get_job(stack, first)["state"] == "completed",
        90,
        "the resumed job to complete",
        on_timeout=stack.logs,
    )
    assert len({r["sample_id"] for r in job_records(stack, first)}) == 80
    # A finished job cannot be paused: a 409 with what is wrong.
    response = httpx.post(f"{stack.coordinator}/jobs/{first}/pause", timeout=5)
    assert response.status_code == 409 and "completed" in response.json()["error"]


# Retry --------------------------------------------------------------------------------------------
def test_retry_after_planted_failures_gives_exact_records_once(stack: Any) -> None:
    flaky = _sim(stack, "flaky", "--time-scale", "0", "--fail-500-rate", "0.35")
    job_id = submit_job(stack, "retry", 60, "--context-len", "32768")  # no worker runs yet
    worker = start_worker(stack, "w1", f"flaky={flaky}", "--burst", env={"DATAGEN_MAX_ATTEMPTS": "1"})
    assert worker.wait(timeout=120) == 0, stack.logs()
    del stack.procs["w1"]  # exited as it should
    job = get_job(stack, job_id)
    assert job["state"] == "completed" and 5 <= job["failed"] <= 40, job
    failed = job["failed"]
    reasons = httpx.get(
        f"{stack.coordinator}/jobs/{job_id}/errors", params={"kind": "failed"}, timeout=5
    ).json()
    assert {e["reason"] for e in reasons["errors"]} == {"gave_up_ServerError"}

    nothing = json.loads(
        httpx.post(
            f"{stack.coordinator}/jobs/{job_id}/retry", params={"reason": "WorkerLost"}, timeout=10
        ).text
    )
    assert nothing["retried_now"] == 0 and nothing["failed_by_reason"] == {"gave_up_ServerError": failed}
    out = _cli_ok(stack, "retry", job_id, "--reason", "gave_up_ServerError")
    assert f"{failed} failed prompts re-enqueued" in out
    job = get_job(stack, job_id)
    assert (job["state"], job["failed"], job["retried"], job["queued"]) == ("running", 0, failed, failed)

    good = _sim(stack, "good", "--time-scale", "0")
    worker = start_worker(stack, "w2", f"good={good}", "--burst")
    assert worker.wait(timeout=120) == 0, stack.logs()
    job = get_job(stack, job_id)
    assert (job["state"], job["done"], job["failed"]) == ("completed", 60, 0)

    records = job_records(stack, job_id)
    assert len(records) == len({r["sample_id"] for r in records}) == 60  # none doubled
    assert sum(1 for r in records if r["server"] == "good") == failed
    renderer = get_renderer(bundled_tokenizer_path(), str(default_chat_template_path()), False, "{}")
    special = SpecialIds.from_tokenizer(renderer.tokenizer)
    for record in records:
        i = int(record["sample_id"].removeprefix("retry"))
        prompt_ids = renderer.render([{"role": "user", "content": f"retry question {i}"}], None)
        expected = expected_output(prompt_ids, max_new_tokens=MAX_NEW, seed=SEED, special=special)
        assert record["input_ids"] == prompt_ids + expected.output_ids, record["sample_id"]
        assert record["attempts"] == 1


# Delete -------------------------------------------------------------------------------------------
def test_delete_refuses_a_running_job_then_removes_keys_and_files(stack: Any) -> None:
    sim = _sim(stack, "sim", "--time-scale", "0.02")
    job_id = submit_job(stack, "gone", 20, "--context-len", "32768")  # no worker runs yet
    wait_until(lambda: _ingested(stack, job_id), 30, "ingestion", on_timeout=stack.logs)
    refused = stack.cli("delete", job_id)
    assert refused.returncode != 0 and "cancel it first" in " ".join(refused.stderr.split())
    worker = start_worker(stack, "worker", f"sim={sim}", "--burst")
    assert worker.wait(timeout=120) == 0, stack.logs()
    assert get_job(stack, job_id)["state"] == "completed"
    assert stack.storage.job_exists(job_id)

    out = _cli_ok(stack, "delete", job_id, "--files")
    assert "20 RQ jobs removed" in out
    assert httpx.get(f"{stack.coordinator}/jobs/{job_id}", timeout=5).status_code == 404
    assert not [k for k in stack.redis.scan_iter(match=f"*{job_id}*")]
    assert not stack.storage.job_exists(job_id)
    assert httpx.delete(f"{stack.coordinator}/jobs/{job_id}", timeout=5).status_code == 404


# Priorities and fair share ------------------------------------------------------------------------
def _ingest_paused(stack: Any, jobs: list[tuple[str, int, tuple[str, ...]]]) -> None:
    """Submit the jobs while the short queue is paused, so all are queued before any runs."""
    _cli_ok(stack, "pause", "short")
    for name, n, options in jobs:
        submit_job(stack, name, n, *options)
    for name, _, _ in jobs:
        wait_until(
            lambda name=name: _ingested(stack, name), 30, f"{name} to be ingested", on_timeout=stack.logs
        )


def test_weighted_fair_share_follows_the_weights(stack: Any) -> None:
    sim = _sim(stack, "sim", "--time-scale", "0.01")
    start_worker(stack, "worker", f"sim={sim}")
    _ingest_paused(stack, [("heavy", 150, ("--weight", "3")), ("light", 150, ())])
    heavy = get_job(stack, "heavy")
    assert (heavy["priority"], heavy["weight"], heavy["share"]["target"]) == ("normal", 3.0, 0.75)
    assert get_job(stack, "light")["share"]["target"] == 0.25
    _cli_ok(stack, "resume", "short")
    wait_until(lambda: get_job(stack, "heavy")["done"] >= 60, 60, "both jobs to run", on_timeout=stack.logs)

    # Shown in the API, the CLI and the metrics while both run.
    assert get_job(stack, "heavy")["share"]["recent"] > 0.5
    status = _cli_ok(stack, "status")
    assert re.search(r"heavy.*normal ×3.*\d+% / 75%", status), status
    metrics = httpx.get(f"{stack.coordinator}/metrics", timeout=5).text
    assert 'datagen_job_share_target{job="heavy"} 0.75' in metrics
    assert 'datagen_job_weight{job="light"} 1.0' in metrics

    wait_until(
        lambda: get_job(stack, "light")["state"] == "completed",
        120,
        "both jobs to complete",
        on_timeout=stack.logs,
    )
    # Over the stretch where both had prompts queued (until the heavy job's last start), the
    # heavy job got 3 of every 4 prompts.
    heavy_starts = sorted(r["started_at_ms"] for r in job_records(stack, "heavy"))
    light_starts = sorted(r["started_at_ms"] for r in job_records(stack, "light"))
    cutoff = heavy_starts[-1]
    light_before = sum(1 for t in light_starts if t <= cutoff)
    share = len(heavy_starts) / (len(heavy_starts) + light_before)
    assert abs(share - 0.75) <= 0.075, (len(heavy_starts), light_before)


def test_high_priority_goes_before_a_big_normal_job(stack: Any) -> None:
    sim = _sim(stack, "sim", "--time-scale", "0.01")
    start_worker(stack, "worker", f"sim={sim}")
    _ingest_paused(stack, [("bulk", 120, ()), ("urgent", 30, ("--priority", "high"))])
    assert get_job(stack, "urgent")["share"]["target"] == 1.0
    assert get_job(stack, "bulk")["share"]["target"] == 0.0
    _cli_ok(stack, "resume", "short")
    wait_until(
        lambda: get_job(stack, "bulk")["state"] == "completed",
        120,
        "both jobs to complete",
        on_timeout=stack.logs,
    )
    urgent_last = max(r["started_at_ms"] for r in job_records(stack, "urgent"))
    bulk_first = min(r["started_at_ms"] for r in job_records(stack, "bulk"))
    assert urgent_last <= bulk_first
