"""The hang watchdog (`tests.support.watchdog`) over a real pytest run with xdist: a test whose
teardown hangs after its pytest-timeout failure ends its worker, the run goes on to the next test
and ends, and its summary shows where the test hung."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
HUNG = """
import threading
import pytest

@pytest.fixture
def stuck():
    yield
    threading.Event().wait()  # a teardown that never ends: joined with no timeout

@pytest.mark.timeout(1)
def test_hangs_in_its_teardown(stuck):
    threading.Event().wait(5)

def test_after_it():
    pass
"""


@pytest.mark.timeout(120)
def test_a_teardown_hung_past_the_grace_ends_its_worker_with_its_stack(tmp_path: Path) -> None:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_hung.py").write_text(HUNG)
    started = time.monotonic()
    args = "-n 1 -p tests.support.watchdog -p no:cacheprovider -o watchdog_grace_s=2 test_hung.py"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", *args.split()],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=90,
    )
    took_s = time.monotonic() - started
    out = run.stdout
    assert run.returncode == 1, out + run.stderr
    # Its timeout (1 s) plus the grace (2 s), and the rest of the run: not the hang's forever.
    assert took_s < 60, f"the run took {took_s:.0f} s"
    assert "Timeout (>1.0s)" in out and "worker 'gw0' crashed while running" in out, out
    assert "1 passed" in out, out  # the next test ran on a new worker
    assert "a hung test's stacks" in out and "ran past 3 s, setup to teardown" in out, out
    assert 'File "' in out and "in stuck" in out, out  # the hung fixture's frame
