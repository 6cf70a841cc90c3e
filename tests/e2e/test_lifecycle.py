"""Worker lifecycle over real processes: SIGTERM drains, kill -9 is reaped, the CLI pauses."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from rq import Queue
from rq.registry import FailedJobRegistry, StartedJobRegistry

from datagen.prompts.tokenization import bundled_tokenizer_path, default_chat_template_path
from tests.support.e2e import get_job, job_records
from tests.support.processes import ProcessStack, coordinator_stack
from tests.support.wait import wait_until
from workers.claim.rqbridge import heartbeat_ttl_s

pytestmark = pytest.mark.e2e

NS = "life"
HEARTBEAT_S = 0.5
REAPER_S = 1.0
# A dead worker's prompts are due back once their heartbeat TTL (three intervals plus a fixed 10 s
# grace) has lapsed and a live worker's reaper runs; from then on, one reaper pass (two intervals at
# most) hands them back, plus 5 s for a loaded machine. The rescuer's own start-up is not counted:
# it is slow on a loaded 2-core machine and says nothing about reaping.
HEARTBEAT_TTL_S = heartbeat_ttl_s(HEARTBEAT_S)
REAP_AFTER_DUE_BUDGET_S = 2 * REAPER_S + 5
# Long enough for every poll of a waiting worker to have found the paused queue (the submit's wake-up
# reaches it at once, and it polls every few hundred ms).
PAUSED_WATCH_S = 2.0


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[ProcessStack]:
    env = {"DATAGEN_HEARTBEAT_INTERVAL_S": str(HEARTBEAT_S), "DATAGEN_REAPER_INTERVAL_S": str(REAPER_S)}
    with coordinator_stack(tmp_path, NS, env) as stack:
        # About 0.2-2 s per request: slow enough to catch prompts in flight.
        stack.sim_url = stack.spawn_sim("sim", "--time-scale", "0.02")  # type: ignore[attr-defined]
        yield stack


def _submit(stack: Any, n: int) -> str:
    dataset = stack.tmp / "d.jsonl"
    rows = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"question {i}"}]} for i in range(n)]
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # Submitted before any worker runs, so the context length is given.
    result = stack.submit(dataset, "--short-max-new-tokens", "600", "--context-len", "32768", "--seed", "5")
    assert result.returncode == 0, result.stderr
    return str(result.stdout.strip())


def _started(stack: Any) -> int:
    return StartedJobRegistry(queue=Queue(f"{NS}-short", connection=stack.redis)).get_job_count(cleanup=False)


def _live_workers(stack: Any) -> set[str]:
    """The workers that report server ``sim`` now (none, a 404, before the first has started)."""
    answer = httpx.get(f"{stack.coordinator}/servers/sim", timeout=5)
    if answer.status_code == 404:
        return set()
    answer.raise_for_status()
    return {w["worker"] for w in answer.json()["workers"] if not w["stale"]}


def _worker(stack: Any, name: str) -> subprocess.Popen[bytes]:
    return stack.spawn(name, "worker", "--server", f"sim={stack.sim_url}", "--short-concurrency", "16")  # type: ignore[no-any-return]


def test_kill_9_is_reaped_within_a_minute_and_nothing_is_lost(stack: Any) -> None:
    job_id = _submit(stack, 120)
    victim = _worker(stack, "victim")
    wait_until(
        lambda: get_job(stack, job_id)["done"] >= 10 and _started(stack) >= 8,
        60,
        "the victim to be busy",
        on_timeout=stack.logs,
    )
    registry_key = StartedJobRegistry(queue=Queue(f"{NS}-short", connection=stack.redis)).key
    orphans = stack.redis.zrange(registry_key, 0, -1)
    victims = _live_workers(stack)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    killed_at = time.monotonic()
    assert orphans
    _worker(stack, "rescuer")
    wait_until(lambda: _live_workers(stack) - victims, 60, "the rescuer to start", on_timeout=stack.logs)
    rescuer_ready_at = time.monotonic()
    # The rescuer's reaper hands the orphans back once their heartbeat TTL has lapsed.
    wait_until(
        lambda: all(stack.redis.zscore(registry_key, m) is None for m in orphans),
        HEARTBEAT_TTL_S + 60,
        "the orphans to be reaped",
        on_timeout=stack.logs,
    )
    due_at = max(killed_at + HEARTBEAT_TTL_S, rescuer_ready_at)
    reaped_after_due_s = time.monotonic() - due_at
    assert reaped_after_due_s <= REAP_AFTER_DUE_BUDGET_S, (
        f"reaped {reaped_after_due_s:.1f} s after the orphans were due back (TTL {HEARTBEAT_TTL_S} s after "
        f"the kill, rescuer up {rescuer_ready_at - killed_at:.1f} s after it)"
    )
    wait_until(
        lambda: get_job(stack, job_id)["state"] == "completed",
        120,
        "the job to complete",
        on_timeout=stack.logs,
    )
    job = get_job(stack, job_id)
    assert (job["done"], job["failed"], job["in_flight"]) == (120, 0, 0)
    records = job_records(stack, job_id)
    assert {r["sample_id"] for r in records} == {f"r{i}" for i in range(120)}
    assert max(r["attempts"] for r in records) == 1  # a dead worker costs no attempt
    assert (
        FailedJobRegistry(queue=Queue(f"{NS}-short", connection=stack.redis)).get_job_count(cleanup=False)
        == 0
    )
    log = (stack.tmp / "rescuer.log").read_text()
    assert "reaper:" in log and "requeued" in log


def test_sigterm_finishes_in_flight_prompts_commits_and_deregisters(stack: Any) -> None:
    job_id = _submit(stack, 80)
    worker = _worker(stack, "w")
    wait_until(lambda: _started(stack) >= 8, 60, "prompts in flight", on_timeout=stack.logs)
    done_before = get_job(stack, job_id)["done"]
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=60) == 0
    job = get_job(stack, job_id)
    assert _started(stack) == 0  # every claimed prompt finished (or was handed back)
    assert job["done"] > done_before and job["failed"] == 0
    records = job_records(stack, job_id)
    assert len(records) == job["done"]  # acknowledged work is committed work
    queues = {q["name"]: q for q in httpx.get(f"{stack.coordinator}/queues", timeout=5).json()["queues"]}
    assert queues["short"]["queued"] == 80 - job["done"]  # the rest still queued (backlog or handed back)
    assert httpx.get(f"{stack.coordinator}/servers/sim", timeout=5).json()["workers"] == []


def test_cli_pause_resume_and_status(stack: Any) -> None:
    assert stack.cli("pause", "short").returncode == 0
    queues = httpx.get(f"{stack.coordinator}/queues", timeout=5).json()["queues"]
    assert [q["paused"] for q in queues] == [True, False]
    job_id = _submit(stack, 10)
    _worker(stack, "w")
    wait_until(lambda: _live_workers(stack), 60, "the worker to start", on_timeout=stack.logs)
    time.sleep(PAUSED_WATCH_S)
    job = get_job(stack, job_id)
    assert (job["done"], job["in_flight"]) == (0, 0)  # paused: nothing dispatched
    status = stack.cli("status")
    assert status.returncode == 0 and "queues" in status.stdout and "sim" in status.stdout
    assert stack.cli("resume", "short").returncode == 0
    wait_until(
        lambda: get_job(stack, job_id)["state"] == "completed",
        120,
        "the job after resume",
        on_timeout=stack.logs,
    )
    bad = stack.cli("pause", "--server", "nope")
    assert bad.returncode != 0 and "no worker has reported a server named 'nope'" in bad.stderr


def test_cli_dry_run_shows_decoded_prompts_and_enqueues_nothing(stack: Any) -> None:
    dataset = stack.tmp / "dry.jsonl"
    dataset.write_text(json.dumps({"id": "hi", "messages": [{"role": "user", "content": "Hi"}]}) + "\n")
    result = stack.submit(dataset, "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜><think>" in result.stdout
    assert "1 prompts, 1 short / 0 long, 0 rejected" in result.stdout
    assert httpx.get(f"{stack.coordinator}/jobs", timeout=5).json()["jobs"] == []


def test_cli_submit_with_a_spec_file(stack: Any) -> None:
    dataset = stack.tmp / "spec.jsonl"
    dataset.write_text(json.dumps({"id": "hi", "messages": [{"role": "user", "content": "Hi"}]}) + "\n")
    spec = stack.tmp / "job.yaml"
    spec.write_text(
        f"tokenizer: {bundled_tokenizer_path()}\nchat_template: {default_chat_template_path()}\n"
        "short_max_new_tokens: 64\nsamples: 2\n"
    )
    result = stack.cli("submit", str(dataset), "--spec", str(spec), "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "2 prompts, 2 short / 0 long" in result.stdout
    bad = stack.tmp / "bad.yaml"
    bad.write_text("tokenizer: x\nmax_tokens: 5\n")
    refused = stack.cli("submit", str(dataset), "--spec", str(bad))
    assert refused.returncode == 3 and "max_tokens" in refused.stderr
