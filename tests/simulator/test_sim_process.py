"""``datagen sim`` as operators run it: a child process that says where it listens and what it
serves, and stops at once on SIGTERM even with a request in flight, which it aborts (a restart
must not race it for the port)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from datagen_cli.local.processes import child_env
from tests.support.metrics import metric_value
from tests.support.wait import wait_until

STARTUP_TIMEOUT_S = 30.0
# How soon a simulator must be gone after SIGTERM (uvicorn's graceful shutdown alone waits for every
# request in flight): under 1 s is the aim, about 0.2 s measured alone; the rest is for a loaded host.
EXIT_WITHIN_S = 1.5
ADDRESS = re.compile(
    r"simulator listening on (http://127\.0\.0\.1:\d+): the (\w+) API \((\S+), /health, /metrics\)"
)


@contextmanager
def _sim(log_path: Path, *options: str) -> Iterator[subprocess.Popen[bytes]]:
    command = [sys.executable, "-m", "datagen_cli", "sim", "--port", "0", *options]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=child_env({}))
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _address(log_path: Path) -> re.Match[str]:
    return wait_until(
        lambda: ADDRESS.search(log_path.read_text("utf-8")),
        STARTUP_TIMEOUT_S,
        "the simulator's address line",
        on_timeout=lambda: log_path.read_text("utf-8"),
    )


def test_sim_logs_its_address_and_api_and_stops_at_once_on_sigterm(tmp_path: Path) -> None:
    log_path = tmp_path / "sim.log"
    with _sim(log_path, "--time-scale", "1") as proc:
        address = _address(log_path)
        url, api, route = address.groups()
        assert (api, route) == ("sglang", "/generate")
        assert "model sim/deepseek-r1, context length 32768" in log_path.read_text("utf-8")
        # A long generation in flight (about 40 s simulated): graceful shutdown would wait for it.
        answered: list[object] = []

        def generate() -> None:
            body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2000}}
            try:
                resp = httpx.post(f"{url}/generate", json=body, timeout=60)
            except httpx.TransportError as exc:
                answered.append(type(exc).__name__)
            else:
                answered.append((resp.status_code, resp.json()["meta_info"]["finish_reason"]["type"]))

        thread = threading.Thread(target=generate)
        thread.start()
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
        wait_until(
            lambda: metric_value(httpx.get(f"{url}/metrics", timeout=5).text, "sglang:num_running_reqs") == 1,
            10,
            "the generation never started",
        )
        sent_at = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
        took_s = time.monotonic() - sent_at
        thread.join(timeout=10)
    assert took_s < EXIT_WITHIN_S, f"took {took_s:.2f}s to exit"
    # Aborted at once, as SGLang's /abort_request ends a request, rather than waited for.
    assert answered == [(200, "abort")]
    said = log_path.read_text("utf-8")
    assert "ERROR" not in said and "Traceback" not in said, said


def test_sim_with_the_vllm_api_says_so(tmp_path: Path) -> None:
    log_path = tmp_path / "sim.log"
    with _sim(log_path, "--api", "vllm", "--time-scale", "0") as proc:
        _url, api, route = _address(log_path).groups()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
    assert (api, route) == ("vllm", "/v1/completions")
