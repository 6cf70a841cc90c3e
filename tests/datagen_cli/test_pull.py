"""``datagen pull`` on the command line, with a coordinator over real HTTP (a stdlib server on a free
port) answering the job's state and the features consume endpoint."""

from __future__ import annotations

import json
import re
import tempfile
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from datagen.errors import ConfigError, JobNotFoundError
from datagen.records.schema import Record, records_to_table
from datagen.records.storage import Storage
from datagen_cli import app
from datagen_cli._app import describe_failure
from datagen_cli.local.redis_server import free_port
from tests.support.records import features_tensors, make_record, store_features

JOB = "job1"
PROMPT = [10, 11, 12]
WIDTH = 80


class Coordinator:
    """``GET /jobs/{id}`` answering ``states`` one a call (the last one stays), ``on_get`` run
    before each answer; ``POST /jobs/{id}/features/consume`` recording the names, or answering
    ``consume_status`` when it is not 200."""

    def __init__(self, states: list[str]) -> None:
        self.states = states
        self.gets = 0
        self.on_get: dict[int, Callable[[], None]] = {}  # GET number -> what to do before answering it
        self.consume_status = 200
        self.consumed: list[list[str]] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        coordinator = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if not self.path.startswith(f"/jobs/{JOB}"):
                    self._answer(404, {"error": "no job other", "type": "JobNotFoundError"})
                    return
                coordinator.gets += 1
                if action := coordinator.on_get.get(coordinator.gets):
                    action()
                state = coordinator.states.pop(0) if len(coordinator.states) > 1 else coordinator.states[0]
                self._answer(200, {"job_id": JOB, "state": state})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                assert self.path == f"/jobs/{JOB}/features/consume"
                if coordinator.consume_status != 200:
                    error = {"error": "Redis is out of reach", "type": "BackendUnavailableError"}
                    self._answer(coordinator.consume_status, error)
                    return
                coordinator.consumed.append(body["files"])
                self._answer(200, {"removed": len(body["files"]), "bytes": 1, "retained_bytes": 0})

            def _answer(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # the test's output stays quiet

        return Handler

    def __enter__(self) -> Coordinator:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=10)


@pytest.fixture
def scratch() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="pull-cli-scratch-") as tmp:
        yield Path(tmp)


def _record(storage: Storage, scratch: Path, sample_id: str, output: list[int], name: str | None) -> Record:
    ids = PROMPT + output
    if name is None:
        return make_record(sample_id, ids, len(PROMPT), job_id=JOB)
    tensors = features_tensors(ids, np.zeros((len(ids), 3, 2)))
    return make_record(
        sample_id, ids, len(PROMPT), job_id=JOB, **store_features(storage, JOB, name, tensors, scratch)
    )


def _commit(storage: Storage, shard: str, records: list[Record], at_ms: int) -> None:
    storage.commit_shard(
        JOB, shard, records_to_table(records), {"committed_at_ms": at_ms, "incarnation": "i"}
    )


def _features_job(storage: Storage) -> None:
    storage.write_manifest(JOB, {"job_id": JOB, "incarnation": "i", "spec": {"features": {"layers": [1]}}})


def _state(out: Path) -> dict[str, Any]:
    state: dict[str, Any] = json.loads((out / ".datagen-pull.json").read_text())
    return state


def _invoke(*args: str) -> Any:
    return CliRunner().invoke(app, ["pull", *args], prog_name="datagen")


def _summary(stdout: str) -> dict[str, Any]:
    summary: dict[str, Any] = json.loads(stdout.strip().splitlines()[-1])
    return summary


def test_pull_needs_no_coordinator_and_prints_a_line_a_shard(storage: Storage, tmp_path: Path) -> None:
    storage.write_manifest(JOB, {"job_id": JOB, "incarnation": "i", "spec": {}})
    _commit(storage, "w-00000001", [make_record("a", [*PROMPT, 20, 21], 3, job_id=JOB)], 1)
    out = tmp_path / "pulled"
    nowhere = f"http://127.0.0.1:{free_port()}"
    result = _invoke(JOB, str(out), "--storage", str(storage.root), "--coordinator", nowhere)
    assert result.exit_code == 0, result.output
    line = (out / "records/part-000000.jsonl").read_text()
    assert re.fullmatch(
        r"pulled shard w-00000001: 1 rows \(0 duplicates, 0 without features\), "
        rf"{len(line)} bytes → records/part-000000\.jsonl\n",
        result.stderr,
    )
    summary = _summary(result.stdout)
    assert (summary["pulled_shards"], summary["rows"], summary["next_index"], summary["unacknowledged"]) == (
        1,
        1,
        1,
        0,
    )
    assert json.loads(line)["loss_mask"] == [0, 0, 0, 1, 1]


def test_follow_pulls_each_commit_until_the_job_ends_and_consumes(
    storage: Storage, scratch: Path, tmp_path: Path
) -> None:
    _features_job(storage)
    _commit(storage, "w-00000001", [_record(storage, scratch, "a", [20], "a.safetensors")], 1)
    late = [
        _record(storage, scratch, "a", [21], "a2.safetensors"),
        _record(storage, scratch, "b", [22], "b.safetensors"),
    ]
    out = tmp_path / "pulled"
    seen: list[list[str]] = []
    with Coordinator(["running", "running", "completed"]) as coordinator:

        def second_look() -> None:
            # Shard 2 commits while the pull waits, before the second poll's answer.
            seen.append(_state(out)["done"])
            _commit(storage, "w-00000002", late, 2)

        # Each look at the job notes what was pulled by then.
        coordinator.on_get[2] = second_look
        coordinator.on_get[3] = lambda: seen.append(_state(out)["done"])
        result = _invoke(
            JOB, str(out), "--storage", str(storage.root), "--coordinator", coordinator.url,
            "--follow", "--consume", "--poll-s", "0.05",
        )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert result.stderr.count("pulled shard ") == 2
    assert seen == [["w-00000001"], ["w-00000001", "w-00000002"]]  # each pulled at the poll after it
    assert coordinator.gets == 3
    assert [
        json.loads(line)["id"]
        for part in ("000000", "000001")
        for line in (out / f"records/part-{part}.jsonl").read_text().splitlines()
    ] == ["a", "b"]
    assert sorted(p.name for p in (out / "hidden_states").iterdir()) == [
        "hs_0.safetensors",
        "hs_1.safetensors",
    ]
    assert coordinator.consumed == [["a.safetensors"], ["a2.safetensors", "b.safetensors"]]
    summary = _summary(result.stdout)
    assert summary["job_state"] == "completed"
    assert (summary["pulled_shards"], summary["rows"], summary["duplicates"], summary["consumed_files"]) == (
        2,
        2,
        1,
        3,
    )


def test_an_unacknowledged_consume_exits_1_and_a_rerun_sends_it(
    storage: Storage, scratch: Path, tmp_path: Path
) -> None:
    _features_job(storage)
    _commit(storage, "w-00000001", [_record(storage, scratch, "a", [20], "a.safetensors")], 1)
    out = tmp_path / "pulled"
    with Coordinator(["running"]) as coordinator:
        args = (JOB, str(out), "--storage", str(storage.root), "--coordinator", coordinator.url, "--consume")
        coordinator.consume_status = 503
        first = _invoke(*args)
        assert first.exit_code == 1, first.output
        assert "warning: could not acknowledge features files yet" in first.stderr
        assert "1 features files are pulled but not yet acknowledged" in first.stderr
        assert _summary(first.stdout)["unacknowledged"] == 1
        coordinator.consume_status = 200
        second = _invoke(*args)
    assert second.exit_code == 0, second.output
    assert "pulled shard" not in second.stderr  # nothing pulled twice
    assert coordinator.consumed == [["a.safetensors"]]


def test_errors_a_user_can_meet_are_one_line(storage: Storage, scratch: Path, tmp_path: Path) -> None:
    _features_job(storage)
    _commit(storage, "w-00000001", [_record(storage, scratch, "a", [20], "a.safetensors")], 1)
    root = str(storage.root)
    with Coordinator(["running"]) as coordinator:
        unknown = _invoke(
            "other", str(tmp_path / "x"), "--storage", root, "--coordinator", coordinator.url, "--follow"
        )
    assert isinstance(unknown.exception, JobNotFoundError)
    assert not (tmp_path / "x").exists()  # refused before anything was written
    missing = _invoke("job2", str(tmp_path / "y"), "--storage", root)
    assert isinstance(missing.exception, ConfigError)
    assert str(missing.exception).startswith("no job job2 under ")
    assert _invoke(JOB, str(tmp_path / "pulled"), "--storage", root).exit_code == 0
    storage.write_manifest("job2", {"job_id": "job2", "incarnation": "j", "spec": {}})
    foreign = _invoke("job2", str(tmp_path / "pulled"), "--storage", root)
    assert isinstance(foreign.exception, ConfigError)
    for result in (unknown, missing, foreign):
        assert "\n" not in describe_failure(result.exception)
    assert "holds a pull of job job1, not job2" in str(foreign.exception)


def test_help_fits_80_columns() -> None:
    result = CliRunner(env={"COLUMNS": str(WIDTH)}).invoke(
        app, ["pull", "--help"], prog_name="datagen", terminal_width=WIDTH
    )
    assert result.exit_code == 0, result.output
    assert all(len(line) <= WIDTH for line in result.output.splitlines()), result.output
    for flag in ("--follow", "--consume", "--poll-s", "--storage", "--coordinator"):
        assert flag in result.output
