"""A test that hangs past its time ends its own process, with every thread's stack, not the run.

pytest-timeout (the signal method) raises once in a test that outlives its limit. A teardown that
hangs after that (a thread join, a wait on a process or on a stopped server) would hold its xdist
worker, and so the whole run, until CI's own limit kills it with nothing to say where. Here each
test, setup to teardown, arms `faulthandler` at its limit plus a grace: past that, the stacks of
every thread go to a file and the process exits; xdist reports the test as crashed and starts
another worker, and the run's summary prints the file. faulthandler has one such timer a process:
pytest's own ``faulthandler_timeout`` must stay unset."""

from __future__ import annotations

import faulthandler
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

import pytest

# Where each process writes the stacks of a test it gives up on (made by the run's main process).
DUMPS_ENV = "TESTS_HANG_DUMPS"
# Past the test's own limit: a stack's teardown stops its processes within 30 s, then kills them.
# The ini option ``watchdog_grace_s`` sets another (tests/test_watchdog.py: a short one).
GRACE_S = 90.0

_dumps = pytest.StashKey[Path]()
# The test's deadline, and the file its stacks go to.
_armed = pytest.StashKey[tuple[float, TextIO]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        "watchdog_grace_s", "seconds a test may run past its timeout, teardown included", default=str(GRACE_S)
    )


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):
        return  # an xdist worker: its main process made the folder, and the environment has it
    folder = Path(tempfile.mkdtemp(prefix="datagen-hangs-"))
    config.stash[_dumps] = folder
    os.environ[DUMPS_ENV] = str(folder)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    folder = os.environ.get(DUMPS_ENV)
    if not folder or not Path(folder).is_dir():
        yield
        return
    limit_s = _timeout_s(item) + float(item.config.getini("watchdog_grace_s"))
    path = Path(folder) / f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-{os.getpid()}.txt"
    with path.open("w") as dump:
        dump.write(f"{item.nodeid} ran past {limit_s:.0f} s, setup to teardown; every thread's stack:\n")
        dump.flush()
        item.stash[_armed] = (time.monotonic() + limit_s, dump)
        try:
            yield
        finally:
            faulthandler.cancel_dump_traceback_later()
            del item.stash[_armed]
    path.unlink()


# Armed again before each phase: pytest's own faulthandler plugin cancels the dump when a phase
# fails (`pytest_exception_interact`), as pytest-timeout's failure does, before the teardown.
@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _arm(item)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item: pytest.Item) -> None:
    _arm(item)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    _arm(item)


def _arm(item: pytest.Item) -> None:
    armed = item.stash.get(_armed, None)
    if armed is not None:
        deadline, dump = armed
        faulthandler.dump_traceback_later(max(1.0, deadline - time.monotonic()), exit=True, file=dump)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    folder = config.stash.get(_dumps, None)
    if folder is None:
        return
    for path in sorted(folder.glob("*.txt")):
        terminalreporter.section(f"a hung test's stacks ({path.stem})")
        terminalreporter.write(path.read_text())
    shutil.rmtree(folder, ignore_errors=True)


def _timeout_s(item: pytest.Item) -> float:
    """The test's pytest-timeout limit: its ``timeout`` mark, else the ini's ``timeout``."""
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        return float(marker.args[0])
    return float(item.config.getini("timeout") or 0) or 120.0
