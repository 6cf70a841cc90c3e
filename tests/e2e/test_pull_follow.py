"""``datagen pull --follow --consume`` beside a job with features and a budget, over real processes:
the pull writes every record once with its features, is killed and restarted, and its consumption
is what lets capture go on; the stored features never pass the budget by more than one file."""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from simulator.capture_values import hidden_states
from tests.support.e2e import FAST_STACK_ENV, get_job, start_worker, submit_job
from tests.support.processes import ProcessStack, coordinator_stack
from tests.support.sim import read_capture
from tests.support.wait import wait_until

pytestmark = pytest.mark.e2e

LAYERS = (2, 5, 8, 9)
HIDDEN = 16
PROMPTS = 40
# A few records' files (4 layers x 16 values x 2 bytes + 8 a token, sequences of up to ~420 tokens).
BUDGET_BYTES = 150_000


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[ProcessStack]:
    with coordinator_stack(tmp_path, "pull", FAST_STACK_ENV) as stack:
        yield stack


class _Peak(threading.Thread):
    """The largest total of stored features files seen, and the largest single file."""

    def __init__(self, folder: Path) -> None:
        super().__init__(daemon=True)
        self.folder = folder
        self.peak = self.largest = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            sizes = []
            for path in self.folder.glob("*.safetensors") if self.folder.exists() else []:
                with contextlib.suppress(FileNotFoundError):  # consumed between the listing and the stat
                    sizes.append(path.stat().st_size)
            self.peak = max(self.peak, sum(sizes))
            self.largest = max([self.largest, *sizes])
            time.sleep(0.02)


def test_pull_follow_consume_within_a_budget_writes_everything_once(
    stack: ProcessStack, tmp_path: Path
) -> None:
    capture_dir = tmp_path / "capture"
    capture_dir.mkdir()
    gen = stack.spawn_sim("gen", "--time-scale", "0.01")
    cap = stack.spawn_sim(
        "cap",
        *("--api", "vllm", "--time-scale", "0.01", "--capture-dir", str(capture_dir)),
        *("--capture-layers", ",".join(map(str, LAYERS)), "--capture-num-layers", "9"),
        *("--capture-hidden-size", str(HIDDEN)),
    )
    start_worker(
        stack, "worker", f"gen={gen}", "--capture-server", f"cap={cap}", "--capture-dir", str(capture_dir)
    )
    stack.wait_server_up(stack.coordinator, "cap")
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"features:\n  layers: {list(LAYERS)}\n  retain_bytes: {BUDGET_BYTES}\n")
    job_id = submit_job(stack, "pulled", PROMPTS, "--spec", str(spec))
    peak = _Peak(tmp_path / "data" / "jobs" / job_id / "features")
    peak.start()

    out = tmp_path / "train"
    pull_args = ("pull", job_id, str(out), "--follow", "--consume", "--poll-s", "0.1")
    first = stack.spawn("pull1", *pull_args)
    # Killed once it has pulled something (and the budget has held capture back meanwhile).
    wait_until(
        lambda: len(list((out / "hidden_states").glob("hs_*"))) >= 3,
        60,
        "a first pull",
        on_timeout=stack.logs,
    )
    first.send_signal(signal.SIGKILL)
    first.wait(10)
    second = stack.spawn("pull2", *pull_args)
    assert second.wait(180) == 0, stack.logs()
    peak.stop.set()
    peak.join(5)

    assert get_job(stack, job_id)["state"] == "completed"
    parts = sorted((out / "records").glob("part-*.jsonl"))
    rows = [json.loads(line) for part in parts for line in part.read_text().splitlines()]
    assert [row["index"] for row in rows] == list(range(PROMPTS))
    assert len({row["id"] for row in rows}) == PROMPTS
    for row in rows:
        stored = read_capture(out / row["hidden_states"])
        assert stored["token_ids"][1].tolist() == row["input_ids"]
        np.testing.assert_array_equal(
            stored["hidden_states"][1].astype(np.float32), hidden_states(row["input_ids"], LAYERS, HIDDEN)
        )
    # Consumed: storage keeps none of the job's features, and the budget was never passed by more
    # than one file.
    assert not list((tmp_path / "data" / "jobs" / job_id / "features").glob("*.safetensors"))
    assert peak.peak <= BUDGET_BYTES + peak.largest, (peak.peak, peak.largest)
    assert peak.peak > 0
