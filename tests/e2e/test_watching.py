"""Watching jobs from the CLI (issue 39, first day, second pass), over a coordinator stack, a worker
and a slow simulator, every command a real ``python -m datagen_cli`` process.

- ``datagen status`` at 80 and 100 columns shows every job's whole id and its state; ``--wide``
  every column; ``--json`` the coordinator's answers.
- ``datagen wait JOB`` attaches to a running job and to a completed one without resubmitting, with
  the exit code of ``submit --wait``.
- ``submit --wait`` and ``wait`` whose stderr is not a terminal (a pipe, as under nohup or CI) write
  the progress line every ``--progress-every-s``, not only at the end.
- ``pause`` and ``cancel`` take ``--coordinator`` over ``DATAGEN_COORDINATOR_URL``.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from datagen.prompts.tokenization import bundled_tokenizer_path, default_chat_template_path
from tests.support.e2e import FAST_STACK_ENV, get_job, start_worker
from tests.support.processes import ProcessStack, coordinator_stack
from tests.support.wait import wait_until

pytestmark = pytest.mark.e2e

NS = "watching"
PROMPTS = 24
MAX_NEW = "400"
# The simulator's seconds per simulated second: slow enough that a job runs for several seconds.
SLOW_TIME_SCALE = "0.25"
PROGRESS_EVERY_S = 1.0
# A waiter's poll ends when its next line is due; the answer may come late on a loaded machine.
GAP_SLACK_S = 2.0
# A job counted as running for at least this long gives each waiter several progress lines.
MIN_RUN_S = 4.0
DEAD_COORDINATOR = "http://127.0.0.1:9"
JOB_TIMEOUT_S = 180.0
EVERY_HEADER = (
    "job", "state", "priority", "share now/target", "total", "done", "failed", "rejected", "in flight",
    "tok/s", "ETA s", "1st record s", "tail s",
)  # fmt: skip


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[ProcessStack]:
    with coordinator_stack(tmp_path, NS, FAST_STACK_ENV) as stack:
        sim = stack.spawn_sim("sim", "--time-scale", SLOW_TIME_SCALE)
        start_worker(stack, "worker", f"sim={sim}")
        yield stack


def _command(*args: str) -> list[str]:
    return [sys.executable, "-m", "datagen_cli", *args]


def _submit_args(stack: ProcessStack, name: str, *options: str) -> list[str]:
    """``submit`` of a new job (the coordinator gives it a uuid) of PROMPTS prompts."""
    dataset = stack.tmp / f"{name}.jsonl"
    rows = [
        {"id": f"{name}{i}", "messages": [{"role": "user", "content": f"{name} {i}"}]} for i in range(PROMPTS)
    ]
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [
        "submit", str(dataset),
        "--tokenizer", bundled_tokenizer_path(), "--chat-template", str(default_chat_template_path()),
        "--short-max-new-tokens", MAX_NEW, "--seed", "3", *options,
    ]  # fmt: skip


class _Waiter:
    """A command whose stderr is a pipe (not a terminal); each line kept with when it came."""

    def __init__(self, stack: ProcessStack, *args: str) -> None:
        self.proc = subprocess.Popen(
            _command(*args), env=stack.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def finish(self) -> tuple[int, str]:
        """The exit code and stdout, once it exits. Not ``communicate()``: it would read stderr too,
        taking lines (the last progress line) from the reader thread."""
        assert self.proc.stdout is not None
        self.proc.wait(timeout=JOB_TIMEOUT_S)
        stdout = self.proc.stdout.read()  # a job id or two: the pipe never fills
        self._reader.join(timeout=10)
        self.proc.stdout.close()
        if self.proc.stderr is not None:
            self.proc.stderr.close()
        return self.proc.returncode, stdout

    def progress(self) -> list[tuple[float, str]]:
        return [(at, line) for at, line in self.lines if f"/{PROMPTS} " in line]


def _assert_steady_progress(waiter: _Waiter, ran_s: float) -> None:
    progress = waiter.progress()
    text = "\n".join(line for _, line in waiter.lines)
    assert len(progress) >= int(ran_s / (PROGRESS_EVERY_S + GAP_SLACK_S)), text
    gaps = [later - earlier for (earlier, _), (later, _) in itertools.pairwise(progress)]
    assert max(gaps) <= PROGRESS_EVERY_S + GAP_SLACK_S, (gaps, text)
    assert f"{PROMPTS}/{PROMPTS} completed" in progress[-1][1], text
    assert "running" in progress[0][1] or "ingesting" in progress[0][1], text


def test_submit_wait_and_wait_write_progress_to_a_log_and_wait_attaches_to_any_job(
    stack: ProcessStack,
) -> None:
    every = ("--progress-every-s", str(PROGRESS_EVERY_S))
    submitted = _Waiter(stack, *_submit_args(stack, "slow", "--wait", *every))
    assert submitted.proc.stdout is not None
    job_id = submitted.proc.stdout.readline().strip()
    assert len(job_id) == 32, job_id  # the coordinator's uuid, in hex
    attached = _Waiter(stack, "wait", job_id, *every)
    started_s = time.monotonic()

    assert submitted.finish()[0] == 0, submitted.lines
    assert attached.finish()[0] == 0, attached.lines
    ran_s = time.monotonic() - started_s
    assert ran_s >= MIN_RUN_S, f"the job ran {ran_s:.1f} s: too fast to see progress lines"
    _assert_steady_progress(submitted, ran_s)
    _assert_steady_progress(attached, ran_s)
    assert get_job(stack, job_id)["done"] == PROMPTS
    # Nothing was submitted again.
    assert [job["id"] for job in httpx.get(f"{stack.coordinator}/jobs", timeout=5).json()["jobs"]] == [job_id]

    # A job that has ended: one line and the exit code at once.
    ended = subprocess.run(
        _command("wait", job_id), env=stack.env, capture_output=True, text=True, timeout=60
    )
    assert ended.returncode == 0, ended.stderr
    assert f"{PROMPTS}/{PROMPTS} completed · failed 0 · rejected 0" in ended.stderr
    missing = subprocess.run(_command("wait", "nosuchjob"), env=stack.env, capture_output=True, text=True)
    assert missing.returncode == 3 and missing.stderr.startswith("error:"), missing.stderr


def _cli(stack: ProcessStack, *args: str, columns: int = 80) -> subprocess.CompletedProcess[str]:
    """A command with a coordinator URL in the environment that answers nothing: only
    ``--coordinator`` reaches the stack's."""
    env = {**stack.env, "DATAGEN_COORDINATOR_URL": DEAD_COORDINATOR, "COLUMNS": str(columns)}
    result = subprocess.run(
        _command(*args, "--coordinator", stack.coordinator),
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def test_status_shows_every_whole_job_id_and_state_at_80_and_100_columns(stack: ProcessStack) -> None:
    jobs: list[str] = []
    for name in ("first", "second"):
        result = stack.cli(*_submit_args(stack, name))
        assert result.returncode == 0, result.stderr
        jobs.append(result.stdout.strip())
    for job_id in jobs:
        wait_until(lambda j=job_id: get_job(stack, j)["state"] != "ingesting", 30, f"{job_id} ingested")
        assert "paused" in _cli(stack, "pause", job_id).stderr

    for columns in (80, 100):
        shown = _cli(stack, "status", columns=columns).stdout
        assert all(len(line) <= columns for line in shown.splitlines()), shown
        for job_id in jobs:
            [row] = [line for line in shown.splitlines() if job_id in line]
            assert "running (paused)" in row, shown
    wide = _cli(stack, "status", "--wide").stdout
    for header in EVERY_HEADER:
        assert header in wide, wide
    as_json = json.loads(_cli(stack, "status", "--json").stdout)
    assert sorted(job["id"] for job in as_json["jobs"]) == sorted(jobs)
    assert {queue["name"] for queue in as_json["queues"]} == {"short", "long"}

    for job_id in jobs:
        assert "cancelled" in _cli(stack, "cancel", job_id).stderr
    shown = _cli(stack, "status", columns=80).stdout
    for job_id in jobs:
        [row] = [line for line in shown.splitlines() if job_id in line]
        assert "cancelled" in row, shown
