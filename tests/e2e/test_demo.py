"""``datagen demo`` as a user runs it: a subprocess, no configuration, real records, nothing left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from datagen.records.storage import Storage
from tests.support.processes import interruptible
from tests.support.wait import wait_until

pytestmark = pytest.mark.e2e

DEMO_BUDGET_S = 120  # the bar: the demo finishes in under two minutes


def _processes_with_storage(data_dir: Path) -> list[int]:
    """Pids whose environment points DATAGEN_STORAGE at ``data_dir`` (the demo's children)."""
    marker = f"DATAGEN_STORAGE={data_dir}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("DATAGEN_")}


def test_demo_runs_to_completion_and_cleans_up(tmp_path: Path) -> None:
    data_dir = tmp_path / "demo-data"
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "datagen_cli", "demo", "--data-dir", str(data_dir)],
        capture_output=True,
        text=True,
        timeout=DEMO_BUDGET_S + 60,
        env=_env(),
        cwd=tmp_path,
    )
    wall_s = time.monotonic() - started
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert wall_s < DEMO_BUDGET_S, f"demo took {wall_s:.0f} s"
    assert "273 accepted, 273 done, 0 failed, 0 rejected rows" in output
    assert "datagen export" in output
    storage = Storage(data_dir)
    [job_dir] = (data_dir / "jobs").iterdir()
    rows = sum(b.num_rows for b in storage.iter_record_batches(job_dir.name))
    assert rows == 273
    assert _processes_with_storage(data_dir) == []


def test_demo_interrupted_leaves_no_process_behind(tmp_path: Path) -> None:
    data_dir = tmp_path / "demo-data"
    proc = subprocess.Popen(
        interruptible([sys.executable, "-m", "datagen_cli", "demo", "--data-dir", str(data_dir)]),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=_env(),
        cwd=tmp_path,
        start_new_session=True,
    )
    # Wait until the demo's children run, then press Ctrl-C (SIGINT to the whole process group).
    wait_until(
        lambda: len(_processes_with_storage(data_dir)) >= 3, 60, "the demo's children to run", interval_s=0.2
    )
    os.killpg(proc.pid, signal.SIGINT)
    output, _ = proc.communicate(timeout=60)
    # 130: it stopped for the Ctrl-C, not because the job had already finished.
    assert proc.returncode == 130, output.decode(errors="replace")[-3000:]
    wait_until(
        lambda: not _processes_with_storage(data_dir),
        10,
        "the demo's children to exit",
        interval_s=0.2,
        on_timeout=lambda: f"still running: {_processes_with_storage(data_dir)}",
    )
