"""Helpers for tests over a ``coordinator_stack`` (tests/e2e and tests/faults): named jobs of numbered
prompts, workers that have taken their server, and a job's state and records as the stack holds them."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import httpx

from tests.support.processes import ProcessStack

# Every named job's limit per prompt, and its seed: the simulator's outputs can be checked exactly.
MAX_NEW = 400
SEED = 11
WORKER_UP_TIMEOUT_S = 30.0
# Short intervals for the processes of a job-controls stack, so that heartbeats, reaping, polling
# and retries take fractions of a second.
FAST_STACK_ENV = {
    "DATAGEN_HEARTBEAT_INTERVAL_S": "0.5",
    "DATAGEN_REAPER_INTERVAL_S": "1",
    "DATAGEN_POLL_INTERVAL_S": "0.05",
    "DATAGEN_RETRY_BASE_S": "0.05",
    "DATAGEN_RETRY_MAX_S": "0.1",
}
HTTP_TIMEOUT_S = 5.0


def start_worker(
    stack: ProcessStack, name: str, server: str, *options: str, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """A worker for ``server`` (``NAME=URL``) with ``env`` on top of the stack's; unless it runs in
    burst mode, once it has taken its server (the pre-flight checks at submit learn the context
    length from it)."""
    saved = dict(stack.env)
    stack.env.update(env or {})
    try:
        proc = stack.spawn(name, "worker", "--server", server, "--short-concurrency", "8", *options)
    finally:
        stack.env = saved
    if "--burst" not in options:
        stack.wait_server_up(stack.coordinator, server.split("=", 1)[0], WORKER_UP_TIMEOUT_S)
    return proc


def submit_job(stack: ProcessStack, name: str, n: int, *options: str) -> str:
    """Job ``name`` of ``n`` prompts ``"{name} question {i}"`` (ids ``{name}{i}``), submitted."""
    result = submit_job_result(stack, name, n, *options)
    assert result.returncode == 0, result.stderr + stack.logs()
    assert result.stdout.strip() == name
    return name


def submit_job_result(
    stack: ProcessStack, name: str, n: int, *options: str
) -> subprocess.CompletedProcess[str]:
    """``datagen submit`` of job ``name``, as `submit_job` builds it, whatever its outcome."""
    dataset = stack.tmp / f"{name}.jsonl"
    rows = [
        {"id": f"{name}{i}", "messages": [{"role": "user", "content": f"{name} question {i}"}]}
        for i in range(n)
    ]
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return stack.submit(
        dataset, "--short-max-new-tokens", str(MAX_NEW), "--seed", str(SEED), "--job-id", name, *options
    )


def get_job(stack: ProcessStack, job_id: str) -> dict[str, Any]:
    """``GET /jobs/{job_id}``."""
    job: dict[str, Any] = httpx.get(f"{stack.coordinator}/jobs/{job_id}", timeout=HTTP_TIMEOUT_S).json()
    return job


def job_records(stack: ProcessStack, job_id: str) -> list[dict[str, Any]]:
    """Every record the job has committed to storage."""
    return [r for batch in stack.storage.iter_record_batches(job_id) for r in batch.to_pylist()]
