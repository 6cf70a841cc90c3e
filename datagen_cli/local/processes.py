"""``python -m datagen_cli …`` child processes with their output in log files, stopped together: what the
demo, the tests and the benchmarks run a whole stack with."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import httpx

from datagen.errors import ConfigError
from datagen.settings import ENV_PREFIX

__all__ = ["ChildProcesses", "child_env"]

STARTUP_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0
HTTP_POLL_S = 0.1


def child_env(values: dict[str, str]) -> dict[str, str]:
    """This process's environment without its ``DATAGEN_*`` variables, plus ``values``; offline for
    Hugging Face (the tokenizer is a local path)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    env.update(values, HF_HUB_OFFLINE="1")
    return env


class ChildProcesses:
    """Child processes by name, each logging to ``log_dir/<name>.log``; ``stop()`` ends them all."""

    def __init__(self, log_dir: Path, env: dict[str, str], *, stop_timeout_s: float = STOP_TIMEOUT_S) -> None:
        self.log_dir = log_dir
        self.env = env
        self.stop_timeout_s = stop_timeout_s
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list[IO[bytes]] = []

    def spawn(self, name: str, *args: str, clock_offset_s: float = 0.0) -> subprocess.Popen[bytes]:
        """``python -m datagen_cli ARGS`` as ``name`` (a name spawned again replaces the earlier one);
        ``clock_offset_s``: with its wall clock that far off (`datagen_cli.local.skew`)."""
        log = open(self.log_dir / f"{name}.log", "wb")  # noqa: SIM115 - closed in stop()
        self._logs.append(log)
        skew = ["datagen_cli.local.skew", str(clock_offset_s)] if clock_offset_s else []
        command = [sys.executable, "-m", *skew, "datagen_cli", *args]
        self.procs[name] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        return self.procs[name]

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def check_alive(self) -> None:
        """Raise `ConfigError` naming the first process that exited, and its log."""
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise ConfigError(f"{name} exited with code {proc.returncode}; see {self.log_path(name)}")

    def wait_http(self, url: str, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Until ``url`` answers 200; `ConfigError` when a process exits first or time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                if httpx.get(url, timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(HTTP_POLL_S)
        raise ConfigError(f"{url} did not come up within {timeout_s:.0f} s; see the logs in {self.log_dir}")

    def stop(self) -> None:
        """Terminate every process still running (the last started first), kill those that outlast
        ``stop_timeout_s``, and close the logs."""
        procs = list(self.procs.values())
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + self.stop_timeout_s
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in self._logs:
            log.close()
