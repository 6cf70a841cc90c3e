"""Pickup: how soon a warm worker starts on a new job, from the submit returning to the first
``/generate`` request reaching the server (issue 12, target 3: at most 0.5 s).

A private Redis, one ``datagen sim`` (``--time-scale 1``: each request lasts about a second, so it is
seen while it runs), a ``datagen coordinator`` and a ``datagen worker`` run as child processes with
the production defaults (poll intervals included; ``--worker-env NAME=VALUE`` changes one). A warm-up
job runs to the end first, so the worker has loaded its tokenizer, opened its connections and gone
idle. Then, ``--repeats`` times: wait ``--idle-s`` (the worker idles as it would between jobs),
submit a job of ``--rows`` short prompts (cancelled once measured), and take the time from the
submit returning to the first moment the simulator holds a request (its ``sglang:num_queue_reqs`` +
``sglang:num_running_reqs``, which it sets as a request arrives, polled from a background thread
every ``--poll-ms``; the poll runs all along, so a request that arrives before the submit has
returned shows as a negative time).

The submit is ``POST /jobs`` through `datagen_cli.client.CoordinatorClient` (what ``datagen submit``
sends), or with ``--cli`` the ``datagen submit`` command itself as a child process (its own start-up
time then comes before the clock starts, as a user sees it: the command has returned).

Printed: each repeat's pickup and submit time, then the median and the max pickup against the
target. The time includes the coordinator's start of ingestion (its first chunk, `service.ingest`),
the worker's claim of the prompts, and its request to the server.

Run: ``python bench/pickup.py [--repeats 5] [--rows 64] [--idle-s 1.5] [--cli]``.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from _common import job_spec, offline_hub, short_rows, write_jsonl

from datagen.prompts.tokenization import bundled_tokenizer_path
from datagen.states import JobState, ServerState
from datagen_cli.client import CoordinatorClient
from datagen_cli.local.processes import ChildProcesses, child_env
from datagen_cli.local.redis_server import LocalRedis, free_port

TARGET_S = 0.5
SERVER = "sim"
MAX_NEW_TOKENS = 32  # about 0.7 s of decoding at --time-scale 1: long enough to be seen
SERVER_UP_TIMEOUT_S = 120.0
JOB_TIMEOUT_S = 120.0
ARRIVAL_TIMEOUT_S = 30.0
WAIT_POLL_S = 0.05
_GAUGE = re.compile(r"^sglang:num_(?:queue|running)_reqs\{[^}]*\}\s+(\S+)$", re.MULTILINE)


class ArrivalWatch:
    """Polls the simulator's gauges in a thread; ``first_at`` is the ``perf_counter`` reading of
    the first poll that found a request there since ``arm()``."""

    def __init__(self, sim_url: str, poll_s: float) -> None:
        self.url = f"{sim_url}/metrics"
        self.poll_s = poll_s
        self.first_at: float | None = None
        self._armed = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="arrival-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def arm(self) -> None:
        self.first_at = None
        self._armed.set()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def holding(self, client: httpx.Client) -> float:
        text = client.get(self.url, timeout=2.0).text
        return sum(float(v) for v in _GAUGE.findall(text))

    def _run(self) -> None:
        with httpx.Client() as client:
            while not self._stop.is_set():
                if self._armed.is_set() and self.holding(client) > 0:
                    self.first_at = time.perf_counter()
                    self._armed.clear()
                time.sleep(self.poll_s)


def _wait(what: str, timeout_s: float, check: Any, stack: ChildProcesses) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        stack.check_alive()
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}; see the logs in {stack.log_dir}")
        time.sleep(WAIT_POLL_S)
    return value


def _server_up(client: CoordinatorClient) -> bool:
    return any(s["name"] == SERVER and s["state"] == ServerState.UP for s in client.servers())


def _spec() -> dict[str, Any]:
    spec = job_spec(short_max_new_tokens=MAX_NEW_TOKENS, long_max_new_tokens=MAX_NEW_TOKENS)
    return spec.model_dump(mode="json", exclude_defaults=True)


def _submit(
    client: CoordinatorClient, dataset: Path, coordinator: str, env: dict[str, str], cli: bool
) -> str:
    if not cli:
        return str(client.submit(dataset, _spec())["id"])
    spec = _spec()
    options = ["--tokenizer", spec["tokenizer"], "--chat-template", spec["chat_template"]]
    options += ["--short-max-new-tokens", str(MAX_NEW_TOKENS), "--long-max-new-tokens", str(MAX_NEW_TOKENS)]
    result = subprocess.run(
        [sys.executable, "-m", "datagen_cli", "submit", str(dataset), *options],
        env={**env, "DATAGEN_COORDINATOR_URL": coordinator},
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise SystemExit(f"datagen submit failed:\n{result.stdout}\n{result.stderr}")
    return result.stdout.strip().splitlines()[0]


def _finish(client: CoordinatorClient, job_id: str, stack: ChildProcesses) -> None:
    _wait(f"job {job_id} to end", JOB_TIMEOUT_S, lambda: client.job(job_id)["state"] in _ENDED, stack)


_ENDED = {JobState.COMPLETED.value, JobState.FAILED.value, JobState.CANCELLED.value}


def run(args: argparse.Namespace) -> list[tuple[float, float]]:
    offline_hub()
    with tempfile.TemporaryDirectory(prefix="pickup-") as tmp_dir:
        return _run(args, Path(tmp_dir))


def _run(args: argparse.Namespace, tmp: Path) -> list[tuple[float, float]]:
    sim_port, coord_port = free_port(), free_port()
    sim_url, coordinator = f"http://127.0.0.1:{sim_port}", f"http://127.0.0.1:{coord_port}"
    results: list[tuple[float, float]] = []
    with LocalRedis() as redis_server:
        env = child_env(
            {
                "DATAGEN_REDIS_URL": redis_server.url,
                "DATAGEN_STORAGE": str(tmp / "data"),
                "DATAGEN_NAMESPACE": "pickup",
            }
        )
        worker_env = dict(env, DATAGEN_METRICS_PORT="0", **dict(kv.split("=", 1) for kv in args.worker_env))
        stack = ChildProcesses(tmp, env)
        watch = ArrivalWatch(sim_url, args.poll_ms / 1000)
        try:
            sim = (
                "sim",
                "--port",
                str(sim_port),
                "--tokenizer",
                bundled_tokenizer_path(),
                "--time-scale",
                "1",
            )
            stack.spawn("sim", *sim)
            stack.spawn("coordinator", "coordinator", "--port", str(coord_port))
            stack.env = worker_env
            stack.spawn("worker", "worker", "--server", f"{SERVER}={sim_url}")
            stack.wait_http(f"{sim_url}/health")
            stack.wait_http(f"{coordinator}/healthz")
            with CoordinatorClient(coordinator) as client:
                _wait("the worker to take the server", SERVER_UP_TIMEOUT_S, lambda: _server_up(client), stack)
                warmup = tmp / "warmup.jsonl"
                write_jsonl(warmup, short_rows(8))
                _finish(client, _submit(client, warmup, coordinator, env, cli=False), stack)
                watch.start()
                for i in range(args.repeats):
                    dataset = tmp / f"job{i}.jsonl"
                    write_jsonl(dataset, [dict(r, id=f"j{i}-{r['id']}") for r in short_rows(args.rows)])
                    with httpx.Client() as metrics_client:
                        _wait(
                            "the server to be idle",
                            JOB_TIMEOUT_S,
                            lambda: watch.holding(metrics_client) == 0,
                            stack,
                        )
                    time.sleep(args.idle_s)
                    watch.arm()
                    started = time.perf_counter()
                    job_id = _submit(client, dataset, coordinator, env, args.cli)
                    returned = time.perf_counter()
                    _wait("the first request at the server", ARRIVAL_TIMEOUT_S, lambda: watch.first_at, stack)
                    assert watch.first_at is not None
                    pickup_s, submit_s = watch.first_at - returned, returned - started
                    results.append((pickup_s, submit_s))
                    print(
                        f"repeat {i + 1}: pickup {pickup_s:+.3f} s (submit took {submit_s:.3f} s)", flush=True
                    )
                    # Only the start is measured: a big job is cancelled rather than run to the end.
                    client.cancel(job_id, abort_in_flight=True)
                    _finish(client, job_id, stack)
        finally:
            watch.stop()
            stack.stop()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rows", type=int, default=64, help="prompts per measured job")
    parser.add_argument("--idle-s", type=float, default=1.5, help="idle time before each submit")
    parser.add_argument(
        "--poll-ms", type=float, default=2.0, help="how often the simulator's gauges are read"
    )
    parser.add_argument("--cli", action="store_true", help="submit with the `datagen submit` command")
    parser.add_argument("--worker-env", action="append", default=[], metavar="NAME=VALUE")
    args = parser.parse_args()
    results = run(args)
    pickups = [p for p, _ in results]
    median, worst = statistics.median(pickups), max(pickups)
    how = "datagen submit" if args.cli else "POST /jobs"
    verdict = "met" if worst <= TARGET_S else "NOT met"
    print(
        f"pickup over {len(pickups)} repeats ({how}): median {median:.3f} s, max {worst:.3f} s; "
        f"target <= {TARGET_S} s: {verdict}"
    )
    print(f"submit itself: median {statistics.median(s for _, s in results):.3f} s")


if __name__ == "__main__":
    main()
