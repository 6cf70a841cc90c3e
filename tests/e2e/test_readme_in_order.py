"""The README's commands, run in the order written, in a fresh directory (issue 39, item 1).

The blocks marked ``<!-- readme-in-order: run -->`` (the demo, then the tour) run as one bash
script with the real processes: the demo, ``redis-server``, ``datagen sim``, ``datagen worker`` and
``datagen coordinator`` in the background as written, then ``datagen submit --wait``, ``datagen
status``, ``datagen report`` and ``datagen export`` (through :mod:`tests.support.doc_blocks`, as the
operator guide's fleet start is run). What the test changes, and nothing else:

- ``pip install -e . &&`` is dropped from the demo's block (this interpreter has the package);
- the README's ports (Redis 6379, the simulator 30000, the coordinator 8000) become free ones;
- between the tour's first block and the next, the script waits for the coordinator and for the
  worker's server, as a reader watching the terminals would;
- the directory is empty but for the checkout's ``examples/`` and ``datagen/`` (the tour runs "from a
  checkout"), linked; ``redis-server`` on the PATH is the one the project's tests use.

Then: the demo and the tour each wrote their own storage, the export holds every prompt, no
``dump.rdb`` was written, and ``.gitignore`` covers everything the commands left in a checkout.
"""

from __future__ import annotations

import fnmatch
from pathlib import Path

import pytest

from tests.support.doc_blocks import (
    REPO,
    STOP_TIMEOUT_S,
    checkout_home,
    free_ports,
    group_alive,
    marked_blocks,
    run_script,
    wait_for_fleet_line,
    with_free_ports,
)
from tests.support.wait import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(480)]

MARK = "<!-- readme-in-order: run -->"
INSTALL = "pip install -e . && "
README_PORTS = (6379, 30000, 8000)
SCRIPT_TIMEOUT_S = 420
DEMO_PROMPTS = 273


def readme_blocks() -> list[str]:
    return marked_blocks(REPO / "README.md", MARK)


def _script(blocks: list[str], wait_line: str) -> list[str]:
    demo, tour_start, *tour_rest = blocks
    assert INSTALL in demo, "the demo's block no longer installs: update this test"
    ports = free_ports(README_PORTS)
    lines = [demo.replace(INSTALL, ""), with_free_ports(tour_start, ports), wait_line]
    return lines + [with_free_ports(block, ports) for block in tour_rest]


def _gitignored(name: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatch(name, pattern.rstrip("/")) for pattern in patterns)


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return checkout_home(tmp_path)


def test_the_readmes_demo_then_its_tour_run_as_written(home: Path, tmp_path: Path) -> None:
    blocks = readme_blocks()
    assert len(blocks) >= 4, "the README's demo and tour blocks are no longer marked"
    run = run_script(_script(blocks, wait_for_fleet_line(tmp_path, 1)), home, tmp_path, SCRIPT_TIMEOUT_S)
    output = run.output
    assert run.code == 0, f"the README's commands failed (exit {run.code}):\n{run.script}\n{output[-6000:]}"

    assert (home / "datagen-demo" / "datagen-namespace.json").is_file()
    assert (home / "datagen-data" / "datagen-namespace.json").is_file()
    exported = (home / "train.jsonl").read_text("utf-8").splitlines()
    assert len(exported) == DEMO_PROMPTS, output[-3000:]
    wait_until(lambda: not group_alive(run.pgid), STOP_TIMEOUT_S, "the README's processes to stop")
    assert not (home / "dump.rdb").exists(), "the README's redis-server wrote dump.rdb in the checkout"

    ignored = [
        line.strip()
        for line in (REPO / ".gitignore").read_text("utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    ]
    left = sorted(p.name for p in home.iterdir() if p.name not in ("examples", "datagen"))
    assert left, "the commands wrote nothing"
    unignored = [name for name in left if not _gitignored(name, ignored)]
    assert not unignored, f"the README's commands leave files .gitignore does not cover: {unignored}"
