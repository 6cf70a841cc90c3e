"""``--config FILE`` of ``coordinator``, ``worker`` and ``sim`` (issue 39), over real child processes:
the file's values are used; the environment wins over the file and a flag over both; an unknown key
is refused in one line naming it and the file, with the exit code of a usage error."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from datagen.records.layout import NAMESPACE_MARKER
from datagen_cli._app import EXIT_USAGE
from datagen_cli.local.processes import ChildProcesses, child_env
from datagen_cli.local.redis_server import LocalRedis, free_port

pytestmark = pytest.mark.e2e

STARTUP_TIMEOUT_S = 60.0
REFUSAL_TIMEOUT_S = 60.0


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[ChildProcesses]:
    processes = ChildProcesses(tmp_path, child_env({}))
    try:
        yield processes
    finally:
        processes.stop()


def _write(path: Path, values: dict[str, object]) -> Path:
    path.write_text(yaml.safe_dump(values, sort_keys=False))
    return path


def _namespace(storage: Path) -> str:
    namespace: str = json.loads((storage / NAMESPACE_MARKER).read_text())["namespace"]
    return namespace


def _listening(port: int) -> bool:
    try:
        httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1.0)
    except httpx.HTTPError:
        return False
    return True


def _logs(procs: ChildProcesses) -> str:
    return "\n".join(p.read_text(errors="replace") for p in procs.log_dir.glob("*.log"))


def test_coordinator_takes_its_settings_from_the_file(
    tmp_path: Path, redis_server: LocalRedis, procs: ChildProcesses
) -> None:
    port = free_port()
    storage = tmp_path / "data"
    # The three spellings of a key: a setting's name, its flag's, and its variable's.
    config = _write(
        tmp_path / "coordinator.yaml",
        {
            "redis-url": redis_server.url,
            "DATAGEN_STORAGE": str(storage),
            "port": port,
            "namespace": "fromfile",
        },
    )
    procs.spawn("coordinator", "coordinator", "--config", str(config))
    procs.wait_http(f"http://127.0.0.1:{port}/healthz", STARTUP_TIMEOUT_S)
    assert _namespace(storage) == "fromfile"


def test_environment_wins_over_the_file_and_a_flag_over_both(
    tmp_path: Path, redis_server: LocalRedis, procs: ChildProcesses
) -> None:
    file_port, env_port, flag_port = free_port(), free_port(), free_port()
    storage = tmp_path / "data"
    config = _write(
        tmp_path / "coordinator.yaml",
        {"redis_url": redis_server.url, "storage": str(storage), "port": file_port, "namespace": "fromfile"},
    )
    procs.env.update(DATAGEN_NAMESPACE="fromenv", DATAGEN_PORT=str(env_port))
    procs.spawn("coordinator", "coordinator", "--config", str(config), "--port", str(flag_port))
    procs.wait_http(f"http://127.0.0.1:{flag_port}/healthz", STARTUP_TIMEOUT_S)
    assert _namespace(storage) == "fromenv"
    assert not _listening(file_port)
    assert not _listening(env_port)


def test_sim_takes_its_flags_from_the_file_and_the_command_line_wins(
    tmp_path: Path, procs: ChildProcesses
) -> None:
    port = free_port()
    config = _write(
        tmp_path / "sim.yaml",
        {"port": free_port(), "kv-tokens": 5000, "context_len": 1024, "time_scale": 0},
    )
    procs.spawn("sim", "sim", "--config", str(config), "--port", str(port))
    procs.wait_http(f"http://127.0.0.1:{port}/health", STARTUP_TIMEOUT_S)
    info = httpx.get(f"http://127.0.0.1:{port}/server_info", timeout=5).json()
    assert (info["max_total_num_tokens"], info["context_length"], info["port"]) == (5000, 1024, port)


def test_worker_takes_its_servers_and_burst_from_the_file(
    tmp_path: Path, redis_server: LocalRedis, procs: ChildProcesses
) -> None:
    sim_port = free_port()
    procs.spawn("sim", "sim", "--port", str(sim_port), "--time-scale", "0")
    procs.wait_http(f"http://127.0.0.1:{sim_port}/health", STARTUP_TIMEOUT_S)
    config = _write(
        tmp_path / "worker.yaml",
        {
            "redis_url": redis_server.url,
            "storage": str(tmp_path / "data"),
            "namespace": "workerfile",
            "server": [f"sim=http://127.0.0.1:{sim_port}"],
            "burst": True,
            "metrics-port": 0,
        },
    )
    # Without the file's server it would refuse to start; without its burst it would never exit.
    worker = procs.spawn("worker", "worker", "--config", str(config))
    assert worker.wait(timeout=STARTUP_TIMEOUT_S) == 0, _logs(procs)
    assert _namespace(tmp_path / "data") == "workerfile"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "datagen_cli", *args],
        env=child_env({}),
        capture_output=True,
        text=True,
        timeout=REFUSAL_TIMEOUT_S,
    )


@pytest.mark.parametrize("command", ["coordinator", "worker", "sim"])
def test_an_unknown_key_is_refused_in_one_line(tmp_path: Path, command: str) -> None:
    config = _write(tmp_path / "typo.yaml", {"redis_ulr": "redis://127.0.0.1:1/0"})
    result = _run(command, "--config", str(config))
    assert result.returncode == EXIT_USAGE, result.stderr
    [line] = result.stderr.splitlines()
    assert line.startswith("error: Invalid value for '--config': unknown key 'redis_ulr' in "), line
    assert str(config) in line


@pytest.mark.parametrize(
    ("command", "values", "fragment"),
    [
        (
            "coordinator",
            {"port": 1, "DATAGEN_PORT": 2},
            "'DATAGEN_PORT' in {path} sets what 'port' already sets",
        ),
        ("coordinator", {"namespace": ["a", "b"]}, "'namespace' in {path} must be one value"),
        ("worker", {"burst": "maybe"}, "'burst' in {path}: "),
        ("sim", {"port": "http"}, "'port' in {path}: "),
    ],
)
def test_a_bad_value_is_refused_in_one_line(
    tmp_path: Path, command: str, values: dict[str, object], fragment: str
) -> None:
    config = _write(tmp_path / "bad.yaml", values)
    result = _run(command, "--config", str(config))
    assert result.returncode == EXIT_USAGE, result.stderr
    [line] = result.stderr.splitlines()
    assert fragment.format(path=config) in line, line


def test_an_invalid_value_in_the_file_is_named_by_its_key_and_file(tmp_path: Path) -> None:
    config = _write(tmp_path / "coordinator.yaml", {"redis_url": "redis://127.0.0.1:1/0", "port": 70000})
    result = _run("coordinator", "--config", str(config))
    [line] = result.stderr.splitlines()
    assert f"port='70000' in {config}: Input should be less than or equal to 65535" in line, line
