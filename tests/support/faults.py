"""Harness of the fault-injection suite: a full stack of real processes, and the final-state check.

Every process is a ``python -m datagen_cli …`` child (or ``redis-server``) that a test can SIGKILL and
start again on the same port. Intervals are short (``FAST_ENV``) so that each case runs in well
under a minute on a 2-core machine; the RQ heartbeat TTL keeps its fixed 10 s grace
(``workers/claim/rqbridge.py``), which bounds how fast a dead worker's prompts can come back.

:func:`check_final_state` is what every case ends with: one record per accepted prompt after
deduplication, every record (duplicates included) token-exact against the simulator's
deterministic output, the job's counters agreeing with storage, nothing failed, and RQ's started
registry and intermediate lists empty. It reports the wasted generations (records beyond one per
prompt) for the case to bound.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis
from rq import Queue
from rq.registry import FailedJobRegistry, StartedJobRegistry

from datagen.control.keys import Keys
from datagen.export.rows import ExportStats, RowFilter, RowFilterOptions, filtered_batches
from datagen.prompts.tokenization import bundled_tokenizer_path, default_chat_template_path, get_renderer
from datagen.records.storage import Storage
from datagen.states import PromptClass
from datagen_cli.local.redis_server import LocalRedis, free_port
from simulator.model import SpecialIds, expected_output
from tests.support.processes import ProcessStack
from tests.support.specs import make_spec
from tests.support.wait import wait_until

__all__ = [
    "FAST_ENV",
    "POLL_S",
    "REAP_BUDGET_S",
    "FaultStack",
    "FinalState",
    "Sampler",
    "Sim",
    "all_records",
    "check_final_state",
    "rows_for",
]

# Short intervals for every process (DATAGEN_* settings, read at startup). The KV controller is
# off: it lowers a server's in-flight target when the simulator queues requests, and the cases
# need fixed limits to know how many prompts are in flight at a kill and where a retry is routed.
FAST_ENV = {
    "DATAGEN_KV_CONTROLLER": "false",
    "DATAGEN_HEARTBEAT_INTERVAL_S": "0.5",
    "DATAGEN_REAPER_INTERVAL_S": "0.5",
    "DATAGEN_HEALTH_INTERVAL_S": "0.2",
    "DATAGEN_HEALTH_TIMEOUT_S": "1",
    "DATAGEN_CONTROL_INTERVAL_S": "0.2",
    "DATAGEN_CONTROLLER_INTERVAL_S": "0.5",
    "DATAGEN_COMMIT_INTERVAL_S": "0.1",
    "DATAGEN_POLL_INTERVAL_S": "0.05",
    "DATAGEN_RETRY_BASE_S": "0.05",
    "DATAGEN_RETRY_MAX_S": "0.5",
    "DATAGEN_DRAIN_TIMEOUT_S": "5",
    "DATAGEN_METRICS_PORT": "0",
}
# The heartbeat TTL is three intervals plus a fixed 10 s grace (workers/claim/rqbridge.py); a reaper
# pass follows within one reaper interval, and a loaded 2-core machine adds some seconds.
HEARTBEAT_S = float(FAST_ENV["DATAGEN_HEARTBEAT_INTERVAL_S"])
REAPER_S = float(FAST_ENV["DATAGEN_REAPER_INTERVAL_S"])
REAP_BUDGET_S = int(3 * HEARTBEAT_S) + 10 + 2 * REAPER_S + 5
SEED = 7
POLL_S = 0.05
HTTP_TIMEOUT_S = 10.0


def rows_for(n: int, prefix: str = "q") -> list[dict[str, Any]]:
    """``n`` distinct one-turn rows (prompts of about 15 tokens once rendered)."""
    return [
        {"id": f"{prefix}{i}", "messages": [{"role": "user", "content": f"Question {i}: explain item {i}."}]}
        for i in range(n)
    ]


@dataclass
class Sim:
    """A ``datagen sim`` child process on a fixed port (it keeps the port across restarts)."""

    name: str
    port: int
    args: list[str]
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=HTTP_TIMEOUT_S).text


class FaultStack:
    """Redis, simulators, a coordinator and workers as child processes, for one test."""

    def __init__(
        self, tmp: Path, namespace: str, env: dict[str, str] | None = None, *, redis_aof: bool = False
    ) -> None:
        self.tmp = tmp
        self.namespace = namespace
        self.keys = Keys(namespace)
        self.redis_port = free_port()
        self.redis_dir = tmp / "redis"
        self.redis_dir.mkdir()
        self.redis_aof = redis_aof
        self.redis_server = self._new_redis()
        self.redis_server.start()
        self.redis = redis.Redis.from_url(self.redis_server.url)
        self.storage = Storage(tmp / "data")
        self.coordinator_port = free_port()
        self.coordinator_url = f"http://127.0.0.1:{self.coordinator_port}"
        values = dict(
            FAST_ENV,
            DATAGEN_REDIS_URL=self.redis_server.url,
            DATAGEN_STORAGE=str(tmp / "data"),
            DATAGEN_NAMESPACE=namespace,
            DATAGEN_COORDINATOR_URL=self.coordinator_url,
        )
        values.update(env or {})
        self.procs = ProcessStack(tmp, values)
        self.sims: dict[str, Sim] = {}
        self._spawned = Counter[str]()

    # Processes ----------------------------------------------------------------------------------
    def _new_redis(self) -> LocalRedis:
        return LocalRedis(port=self.redis_port, appendonly=self.redis_aof, data_dir=str(self.redis_dir))

    def spawn(self, name: str, *args: str, clock_offset_s: float = 0.0) -> subprocess.Popen[bytes]:
        """A child process (``clock_offset_s``: its wall clock that far off); a name used before
        gets a numbered log of its own."""
        self._spawned[name] += 1
        label = name if self._spawned[name] == 1 else f"{name}-{self._spawned[name]}"
        return self.procs.spawn(label, *args, clock_offset_s=clock_offset_s)

    def add_sim(self, name: str, *, time_scale: float, **flags: float) -> Sim:
        port = free_port()
        args = ["sim", "--port", str(port), "--tokenizer", bundled_tokenizer_path()]
        args += ["--time-scale", str(time_scale)]
        for flag, value in flags.items():
            args += [f"--{flag.replace('_', '-')}", str(value)]
        sim = Sim(name, port, args)
        self.sims[name] = sim
        self.start_sim(name)
        return sim

    def start_sim(self, name: str, *extra: str, wait_healthy: bool = True) -> Sim:
        sim = self.sims[name]
        sim.proc = self.spawn(f"sim-{name}", *sim.args, *extra)
        if wait_healthy:
            self.procs.wait_http(f"{sim.url}/health")
        return sim

    def kill(self, proc: subprocess.Popen[bytes] | None) -> None:
        assert proc is not None and proc.poll() is None, "the process to kill is not running"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        # Gone for good: ProcessStack.wait_http must not take it for a process that failed to start.
        for name, known in list(self.procs.procs.items()):
            if known is proc:
                del self.procs.procs[name]

    def start_coordinator(self) -> subprocess.Popen[bytes]:
        proc = self.spawn("coordinator", "coordinator", "--port", str(self.coordinator_port))
        self.procs.wait_http(f"{self.coordinator_url}/healthz")
        return proc

    def start_another_coordinator(self, *, clock_offset_s: float = 0.0) -> str:
        """A second coordinator of the same namespace, Redis and storage on a port of its own
        (``clock_offset_s``: its wall clock that far off); returns its URL."""
        port = free_port()
        self.spawn("coordinator-b", "coordinator", "--port", str(port), clock_offset_s=clock_offset_s)
        url = f"http://127.0.0.1:{port}"
        self.procs.wait_http(f"{url}/healthz")
        return url

    def start_worker(
        self, name: str, servers: list[str], *, concurrency: int, metrics_port: int = 0
    ) -> subprocess.Popen[bytes]:
        args = ["worker", "--short-concurrency", str(concurrency), "--metrics-port", str(metrics_port)]
        for server in servers:
            args += ["--server", f"{server}={self.sims[server].url}"]
        return self.spawn(name, *args)

    def kill_redis(self) -> None:
        assert self.redis_server.process is not None
        self.redis_server.process.kill()  # no shutdown, no final fsync
        self.redis_server.process.wait()

    def restart_redis(self) -> None:
        self.redis_server = self._new_redis().start()

    def stop(self) -> None:
        # A simulator holding hung requests would not finish a graceful shutdown; it keeps nothing.
        for sim in self.sims.values():
            if sim.proc is not None and sim.proc.poll() is None:
                sim.proc.kill()
                sim.proc.wait()
        self.procs.stop()
        self.redis.close()
        self.redis_server.stop()

    def logs(self) -> str:
        return self.procs.logs()

    # Coordinator API ----------------------------------------------------------------------------
    def submit(
        self,
        rows: list[dict[str, Any]],
        *,
        max_new_tokens: int,
        seed: int = SEED,
        job_id: str | None = None,
        **spec_fields: Any,
    ) -> str:
        """A job of ``rows``; ``spec_fields`` go into its spec (a recipe, samples)."""
        dataset = self.tmp / "dataset.jsonl"
        with open(dataset, "w", encoding="utf-8") as fh:
            for row in rows:
                fh.write(json.dumps(row) + "\n")
        # Every prompt is short; the seed makes the simulator's outputs reproducible here. Jobs are
        # submitted before workers start, so the spec gives the simulator's context length.
        spec = make_spec(
            short_max_new_tokens=max_new_tokens,
            long_threshold_tokens=100_000,
            sampling={"sampling_seed": seed},
            **spec_fields,
        )
        form = {"spec": json.dumps(spec)} if job_id is None else {"spec": json.dumps(spec), "job_id": job_id}
        with open(dataset, "rb") as fh:
            response = httpx.post(
                f"{self.coordinator_url}/jobs",
                data=form,
                files={"dataset": ("dataset.jsonl", fh, "application/jsonl")},
                timeout=120,
            )
        assert response.status_code == 202, response.text
        return str(response.json()["id"])

    def job(self, job_id: str) -> dict[str, Any]:
        response = httpx.get(f"{self.coordinator_url}/jobs/{job_id}", timeout=HTTP_TIMEOUT_S)
        assert response.status_code == 200, response.text
        return response.json()  # type: ignore[no-any-return]

    def wait_completed(self, job_id: str, timeout_s: float) -> float:
        """Until the job has completed; returns the seconds it took."""
        started = time.monotonic()
        wait_until(
            lambda: self.job(job_id)["state"] == "completed",
            timeout_s,
            "the job to complete",
            interval_s=POLL_S,
            on_timeout=lambda: f"{self.job(job_id)}\n{self.logs()}",
        )
        return time.monotonic() - started

    # Redis --------------------------------------------------------------------------------------
    def queues(self) -> list[Queue]:
        return [Queue(self.keys.queue_name(cls), connection=self.redis) for cls in PromptClass]

    def started_members(self) -> set[str]:
        return {
            m.decode()
            for q in self.queues()
            for m in self.redis.zrange(StartedJobRegistry(queue=q).key, 0, -1)
        }

    def started_by(self, pid: int) -> set[str]:
        """Started-registry members whose execution belongs to the worker process ``pid`` (the
        execution id of a member ``<rq id>:<execution id>`` is ``<pid>-<worker tag>``)."""
        return {m for m in self.started_members() if m.split(":", 1)[1].startswith(f"{pid}-")}


@dataclass
class FinalState:
    records: list[dict[str, Any]]
    unique: int
    wasted: int
    job: dict[str, Any]
    by_server: Counter[str] = field(default_factory=Counter)

    @property
    def max_attempts(self) -> int:
        return max(int(r["attempts"]) for r in self.records)


def all_records(storage: Storage, job_id: str) -> list[dict[str, Any]]:
    return [r for batch in storage.iter_record_batches(job_id) for r in batch.to_pylist()]


def check_final_state(
    stack: FaultStack,
    job_id: str,
    rows: list[dict[str, Any]],
    *,
    max_new_tokens: int,
    seed: int = SEED,
    label: str,
) -> FinalState:
    """Assert the end state every fault case must reach; print and return the figures first."""
    job = stack.job(job_id)
    records = all_records(stack.storage, job_id)
    first_per_key = RowFilter(RowFilterOptions(min_supervised_tokens=0), ExportStats())
    unique = [r for b in filtered_batches(stack.storage, job_id, first_per_key) for r in b.to_pylist()]
    state = FinalState(
        records, len(unique), len(records) - len(unique), job, Counter(r["server"] for r in records)
    )
    print(
        f"\n[{label}] prompts={len(rows)} state={job['state']} done={job['done']} failed={job['failed']} "
        f"records={len(records)} unique={len(unique)} wasted generations={state.wasted} "
        f"max attempts={state.max_attempts if records else 0} by server={dict(state.by_server)}"
    )
    if job["failed"]:
        failures = httpx.get(
            f"{stack.coordinator_url}/jobs/{job_id}/errors",
            params={"kind": "failed", "limit": 3},
            timeout=HTTP_TIMEOUT_S,
        ).json()["errors"]
        print(
            "  failed prompts (first 3):", *(f"  {f['reason']}: {f['message']}" for f in failures), sep="\n"
        )
    assert job["state"] == "completed", job
    assert (job["failed"], job["total"], job["rejected"]) == (0, len(rows), 0), job
    keys = [(r["sample_id"], r["turn"], r["gen"]) for r in unique]
    assert len(keys) == len(set(keys)), "the export kept two records of one prompt"
    assert sorted(k[0] for k in keys) == sorted(r["id"] for r in rows), "a prompt has no record"
    assert {(k[1], k[2]) for k in keys} == {(0, 0)}
    assert job["done"] == len(unique), f"done {job['done']} but {len(unique)} unique records"
    _check_tokens(records, rows, max_new_tokens=max_new_tokens, seed=seed)
    _check_rq_drained(stack)
    return state


def _check_tokens(
    records: list[dict[str, Any]], rows: list[dict[str, Any]], *, max_new_tokens: int, seed: int
) -> None:
    """Every record, duplicates included, is the rendered prompt plus the deterministic output."""
    renderer = get_renderer(bundled_tokenizer_path(), str(default_chat_template_path()), False, "{}")
    special = SpecialIds.from_tokenizer(renderer.tokenizer)
    expected: dict[str, tuple[list[int], Any]] = {}
    for row in rows:
        prompt_ids = renderer.render(row["messages"], None)
        output = expected_output(prompt_ids, max_new_tokens=max_new_tokens, seed=seed, special=special)
        expected[row["id"]] = (prompt_ids + output.output_ids, output.finish_reason["type"])
    for record in records:
        ids, finish = expected[record["sample_id"]]
        assert record["input_ids"] == ids, f"record of {record['sample_id']} is not token-exact"
        assert record["finish_type"] == finish, record["sample_id"]
        assert record["max_new_tokens"] == max_new_tokens


def _check_rq_drained(stack: FaultStack) -> None:
    for queue in stack.queues():
        assert StartedJobRegistry(queue=queue).get_job_count(cleanup=False) == 0, queue.name
        assert stack.redis.llen(queue.intermediate_queue_key) == 0, queue.name
        assert FailedJobRegistry(queue=queue).get_job_count(cleanup=False) == 0, queue.name
        assert queue.count == 0, queue.name


@dataclass
class Sampler:
    """Calls ``probe`` every ``interval_s`` in a thread, keeping (monotonic time, value) pairs."""

    probe: Callable[[], Any]
    interval_s: float = POLL_S
    samples: list[tuple[float, Any]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Sampler:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                value = self.probe()
            except (httpx.HTTPError, redis.RedisError, OSError):
                value = None
            self.samples.append((time.monotonic(), value))
            self._stop.wait(self.interval_s)
