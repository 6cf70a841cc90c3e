"""What the processes of a fleet say when they start, over real child processes (their logs): the
coordinator and the simulator where they listen, a worker its servers; nothing that reads like an
alarm on a brand-new Redis; and a worker that stops takes its servers off ``GET /servers``."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import httpx

from tests.support.processes import coordinator_stack
from tests.support.wait import wait_until

NS = "lines"
ALARMS = ("lost its data", "healthy again", "WARNING", "ERROR", "Traceback")


def test_a_new_fleet_says_where_it_listens_and_nothing_alarming(tmp_path: Path) -> None:
    with coordinator_stack(tmp_path, NS) as stack:
        coordinator_log = (tmp_path / "coordinator.log").read_text("utf-8")
        assert f"coordinator listening on {stack.coordinator}: the HTTP API, /healthz and /metrics" in (
            coordinator_log
        )
        sim = stack.spawn_sim("sim")
        assert (
            f"simulator listening on {sim}: the sglang API (/generate" in (tmp_path / "sim.log").read_text()
        )
        worker = stack.spawn("worker", "worker", "--server", f"s0={sim}")
        stack.wait_server_up(stack.coordinator, "s0")
        worker_log = tmp_path / "worker.log"
        wait_until(lambda: " started: servers " in worker_log.read_text(), 30, "the worker's start line")
        said = worker_log.read_text()
        assert re.search(
            rf"server s0 is up: sglang at {re.escape(sim)}, model \S+, context length \d+", said
        ), said
        assert re.search(rf"worker \S+ started: servers s0={re.escape(sim)} \(up\)", said), said
        for log in (worker_log, tmp_path / "coordinator.log", tmp_path / "sim.log"):
            text = log.read_text()
            assert not [alarm for alarm in ALARMS if alarm in text], f"{log.name}:\n{text}"

        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=60) == 0
        servers = httpx.get(f"{stack.coordinator}/servers", timeout=5).json()["servers"]
        assert servers == []  # the worker withdrew its view: no ghost left in the list
