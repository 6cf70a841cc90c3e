"""The first hour of a new operator, over real processes (issue 14, items 2-5).

- Several workers on one host without ``--metrics-port``: each takes the next free metrics port
  and publishes it in ``GET /servers``; an explicit port that is taken fails in one line.
- A worker and a coordinator started before Redis wait for it (one log line per try) and then
  run a job; a startup timeout is one line.
- ``datagen submit`` right after a worker starts waits for the worker to report its server and
  the job runs; with nothing to wait for, the refusal is one line that says what to fix.
- Every expected failure of every command is one short ``error:`` line without a traceback;
  ``--debug`` shows the traceback. No third-party notice reads like an error.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from datagen.errors import ConfigError
from datagen.prompts.tokenization import bundled_tokenizer_path, default_chat_template_path
from datagen_cli.local.processes import child_env
from datagen_cli.local.redis_server import LocalRedis, free_port
from tests.support.processes import ProcessStack, coordinator_stack, interruptible
from tests.support.wait import wait_until

pytestmark = pytest.mark.e2e

NS = "firsthour"
PROMPTS = 6
MAX_NEW = "64"
# An error a user meets is this many lines at most (rich never wraps it: soft_wrap).
MAX_ERROR_LINES = 1
TORCH_NOTICE = "PyTorch was not found"
HTTP_TIMEOUT_S = 5.0
UP_TIMEOUT_S = 60.0


def _dataset(tmp: Path, name: str) -> Path:
    path = tmp / f"{name}.jsonl"
    rows = [
        {"id": f"{name}{i}", "messages": [{"role": "user", "content": f"{name} {i}"}]} for i in range(PROMPTS)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _submit_args(dataset: Path, *options: str) -> list[str]:
    """``submit`` without a context length: the pre-flight checks need a worker's report."""
    return [
        "submit", str(dataset),
        "--tokenizer", bundled_tokenizer_path(), "--chat-template", str(default_chat_template_path()),
        "--short-max-new-tokens", MAX_NEW, "--seed", "5", *options,
    ]  # fmt: skip


def _run(env: dict[str, str], *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "datagen_cli", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def _assert_one_line_error(result: subprocess.CompletedProcess[str], *needles: str, code: int = 3) -> str:
    """The failure is exit ``code`` and one ``error:`` line holding each of ``needles``; no traceback."""
    output = result.stdout + result.stderr
    assert result.returncode == code, output
    assert "Traceback" not in output, output
    errors = _error_lines(result.stderr)
    assert len(errors) == MAX_ERROR_LINES, output
    for needle in needles:
        assert needle in errors[0], output
    return errors[0]


def _spawn_sim(stack: ProcessStack, name: str, *options: str) -> str:
    """A simulator, not waited for (``spawn_sim`` waits until it is healthy)."""
    port = free_port()
    stack.spawn(name, "sim", "--port", str(port), "--tokenizer", bundled_tokenizer_path(), *options)
    return f"http://127.0.0.1:{port}"


def _servers(coordinator: str) -> list[dict[str, Any]]:
    servers: list[dict[str, Any]] = httpx.get(f"{coordinator}/servers", timeout=HTTP_TIMEOUT_S).json()[
        "servers"
    ]
    return servers


def _no_tracebacks(stack: ProcessStack) -> None:
    for log in stack.log_dir.glob("*.log"):
        text = log.read_text(errors="replace")
        assert "Traceback" not in text, f"{log.name}:\n{text[-3000:]}"
        assert TORCH_NOTICE not in text, f"{log.name}:\n{text[-3000:]}"


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[ProcessStack]:
    with coordinator_stack(tmp_path, NS, {"COLUMNS": "80"}) as stack:
        yield stack


# -- item 2: several workers per host ---------------------------------------------------------


def test_two_workers_on_one_host_take_their_own_metrics_ports(stack: ProcessStack) -> None:
    sim = stack.spawn_sim("sim")
    del stack.env["DATAGEN_METRICS_PORT"]  # the default, as an operator starts them
    for name in ("worker-a", "worker-b"):
        stack.spawn(name, "worker", "--server", f"sim={sim}")

    def published() -> list[dict[str, Any]] | None:
        stack.check_alive()
        views = [w for s in _servers(stack.coordinator) for w in s["workers"] if not w["stale"]]
        return views if len(views) == 2 and all(v.get("metrics") for v in views) else None

    views = wait_until(published, UP_TIMEOUT_S, "two workers publishing their metrics", on_timeout=stack.logs)
    ports = sorted(int(v["metrics"].rsplit(":", 1)[1]) for v in views)
    assert ports[0] != ports[1] and ports[0] >= 9400, views
    assert all(v["metrics"].rsplit(":", 1)[0] == socket.gethostname() for v in views)
    for port in ports:  # each serves its own metrics, as Prometheus scrapes them
        page = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=HTTP_TIMEOUT_S).text
        assert "datagen_" in page
    status = stack.cli("status")
    assert status.returncode == 0 and all(f":{port}" in status.stdout for port in ports), status.stdout
    # A port named explicitly is that port, or one line naming the flag.
    taken = _run(stack.env, "worker", "--server", f"sim={sim}", "--metrics-port", str(ports[0]))
    _assert_one_line_error(taken, f"metrics port {ports[0]} is in use", "--metrics-port")
    stack.check_alive()
    _no_tracebacks(stack)


# -- item 3: started before Redis ---------------------------------------------------------------


def test_worker_and_coordinator_started_before_redis_wait_for_it(tmp_path: Path) -> None:
    redis_port, coordinator_port = free_port(), free_port()
    env = child_env(
        {
            "DATAGEN_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0",
            "DATAGEN_STORAGE": str(tmp_path / "data"),
            "DATAGEN_NAMESPACE": NS,
            "DATAGEN_METRICS_PORT": "0",
            "DATAGEN_CONTROL_INTERVAL_S": "0.2",
            "DATAGEN_COMMIT_INTERVAL_S": "0.2",
            "DATAGEN_COORDINATOR_URL": f"http://127.0.0.1:{coordinator_port}",
        }
    )
    stack = ProcessStack(tmp_path, env)
    redis_server = LocalRedis(port=redis_port)
    try:
        sim = stack.spawn_sim("sim")
        stack.spawn("coordinator", "coordinator", "--port", str(coordinator_port))
        stack.spawn("worker", "worker", "--server", f"sim={sim}")

        def both_waiting() -> bool:
            stack.check_alive()
            logs = [stack.log_path(name).read_text(errors="replace") for name in ("coordinator", "worker")]
            return all(log.count("waiting for Redis at") >= 2 for log in logs)

        wait_until(both_waiting, UP_TIMEOUT_S, "both to wait for Redis", on_timeout=stack.logs)
        _start_on_its_port(redis_server)
        stack.wait_http(f"http://127.0.0.1:{coordinator_port}/healthz")
        stack.wait_server_up(stack.env["DATAGEN_COORDINATOR_URL"], "sim", UP_TIMEOUT_S)
        result = stack.cli(*_submit_args(_dataset(tmp_path, "late"), "--wait"))
        assert result.returncode == 0, result.stdout + result.stderr + stack.logs()
        for name in ("coordinator", "worker"):
            log = stack.log_path(name).read_text(errors="replace")
            waits = [line for line in log.splitlines() if "waiting for Redis at" in line]
            assert all("(try " in line and "next in" in line for line in waits), waits
            assert "is available (after" in log
        _no_tracebacks(stack)
    finally:
        stack.stop()
        redis_server.stop()


def test_a_startup_that_times_out_is_one_line(tmp_path: Path) -> None:
    env = child_env(
        {
            "DATAGEN_REDIS_URL": f"redis://user:hunter2@127.0.0.1:{free_port()}/0",
            "DATAGEN_STORAGE": str(tmp_path / "data"),
            "DATAGEN_STARTUP_TIMEOUT_S": "1",
            "DATAGEN_METRICS_PORT": "0",
        }
    )
    for args in (["coordinator", "--port", "0"], ["worker", "--server", "s=http://127.0.0.1:9"]):
        result = _run(env, *args)
        line = _assert_one_line_error(result, "is still unavailable after 1 s", "DATAGEN_REDIS_URL")
        assert "hunter2" not in result.stderr and "user:***@" in line
        # Each failed try is one log line; nothing else is printed.
        others = [x for x in result.stderr.splitlines() if not x.startswith("error:")]
        assert others and all("waiting for Redis at" in x for x in others), result.stderr


# -- item 4: submit right after the workers start ---------------------------------------------


def test_submit_right_after_starting_a_worker_waits_for_its_server(stack: ProcessStack) -> None:
    # No worker at all: the refusal names the fix, after the (short) wait.
    dataset = _dataset(stack.tmp, "early")
    refused = stack.cli(*_submit_args(dataset, "--wait-for-servers-s", "1"))
    _assert_one_line_error(
        refused, "the context length is unknown", "set context_len", "--wait-for-servers-s"
    )
    assert "waiting for a worker" in refused.stderr  # what it waited for, said while waiting
    # A simulator that answers /health 503 for a while: the worker cannot report it at once.
    sim = _spawn_sim(stack, "sim", "--starting-s", "3")
    stack.spawn("worker", "worker", "--server", f"sim={sim}")
    started = time.monotonic()
    result = stack.cli(*_submit_args(dataset, "--job-id", "early", "--wait"))
    assert result.returncode == 0, result.stdout + result.stderr + stack.logs()
    assert result.stdout.strip() == "early"
    assert "waiting for a worker to report a server's context length" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert time.monotonic() - started >= 2.0  # it did wait for the worker
    job = httpx.get(f"{stack.coordinator}/jobs/early", timeout=HTTP_TIMEOUT_S).json()
    assert job["done"] == PROMPTS, job
    # The coordinator loaded the tokenizer (its log is checked below); so does `report`, here.
    report = stack.cli("report", "early")
    assert report.returncode in (0, 1) and "Traceback" not in report.stderr, report.stderr
    assert TORCH_NOTICE not in report.stdout + report.stderr
    _no_tracebacks(stack)


# -- the traceback sweep ------------------------------------------------------------------------


def test_expected_failures_against_a_running_stack_are_one_line(stack: ProcessStack) -> None:
    env = stack.env
    dataset = _dataset(stack.tmp, "bad")
    missing = str(stack.tmp / "no-such-tokenizer")
    result = _run(env, "submit", str(dataset), "--tokenizer", missing, "--context-len", "4096")
    _assert_one_line_error(result, "no-such-tokenizer")
    taken = stack.coordinator.rsplit(":", 1)[1]
    _assert_one_line_error(_run(env, "coordinator", "--port", taken), f"port {taken}", "--port")
    _assert_one_line_error(_run(env, "pause", "--server", "nope"), "no worker has reported a server named")
    _assert_one_line_error(_run(env, "export", "nojob", "--out", str(stack.tmp / "x.jsonl")), "no job nojob")
    _assert_one_line_error(_run(env, "report", "nojob"), "no job nojob")
    not_a_dir = stack.tmp / "a-file"
    not_a_dir.write_text("")
    storage = dict(env, DATAGEN_STORAGE=str(not_a_dir / "data"), DATAGEN_STARTUP_TIMEOUT_S="30")
    _assert_one_line_error(_run(storage, "coordinator", "--port", "0"), "DATAGEN_STORAGE")
    _no_tracebacks(stack)


@pytest.mark.parametrize(
    ("args", "env", "code", "needles"),
    [
        (["worker", "--short-concurrency", "many"], {}, 2, ["--short-concurrency", "--help"]),
        (["worker", "--server", "s=http://h:1", "--metrics-port", "70000"], {}, 3, ["--metrics-port=70000"]),
        (["worker", "--server", "s=http://h:1"], {"DATAGEN_LOG_LEVEL": "loud"}, 3, ["DATAGEN_LOG_LEVEL"]),
        (["worker", "--server", "s=http://h:1"], {"DATAGEN_REDIS_URL": ""}, 3, ["DATAGEN_REDIS_URL"]),
        (["worker", "--server", "s=http://h:1"], {"DATAGEN_REDIS_URL": "http://x"}, 3, ["DATAGEN_REDIS_URL"]),
        (["worker"], {}, 3, ["--server"]),
        (["coordinator", "--port", "0"], {"DATAGEN_REDIS_ULR": "x"}, 3, ["DATAGEN_REDIS_ULR"]),
        (["status"], {}, 3, ["cannot reach the coordinator", "DATAGEN_COORDINATOR_URL"]),
        (["cancel", "j"], {}, 3, ["cannot reach the coordinator"]),
        (["submit", "/no/such.jsonl"], {}, 2, ["does not exist"]),
        (["sim", "--time-scale", "-1"], {}, 3, ["--time-scale"]),
        (["no-such-command"], {}, 2, ["No such command"]),
    ],
)
def test_cli_failures_without_a_stack_are_one_line(
    tmp_path: Path, args: list[str], env: dict[str, str], code: int, needles: list[str]
) -> None:
    base = child_env(
        {
            "DATAGEN_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",
            "DATAGEN_STORAGE": str(tmp_path / "data"),
            "DATAGEN_COORDINATOR_URL": f"http://127.0.0.1:{free_port()}",
            "DATAGEN_STARTUP_TIMEOUT_S": "1",
            "DATAGEN_WAIT_FOR_SERVERS_S": "0",
            "DATAGEN_METRICS_PORT": "0",
            "COLUMNS": "80",
        }
    )
    base.update(env)
    if base["DATAGEN_REDIS_URL"] == "":
        del base["DATAGEN_REDIS_URL"]
    _assert_one_line_error(_run(base, *args), *needles, code=code)


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    env = child_env({"DATAGEN_COORDINATOR_URL": f"http://127.0.0.1:{free_port()}"})
    result = _run(env, "--debug", "status")
    assert result.returncode != 0 and "Traceback" in result.stderr
    assert "Traceback" in _run(dict(env, DATAGEN_LOG_LEVEL="debug"), "status").stderr


def test_ctrl_c_is_quiet(tmp_path: Path) -> None:
    env = child_env(
        {
            "DATAGEN_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",
            "DATAGEN_STORAGE": str(tmp_path / "data"),
            "DATAGEN_COORDINATOR_URL": f"http://127.0.0.1:{free_port()}",
            "DATAGEN_METRICS_PORT": "0",
        }
    )
    dataset = _dataset(tmp_path, "interrupted")
    waiting = {
        "worker": (["worker", "--server", "s=http://127.0.0.1:9"], "waiting for Redis"),
        "coordinator": (["coordinator", "--port", "0"], "waiting for Redis"),
        "submit": (_submit_args(dataset), "waiting for the coordinator"),
    }
    for args, sign in waiting.values():
        proc = subprocess.Popen(
            interruptible([sys.executable, "-m", "datagen_cli", *args]),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stderr is not None
            line = proc.stderr.readline()
            while line and sign not in line:
                line = proc.stderr.readline()
            assert sign in line, args
            proc.send_signal(signal.SIGINT)
            _, rest = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == 130, (args, rest)
        assert "Traceback" not in rest and "error:" not in rest, (args, rest)


def _start_on_its_port(redis_server: LocalRedis, tries: int = 5) -> None:
    """Start Redis on the port the processes already dial. Their dialing can hold that very port for
    a moment (a loopback connect given the port it dials as its own source port), so a failed start
    is tried again."""
    for attempt in range(tries):
        try:
            redis_server.start()
            return
        except ConfigError:
            if attempt == tries - 1:
                raise
            time.sleep(0.5)
