"""Jobs with features end to end over real processes: a generating simulator, a capturing vLLM
simulator writing files into a directory the worker reads, the coordinator, the worker, and the
``speculators-offline`` export, whose every file is checked against the simulator's values."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import datasets
import httpx
import numpy as np
import pytest

from datagen.prompts.tokenization import bundled_tokenizer_path
from datagen_cli.local.redis_server import free_port
from simulator.capture_values import hidden_states
from tests.support.e2e import (
    FAST_STACK_ENV,
    get_job,
    job_records,
    start_worker,
    submit_job,
    submit_job_result,
)
from tests.support.processes import ProcessStack, coordinator_stack
from tests.support.sim import read_capture
from tests.support.wait import wait_until

pytestmark = pytest.mark.e2e

NS = "feat"
# A small model for the simulator: 9 layers, hidden size 16; the job lists the ids out of order.
LAYERS = (2, 5, 8, 9)
JOB_LAYERS = "9,2,8,5"
HIDDEN = 16
JOB_TIMEOUT_S = 120.0


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[ProcessStack]:
    with coordinator_stack(tmp_path, NS, FAST_STACK_ENV) as stack:
        yield stack


def _capture_sim(stack: ProcessStack, capture_dir: Path, *options: str, name: str = "cap") -> str:
    return stack.spawn_sim(
        name,
        "--api",
        "vllm",
        "--time-scale",
        "0.01",
        "--capture-dir",
        str(capture_dir),
        "--capture-layers",
        ",".join(map(str, LAYERS)),
        "--capture-num-layers",
        "9",
        "--capture-hidden-size",
        str(HIDDEN),
        *options,
    )


def _fleet(
    stack: ProcessStack, capture_dir: Path, *cap_options: str, env: dict[str, str] | None = None
) -> tuple[Any, str, str]:
    """A generating simulator, a capturing one and a worker for both: (worker, gen URL, cap URL)."""
    gen = stack.spawn_sim("gen", "--time-scale", "0.01")
    cap = _capture_sim(stack, capture_dir, *cap_options)
    worker = _worker(stack, "worker", gen, cap, capture_dir, env=env)
    return worker, gen, cap


def _worker(
    stack: ProcessStack, name: str, gen: str, cap: str, capture_dir: Path, env: dict[str, str] | None = None
) -> Any:
    options = ("--capture-server", f"cap={cap}", "--capture-dir", str(capture_dir))
    worker = start_worker(stack, name, f"gen={gen}", *options, env=env)
    stack.wait_server_up(stack.coordinator, "cap")
    return worker


def _completed(stack: ProcessStack, job_id: str, timeout_s: float = JOB_TIMEOUT_S) -> dict[str, Any]:
    return wait_until(
        lambda: (job := get_job(stack, job_id))["state"] == "completed" and job,
        timeout_s,
        f"job {job_id} to complete",
        on_timeout=stack.logs,
    )


def _export(stack: ProcessStack, job_id: str, out: Path) -> str:
    result = stack.cli("export", job_id, "--format", "speculators-offline", "--out", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


def _check_export(out: Path, dtype: str) -> int:
    """Every row of the export against the simulator's values; the rows checked."""
    # The export says torch format, as speculators' prepare_data saves it; torch is not installed
    # here, so its Arrow files are read as they are.
    data = datasets.concatenate_datasets(
        [datasets.Dataset.from_file(str(path)) for path in sorted(out.glob("data-*.arrow"))]
    )
    for i, row in enumerate(data):
        stored = read_capture(out / "hidden_states" / f"hs_{i}.safetensors")
        ids = row["input_ids"]
        assert stored["token_ids"][1].tolist() == ids
        assert row["seq_len"] == len(ids) == len(row["loss_mask"])
        expected = hidden_states(ids, LAYERS, HIDDEN)
        kind, values = stored["hidden_states"]
        assert values.shape == (len(ids), len(LAYERS), HIDDEN)
        if dtype == "bf16":
            assert kind == "BF16"
            # The simulator's values are exact in bf16: any shifted row or swapped layer differs.
            np.testing.assert_array_equal(values.astype(np.float32), expected)
        else:
            assert kind == "F8_E4M3"
            scales = stored["hidden_states_scales"][1].astype(np.float32)
            amax = np.abs(expected).max(axis=(1, 2), keepdims=True)
            np.testing.assert_allclose(scales, np.maximum(amax / 448.0, 1e-12), rtol=1e-6)
            restored = values.astype(np.float32) * scales
            bound = np.abs(expected) * 2.0**-4 + scales * 2.0**-9
            assert np.all(np.abs(restored - expected) <= bound)
    return len(data)


def _left_in(capture_dir: Path) -> list[str]:
    return sorted(p.name for p in capture_dir.iterdir() if p.is_file())


def _records_by_key(stack: ProcessStack, job_id: str) -> dict[tuple[str, int, int], list[dict[str, Any]]]:
    by_key: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    for record in job_records(stack, job_id):
        by_key.setdefault((record["sample_id"], record["turn"], record["gen"]), []).append(record)
    return by_key


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_a_job_with_features_exports_what_the_capture_server_computed(
    stack: ProcessStack, tmp_path: Path, dtype: str
) -> None:
    capture_dir = tmp_path / "capture"
    capture_dir.mkdir()
    _fleet(stack, capture_dir)
    job_id = submit_job(stack, f"f{dtype}", 12, "--features-layers", JOB_LAYERS, "--features-dtype", dtype)
    _completed(stack, job_id)

    records = job_records(stack, job_id)
    assert len(records) == 12
    assert all(r["features_file"] and r["features_error"] is None for r in records)
    out = tmp_path / "export"
    _export(stack, job_id, out)
    assert _check_export(out, dtype) == 12
    # The server's files and locks are deleted once stored; nothing is left but the spool folder.
    assert wait_until(lambda: _left_in(capture_dir) == [], 10, "the capture directory to empty")
    verify = stack.cli("verify", job_id)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    result = stack.cli("report", job_id, "--out", str(tmp_path / "report"))
    assert result.returncode == 0, result.stdout + result.stderr
    features = json.loads((tmp_path / "report" / "report.json").read_text())["features"]
    assert (features["stored"], features["missing"], features["layers"]) == (12, 0, list(LAYERS))
    # bf16: 4 layers x 16 values x 2 bytes + an 8-byte id a token, and each file's header.
    per_token = 4 * HIDDEN * (2 if dtype == "bf16" else 1) + 8 + (4 if dtype == "fp8" else 0)
    assert per_token < features["bytes_per_token"] < per_token * 1.2


def test_one_record_by_hand(stack: ProcessStack, tmp_path: Path) -> None:
    """Hand-written values for one exported row: the simulator's formula at two positions."""
    capture_dir = tmp_path / "capture"
    capture_dir.mkdir()
    _fleet(stack, capture_dir)
    job_id = submit_job(stack, "hand", 1, "--features-layers", JOB_LAYERS)
    _completed(stack, job_id)
    out = tmp_path / "export"
    _export(stack, job_id, out)
    stored = read_capture(out / "hidden_states" / "hs_0.safetensors")
    ids = stored["token_ids"][1].tolist()
    values = stored["hidden_states"][1].astype(np.float32)
    # ((token*31 + t*7 + layer*13 + h*3) % 251 - 125) / 16 at t=0, layer 2 (slot 0), h=0 and at
    # t=1, layer 9 (slot 3), h=2, with the record's own first two ids.
    first, second = ids[0], ids[1]
    assert values[0, 0, 0] == ((first * 31 + 0 + 2 * 13 + 0) % 251 - 125) / 16
    assert values[1, 3, 2] == ((second * 31 + 7 + 9 * 13 + 6) % 251 - 125) / 16


def test_a_job_with_features_is_refused_without_a_capture_server(stack: ProcessStack) -> None:
    gen = stack.spawn_sim("gen", "--time-scale", "0.01")
    start_worker(stack, "worker", f"gen={gen}")
    result = submit_job_result(stack, "nocap", 3, "--features-layers", JOB_LAYERS)
    assert result.returncode != 0
    assert "no live worker lists a capture server" in result.stderr, result.stderr
    assert "--capture-server" in result.stderr


def test_capture_faults_are_retried_and_none_is_stored(stack: ProcessStack, tmp_path: Path) -> None:
    capture_dir = tmp_path / "capture"
    capture_dir.mkdir()
    faults = [
        *("--capture-fault-truncate", "0.08"),
        *("--capture-fault-nofile", "0.08"),
        *("--capture-fault-short", "0.08"),
        *("--capture-fault-5xx", "0.08"),
        # "not written after" comes only from a slow writer: at 0.05 about one run in 30 drew none.
        *("--capture-fault-slow", "0.1"),
        *("--capture-slow-write-s", "2"),
    ]
    env = {
        "DATAGEN_CAPTURE_LOCK_TIMEOUT_S": "0.5",
        "DATAGEN_MAX_ATTEMPTS": "20",
        "DATAGEN_CAPTURE_ORPHAN_AGE_S": "1",
    }
    _fleet(stack, capture_dir, *faults, env=env)
    job_id = submit_job(stack, "faulty", 60, "--features-layers", JOB_LAYERS)
    _completed(stack, job_id, timeout_s=240)

    records = job_records(stack, job_id)
    assert len(records) == 60
    assert all(r["features_file"] for r in records), [r["features_error"] for r in records]
    out = tmp_path / "export"
    _export(stack, job_id, out)
    assert _check_export(out, "bf16") == 60
    log = (stack.tmp / "worker.log").read_text()
    # Each fault was met, retried, and none of its files stored (every exported file is exact).
    for problem in ("truncated", "rows for", "not written after", "its writer released", "HTTP 500"):
        assert problem in log, problem
    # Files written after their try was given up (the slow writer) are swept by age.
    assert wait_until(lambda: _left_in(capture_dir) == [], 30, "orphans to be swept", on_timeout=stack.logs)


def test_a_worker_killed_mid_capture_loses_and_duplicates_nothing(
    stack: ProcessStack, tmp_path: Path
) -> None:
    capture_dir = tmp_path / "capture"
    capture_dir.mkdir()
    cap_options = ("--capture-write-delay-ms", "150")
    worker, gen, cap = _fleet(stack, capture_dir, *cap_options)
    job_id = submit_job(stack, "killed", 40, "--features-layers", JOB_LAYERS)
    wait_until(lambda: get_job(stack, job_id)["done"] >= 5, 60, "some records", on_timeout=stack.logs)
    worker.send_signal(signal.SIGKILL)
    worker.wait(10)

    _worker(stack, "worker2", gen, cap, capture_dir)
    _completed(stack, job_id, timeout_s=180)

    by_key = _records_by_key(stack, job_id)
    assert len(by_key) == 40
    out = tmp_path / "export"
    _export(stack, job_id, out)
    assert _check_export(out, "bf16") == 40


def test_capture_errors_are_reported_per_record(stack: ProcessStack, tmp_path: Path) -> None:
    """A sequence the capture server's context cannot hold keeps its record, without features."""
    capture_dir = tmp_path / "capture"
    capture_dir.mkdir()
    gen = stack.spawn_sim("gen", "--time-scale", "0.01")
    cap = _capture_sim(stack, capture_dir, "--context-len", "64")
    _worker(stack, "worker", gen, cap, capture_dir)
    job_id = submit_job(stack, "long", 4, "--features-layers", JOB_LAYERS)
    _completed(stack, job_id)
    records = job_records(stack, job_id)
    assert all(r["features_file"] is None and "64" in r["features_error"] for r in records)
    reply = httpx.get(f"{stack.coordinator}/jobs/{job_id}/errors", params={"kind": "capture"}, timeout=5)
    assert reply.status_code == 200, reply.text
    errors = reply.json()["errors"]
    assert sorted(e["sample_id"] for e in errors) == ["long0", "long1", "long2", "long3"]
    assert all("64" in e["error"] for e in errors)
    # The report's features section and check say the same.
    result = stack.cli("report", job_id, "--out", str(tmp_path / "report"))
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["features"]["stored"] == 0 and report["features"]["missing"] == 4
    check = next(c for c in report["checks"] if c["name"] == "features_missing")
    assert check["status"] == "warn" and check["found"] == 4


def test_a_budget_holds_capture_until_a_consumer_frees_it(stack: ProcessStack, tmp_path: Path) -> None:
    """With a small ``retain_bytes`` and a slow consumer, the stored features never pass the budget
    by more than one record's file, and every record is captured in the end."""
    capture_dir = tmp_path / "capture"
    capture_dir.mkdir()
    _fleet(stack, capture_dir)
    spec = tmp_path / "spec.yaml"
    budget = 150_000  # a few records' files (hidden 16, 4 layers: 136 B a token, up to 400 tokens)
    spec.write_text(f"features:\n  layers: [{JOB_LAYERS}]\n  retain_bytes: {budget}\n")
    job_id = submit_job(stack, "budget", 30, "--spec", str(spec))
    folder = tmp_path / "data" / "jobs" / job_id / "features"

    consumed: set[str] = set()
    peak = largest = 0
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while True:
        stored = {p.name: p.stat().st_size for p in folder.glob("*.safetensors")} if folder.exists() else {}
        peak = max(peak, sum(stored.values()))
        largest = max([largest, *stored.values()])
        job = get_job(stack, job_id)
        committed = [r["features_file"] for r in job_records(stack, job_id) if r["features_file"]]
        fresh = [name for name in committed if name not in consumed]
        if job["state"] == "completed" and not fresh:
            break
        assert time.monotonic() < deadline, stack.logs()
        # A slow consumer: a few files a second.
        batch = fresh[:3]
        if batch:
            reply = httpx.post(
                f"{stack.coordinator}/jobs/{job_id}/features/consume", json={"files": batch}, timeout=5
            )
            assert reply.status_code == 200, reply.text
            consumed.update(batch)
        time.sleep(0.3)

    assert peak <= budget + largest, (peak, budget, largest)
    assert get_job(stack, job_id)["features_retained_bytes"] == 0
    records = job_records(stack, job_id)
    assert len(records) == 30 and all(r["features_file"] for r in records)
    assert get_job(stack, job_id)["done"] == 30
    # What was consumed is gone, and the budget's counter is back to nothing retained.
    assert not list(folder.glob("*.safetensors"))
    again = httpx.post(
        f"{stack.coordinator}/jobs/{job_id}/features/consume", json={"files": batch}, timeout=5
    )
    assert again.json() == {"removed": 0, "bytes": 0, "retained_bytes": 0}


def test_consume_refuses_what_is_no_feature_file(stack: ProcessStack) -> None:
    gen = stack.spawn_sim("gen", "--time-scale", "0.01")
    start_worker(stack, "worker", f"gen={gen}")
    job_id = submit_job(stack, "plain", 1)
    url = f"{stack.coordinator}/jobs/{job_id}/features/consume"
    bad = httpx.post(url, json={"files": ["../manifest.json"]}, timeout=5)
    assert bad.status_code == 422 and "features_file" in bad.text, bad.text
    assert httpx.post(url, json={"files": []}, timeout=5).json()["removed"] == 0
    missing = httpx.post(
        f"{stack.coordinator}/jobs/nosuchjob/features/consume", json={"files": []}, timeout=5
    )
    assert missing.status_code == 404


def test_a_capture_server_restart_loses_and_duplicates_nothing(stack: ProcessStack, tmp_path: Path) -> None:
    capture_dir = tmp_path / "capture"
    capture_dir.mkdir()
    gen = stack.spawn_sim("gen", "--time-scale", "0.01")
    port = free_port()
    cap_args = (
        *("sim", "--port", str(port), "--tokenizer", bundled_tokenizer_path(), "--api", "vllm"),
        *("--time-scale", "0.01", "--capture-dir", str(capture_dir), "--capture-write-delay-ms", "100"),
        *("--capture-layers", ",".join(map(str, LAYERS)), "--capture-num-layers", "9"),
        *("--capture-hidden-size", str(HIDDEN)),
    )
    cap = f"http://127.0.0.1:{port}"
    server = stack.spawn("cap", *cap_args)
    stack.wait_http(f"{cap}/health")
    _worker(stack, "worker", gen, cap, capture_dir, env={"DATAGEN_CAPTURE_ORPHAN_AGE_S": "1"})
    job_id = submit_job(stack, "restarted", 40, "--features-layers", JOB_LAYERS)
    wait_until(lambda: get_job(stack, job_id)["done"] >= 5, 60, "some records", on_timeout=stack.logs)

    # Killed with captures in flight (files promised, locks held): the restarted server writes none
    # of them, so those tries fail and are sent again.
    server.send_signal(signal.SIGKILL)
    server.wait(10)
    time.sleep(1.0)
    stack.spawn("cap", *cap_args)  # the same name replaces the killed process
    stack.wait_http(f"{cap}/health")
    _completed(stack, job_id, timeout_s=180)

    assert len(_records_by_key(stack, job_id)) == 40
    assert all(r["features_file"] for r in job_records(stack, job_id))
    out = tmp_path / "export"
    _export(stack, job_id, out)
    assert _check_export(out, "bf16") == 40
    # The killed server's locks are swept by age.
    assert wait_until(
        lambda: _left_in(capture_dir) == [], 30, "the capture directory to empty", on_timeout=stack.logs
    )


def _refusal(stack: ProcessStack, name: str) -> str:
    def refused() -> str | None:
        servers = httpx.get(f"{stack.coordinator}/servers", timeout=5).json()["servers"]
        entry = next((s for s in servers if s["name"] == name), None)
        if not entry or entry["state"] != "refused":
            return None
        # One reason per worker that refused it.
        return " ".join(entry["refused"].values())

    return wait_until(refused, 60, f"server {name} to be refused", on_timeout=stack.logs)


def test_a_capture_server_that_cannot_capture_is_refused_with_what_to_fix(
    stack: ProcessStack, tmp_path: Path
) -> None:
    capture_dir = tmp_path / "capture"
    capture_dir.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    gen = stack.spawn_sim("gen", "--time-scale", "0.01")
    plain = stack.spawn_sim("plain", "--api", "vllm", "--time-scale", "0.01")
    moved = _capture_sim(stack, elsewhere, name="moved")
    options = ("--capture-server", f"plain={plain}", "--capture-server", f"moved={moved}")
    start_worker(stack, "worker", f"gen={gen}", *options, "--capture-dir", str(capture_dir))

    # A vLLM server launched without capture: the flags it lacks.
    plain_reason = _refusal(stack, "plain")
    assert "--speculative-config" in plain_reason and "extract_hidden_states" in plain_reason
    assert "--kv-transfer-config" in plain_reason
    # A server writing into another folder than --capture-dir: the directory to give.
    moved_reason = _refusal(stack, "moved")
    assert "not in --capture-dir" in moved_reason and "shared_storage_path" in moved_reason
    # With no capture server accepted, a job with features is refused at submit.
    result = submit_job_result(stack, "refused", 2, "--features-layers", JOB_LAYERS)
    assert result.returncode != 0 and "capture server" in result.stderr, result.stderr


def test_declared_layer_ids_keep_a_job_with_other_layers_off_the_servers(
    stack: ProcessStack, tmp_path: Path
) -> None:
    """vLLM reports only how many layers it captures; --capture-layers declares which, so a job with
    as many but other layers is refused instead of getting the wrong ones."""
    capture_dir = tmp_path / "capture"
    capture_dir.mkdir()
    gen = stack.spawn_sim("gen", "--time-scale", "0.01")
    cap = _capture_sim(stack, capture_dir)
    declared = ("--capture-layers", ",".join(map(str, LAYERS)))
    start_worker(
        stack,
        "worker",
        f"gen={gen}",
        "--capture-server",
        f"cap={cap}",
        "--capture-dir",
        str(capture_dir),
        *declared,
    )
    stack.wait_server_up(stack.coordinator, "cap")

    other = submit_job_result(stack, "other", 2, "--features-layers", "1,5,8,9")
    assert other.returncode != 0
    assert "no capture server writes layers [1, 5, 8, 9]" in other.stderr, other.stderr
    assert "[2, 5, 8, 9]" in other.stderr
    job_id = submit_job(stack, "same", 2, "--features-layers", JOB_LAYERS)
    _completed(stack, job_id)
    assert all(r["features_file"] for r in job_records(stack, job_id))


def test_a_capture_only_job_captures_another_jobs_specforge_export(
    stack: ProcessStack, tmp_path: Path
) -> None:
    """Rows of token ids (here another job's specforge export) are captured as they are: nothing is
    generated, every record is its row, and a bad row is reported with its line while the rest go on."""
    capture_dir = tmp_path / "capture"
    capture_dir.mkdir()
    _fleet(stack, capture_dir)
    tokens_job = submit_job(stack, "tokens", 8)
    _completed(stack, tokens_job)
    lines = tmp_path / "specforge.jsonl"
    exported = stack.cli("export", tokens_job, "--format", "specforge", "--out", str(lines))
    assert exported.returncode == 0, exported.stdout + exported.stderr
    rows = [json.loads(line) for line in lines.read_text().splitlines()]
    assert len(rows) == 8
    bad = {"id": "bad", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 0]}
    lines.write_text(lines.read_text() + json.dumps(bad) + "\n")
    spec = tmp_path / "capture.yaml"
    spec.write_text(f"features:\n  layers: [{JOB_LAYERS}]\n  capture_only: true\n")

    submitted = stack.submit(lines, "--spec", str(spec), "--job-id", "caponly")
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    job = _completed(stack, "caponly")
    assert job["done"] == 8
    reply = httpx.get(f"{stack.coordinator}/jobs/caponly/errors", params={"kind": "rejected"}, timeout=5)
    (rejected,) = reply.json()["errors"]
    assert rejected["line"] == 9 and "one supervised span" in rejected["reason"], rejected

    records = job_records(stack, "caponly")
    assert {r["finish_type"] for r in records} == {"given"} and {r["server"] for r in records} == {""}
    out = tmp_path / "export"
    _export(stack, "caponly", out)
    assert _check_export(out, "bf16") == 8
    data = datasets.concatenate_datasets(
        [datasets.Dataset.from_file(str(path)) for path in sorted(out.glob("data-*.arrow"))]
    )
    given = sorted((r["input_ids"], r["loss_mask"]) for r in rows)
    assert sorted((row["input_ids"], row["loss_mask"]) for row in data) == given


def test_a_capture_dir_that_is_not_there_is_one_line(stack: ProcessStack, tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    result = stack.cli(
        *("worker", "--server", "gen=http://127.0.0.1:9", "--burst"),
        *("--capture-server", "cap=http://127.0.0.1:10", "--capture-dir", str(missing)),
        timeout_s=60,
    )
    assert result.returncode != 0
    assert f"--capture-dir {missing} is not a directory" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
