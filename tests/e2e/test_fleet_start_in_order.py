"""The operator guide's fleet start, run in the order written, in a fresh directory (issue 39, item 1).

The blocks of ``docs/operator/running-a-fleet.md`` marked ``<!-- fleet-start-in-order: run -->``
run as one bash script with the real processes: ``redis-server`` with AOF, the coordinator with
``DATAGEN_TOKENIZER_ALLOWLIST`` naming the copied tokenizer's directory, two ``datagen sim`` standing
in for two GPUs and a worker for each, all in the background as written; then ``datagen submit
--wait`` with that tokenizer, ``datagen status`` and ``datagen export``. What the test changes, as
the README's test does (:mod:`tests.support.doc_blocks`): the page's ports become free ones, and
before the submit the script waits for the coordinator and both servers, as a reader watching the
terminals would. Then: the job completed with records from both servers and both workers, and the
export holds every prompt.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.support.doc_blocks import (
    REPO,
    checkout_home,
    free_ports,
    marked_blocks,
    run_script,
    wait_for_fleet_line,
    with_free_ports,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

PAGE = REPO / "docs" / "operator" / "running-a-fleet.md"
MARK = "<!-- fleet-start-in-order: run -->"
PAGE_PORTS = (6379, 8000, 30000, 30001)
SERVERS = {"gpu0", "gpu1"}
SUBMIT = "datagen submit "
SCRIPT_TIMEOUT_S = 150
PROMPTS = 273


def _script(blocks: list[str], wait_line: str) -> list[str]:
    """The page's blocks with free ports, the wait for the fleet right before the submit."""
    [submit_at] = [i for i, block in enumerate(blocks) if SUBMIT in block]
    ports = free_ports(PAGE_PORTS)
    lines = [with_free_ports(block, ports) for block in blocks]
    return [*lines[:submit_at], wait_line, *lines[submit_at:]]


def test_the_operator_guides_fleet_start_runs_as_written(tmp_path: Path) -> None:
    blocks = marked_blocks(PAGE, MARK)
    assert len(blocks) >= 4, "the fleet start's blocks are no longer marked"
    assert "DATAGEN_TOKENIZER_ALLOWLIST" in "".join(blocks)
    home = checkout_home(tmp_path)
    run = run_script(
        _script(blocks, wait_for_fleet_line(tmp_path, len(SERVERS))), home, tmp_path, SCRIPT_TIMEOUT_S
    )
    assert run.code == 0, f"the fleet start failed (exit {run.code}):\n{run.script}\n{run.output[-6000:]}"

    [job] = list((home / "fleet-data" / "jobs").iterdir())
    manifest = json.loads((job / "manifest.json").read_text("utf-8"))
    assert manifest["spec"]["tokenizer"] == str(home / "models" / "r1")
    records = pq.read_table(job / "records", columns=["server", "worker"]).to_pydict()
    assert len(records["server"]) >= PROMPTS
    assert set(records["server"]) == SERVERS, "both servers should have served the job"
    assert len(set(records["worker"])) == len(SERVERS), "both workers should have recorded"
    exported = (home / "fleet-train.jsonl").read_text("utf-8").splitlines()
    assert len(exported) == PROMPTS, run.output[-3000:]
    assert any((home / "redis-data").iterdir()), "Redis ran without its AOF files"
