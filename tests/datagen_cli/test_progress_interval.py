"""``DATAGEN_PROGRESS_INTERVAL_S`` (issue 39): how often ``datagen wait`` and ``submit --wait`` write
their progress line into a log when ``--progress-every-s`` is not given; the flag wins over it.
Real processes: a coordinator stack, a job that no worker serves (it stays running), and ``wait``."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from datagen.settings import ClientSettings, load
from tests.support.e2e import submit_job
from tests.support.processes import ProcessStack, coordinator_stack

pytestmark = pytest.mark.e2e

NS = "progressinterval"
INTERVAL_S = "0.5"
WATCHED_S = 4.0
# At a line every 0.5 s for 4 s: 8 lines, less what a loaded machine delays.
MIN_LINES = 4
PROMPTS = 3


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[ProcessStack]:
    with coordinator_stack(tmp_path, NS) as stack:
        yield stack


def _progress_lines(stack: ProcessStack, env: dict[str, str], *args: str) -> list[str]:
    """``datagen ARGS`` with stderr a pipe (not a terminal) for WATCHED_S: its progress lines."""
    lines: list[str] = []
    command = [sys.executable, "-m", "datagen_cli", *args]
    with subprocess.Popen(
        command, env={**stack.env, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    ) as proc:
        stderr = proc.stderr
        assert stderr is not None
        reader = threading.Thread(
            target=lambda: lines.extend(line for line in stderr if f"/{PROMPTS} " in line)
        )
        reader.start()
        time.sleep(WATCHED_S)
        proc.terminate()
        reader.join(timeout=30)
    return lines


def test_wait_writes_progress_every_datagen_progress_interval_s(stack: ProcessStack) -> None:
    job = submit_job(stack, "idle", PROMPTS, "--context-len", "4096")
    env = {"DATAGEN_PROGRESS_INTERVAL_S": INTERVAL_S}
    with ThreadPoolExecutor(max_workers=2) as pool:
        by_flag = pool.submit(_progress_lines, stack, env, "wait", job, "--progress-every-s", "60")
        by_env = pool.submit(_progress_lines, stack, env, "wait", job)
    results = {"flag": by_flag.result(), "env": by_env.result()}
    assert len(results["env"]) >= MIN_LINES, results["env"]
    assert all("running" in line for line in results["env"]), results["env"]
    # The flag wins: only the first answer's line within the watch.
    assert len(results["flag"]) == 1, results["flag"]


def test_the_default_interval_and_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    assert load(ClientSettings).progress_interval_s == 30.0
    monkeypatch.setenv("DATAGEN_PROGRESS_INTERVAL_S", "2.5")
    assert load(ClientSettings).progress_interval_s == 2.5
    assert load(ClientSettings, progress_interval_s=7.0).progress_interval_s == 7.0
