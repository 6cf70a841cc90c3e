"""Many tenants: no job starves, and one more job costs the fleet nothing per prompt.

For each N of ``--n`` (default ``1,100,500,2000``) a fresh stack runs as child processes with the
production defaults: a private Redis, one ``datagen sim --time-scale 0`` (a near-instant server),
one ``datagen coordinator`` and one ``datagen worker``. A warm-up job runs first (the coordinator and
the worker load the tokenizer) and is deleted. Then:

1. N small jobs (``--small-prompts`` 3 prompts each, priority normal, weight 1): all but the last
   ``--probes`` (10, at most N/10) submitted from ``--threads`` 8 client threads (``POST /jobs``),
   then those one at a time (the latency of a submit alone while the others run; N=1: the one job).
2. Right after, one big job (``--big-prompts`` 1,500 prompts); its job hash is polled every
   ``--poll-ms`` 50 ms (one HMGET of ``dispatched``, ``done``, ``state``, straight from Redis:
   ``GET /jobs/{id}`` is an HTTP round trip and a dozen commands, see below) for the time from
   the submit returning to its first dispatch and to ``done >= 1``. Read afterwards: the gap from
   the big job's first prompt finishing at the worker (the earliest ``finished_at_ms`` of its
   records, the reply's arrival) to its first shard being committed (the earliest commit's
   ``committed_at_ms``, stamped as the shard is written), and to its first record being counted
   (the job's ``first_record_at_ms``, set by the ack that moves ``done`` from 0).
3. Until every prompt is committed (the worker's ``datagen_worker_records_committed_total``, which
   costs Redis nothing to read) and the big job is ``completed``. ``INFO commandstats`` and
   ``INFO cpu`` (``used_cpu_sys + used_cpu_user``) are read before the first submit, before the big
   submit and after the end: commands and Redis CPU per prompt for the whole run (÷ 3N + 1,500)
   and for the big job's phase (÷ 1,500; the small jobs still running then count in it), EVALSHA
   calls and µs per prompt, and the top commands per prompt. The benchmark's own HMGETs are taken
   out (``INFO`` itself is ignored). The figures include the coordinator's and the worker's
   background loops. At the end, what one ``GET /jobs/{id}`` costs Redis (40 calls on the idle
   stack, less the idle background measured over 2 s) and its latency.
4. ``GET /jobs`` latency over ``--list-requests`` 50 requests with all N+1 jobs present, for the
   default page and for ``limit=1000`` (the API's largest) on one kept-alive connection, and for
   the default page with a connection per request (``Connection: close``); the responses' sizes.
5. One more small job on the idle stack: its Redis commands and CPU from submit to its last record
   (less the idle background), per prompt, and its top commands: the cost of one more job at N.
   Then a second one, whose own commands MONITOR counts as ``tests/datagen/test_small_job_cost.py``
   does (what names the job; `tests.support.redis_monitor`): in the targets, against issue 41's
   60, less what the fleet's timers put there (a heartbeat, a window bucket's TTL), as that test
   holds them. The first figure, Redis's totals less an idle background that swings from 16 to 40
   commands a second, is printed beside it. After the targets, whether
   ``GET /jobs``'s p99 stays flat from the smallest N >= 300 to the largest (at most 1.5 times, or
   within 10 ms): a page costs O(page), not O(jobs).
6. For N >= 100 (``--fair-max-n`` caps which N): shares. The short queue is paused
   (``POST /queues/short/pause``, 2.5 s to take effect), K = min(N, ``--fair-jobs`` 500) jobs of
   ``--fair-prompts`` 20 prompts, weight 1, are submitted and ingested, the queue is resumed, and
   once half of their prompts are committed it is paused again; when nothing is in flight each
   job's ``done`` is read. Reported: max |done_i / mean - 1| (0 = perfectly even), min and max
   done, the fraction done when sampled, and ``early``: prompts dispatched before the resume (0).

Columns. Redis table: ``slots``: the worker's in-flight limit for short prompts at the end of the
run (its KV controller moves it, e.g. from 16 to 4 when the simulator briefly queues requests: a
run at 4 claims in smaller batches, so it costs more commands per prompt; ``--worker-env
DATAGEN_KV_CONTROLLER=0`` pins it); ``cmd/p``, ``cpu us/p``: Redis commands and Redis CPU µs per prompt, whole
run (``x1``: ÷ the N=1 row); ``evalsha/p``, ``evalsha us/p``: EVALSHA calls and their server-side
µs per prompt; ``big cmd/p``, ``big cpu/p``: the big job's phase; ``idle cmd/s``, ``idle cpu``:
the idle stack's background (all jobs ended); ``+1 job cmd/p``, ``cpu us/p``: step 5. Latency
table (ms): ``submit8``: the threaded submits' p50/p99; ``alone p50``: the submits alone; ``big
sub``: the big job's submit; ``dispatch s``, ``1st done s``: from the big submit returning;
``fin->commit``, ``fin->done``: the gaps of step 2; ``job p50``, ``job cmd``: one ``GET /jobs/{id}``
on the idle stack, its latency and its Redis commands; ``list``, ``list1000``, ``close``: step 4
(p50, p99, KiB). Then the shares, each figure beside its target
(the issue's targets are for N=500; every N is checked; the submit target is checked on the
submits alone), and the top commands per prompt for each N (whole run, big phase, one more job).

Run: ``python bench/tenants.py [--n 1,100,500,2000] [--threads 8] [--big-prompts 1500]
[--fair-jobs 500] [--fair-max-n 2000] [--worker-env NAME=VALUE] [--keep-logs DIR]``.
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for tests.*

from _common import job_spec, offline_hub, write_jsonl

from datagen.control.keys import Keys
from datagen.prompts.tokenization import bundled_tokenizer_path
from datagen.records.storage import Storage
from datagen.states import JobState, ServerState
from datagen_cli.client import CoordinatorClient
from datagen_cli.local.processes import ChildProcesses, child_env
from datagen_cli.local.redis_server import LocalRedis, free_port
from tests.support.redis_monitor import RedisMonitor, job_commands

SERVER = "sim"
NAMESPACE = "tn"
MAX_NEW_TOKENS = 16
SERVER_UP_TIMEOUT_S = 120.0
RUN_TIMEOUT_S = 900.0
SLOW_POLL_S = 0.5
METRICS_POLL_S = 0.25
SETTLE_S = 1.0
PAUSE_TAKES_S = 2.5
IDLE_S = 2.0
CALIBRATION_POLLS = 40
_ENDED = {JobState.COMPLETED.value, JobState.FAILED.value, JobState.CANCELLED.value}
_COMMITTED = re.compile(r"^datagen_worker_records_committed_total\s+(\S+)$", re.MULTILINE)
_SHORT_TARGET = re.compile(
    r'^datagen_worker_in_flight_target\{[^}]*class="short"[^}]*\}\s+(\S+)$', re.MULTILINE
)
# Commands the benchmark itself sends to Redis to read the figures.
_OWN_COMMANDS = {"info"}

# The issue's targets (for N=500).
TARGET_RATIO = 1.5
TARGET_GAP_S = 1.0
TARGET_LIST_P99_MS = 100.0
TARGET_SUBMIT_P50_MS = 50.0
TARGET_SHARE = 0.10
# Issue 41: one more small job's whole Redis cost, and GET /jobs's p99 flat in the jobs there are
# (the largest N's at most this many times the smallest N >= 300's, or within the noise).
TARGET_JOB_COMMANDS = 60.0
# The second extra job, whose commands MONITOR counts (`_one_more_job_counted`).
COUNTED_JOB = "countedjob"
TARGET_LIST_FLAT = 1.5
LIST_NOISE_MS = 10.0
LIST_FLAT_FROM_N = 300
_TOPICS = ("sorting", "recursion", "photosynthesis", "inflation", "entropy", "plate tectonics", "jazz")


@dataclass
class Snapshot:
    """Redis's command counts, their µs, and its CPU seconds at one moment."""

    calls: dict[str, int]
    usec: dict[str, int]
    cpu_s: float

    @classmethod
    def take(cls, client: redis.Redis) -> Snapshot:
        stats: dict[str, Any] = client.info("commandstats")
        cpu: dict[str, Any] = client.info("cpu")
        calls, usec = {}, {}
        for key, value in stats.items():
            name = key.removeprefix("cmdstat_").lower()
            if name in _OWN_COMMANDS:
                continue
            calls[name], usec[name] = int(value["calls"]), int(value["usec"])
        return cls(calls, usec, float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]))

    def minus(self, before: Snapshot) -> Snapshot:
        names = set(self.calls) | set(before.calls)
        return Snapshot(
            {n: self.calls.get(n, 0) - before.calls.get(n, 0) for n in names},
            {n: self.usec.get(n, 0) - before.usec.get(n, 0) for n in names},
            self.cpu_s - before.cpu_s,
        )

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())


@dataclass
class PerPrompt:
    """A `Snapshot` difference divided by a number of prompts."""

    commands: float
    cpu_us: float
    evalsha: float
    evalsha_us: float
    by_command: dict[str, float]

    @classmethod
    def of(cls, delta: Snapshot, prompts: int) -> PerPrompt:
        return cls(
            commands=delta.total_calls / prompts,
            cpu_us=delta.cpu_s * 1e6 / prompts,
            evalsha=delta.calls.get("evalsha", 0) / prompts,
            evalsha_us=delta.usec.get("evalsha", 0) / prompts,
            by_command={n: c / prompts for n, c in delta.calls.items() if c > 0},
        )


@dataclass
class Share:
    """Each fairness job's ``done`` near half-way: the max deviation from the mean, the spread."""

    deviation: float
    min_done: int
    max_done: int
    jobs: int
    fraction_done: float  # of all the fairness prompts, when sampled
    early: int  # prompts dispatched before the queue was resumed (should be 0)


@dataclass
class Row:
    n: int
    prompts: int
    submit_ms: list[float]
    big_submit_ms: float
    dispatch_s: float | None
    first_done_s: float | None
    finish_to_commit_ms: float | None
    finish_to_done_ms: float | None
    run: PerPrompt
    big: PerPrompt
    own_polls: int
    poll_commands: float
    job_get_ms: float
    idle_commands_s: float
    idle_cpu: float
    alone_ms: list[float]
    slots: int
    run_s: float
    list_default: tuple[float, float, int]
    list_max: tuple[float, float, int]
    list_close: tuple[float, float, int]
    unfinished: int
    share: Share | None = None
    extra: PerPrompt | None = None  # one more small job on the idle stack
    extra_prompts: int = 0  # its prompts
    # One more small job's own commands by MONITOR, and those of them the fleet's timers put there.
    counted: tuple[int, int] | None = None
    notes: list[str] = field(default_factory=list)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _rows(prefix: str, n: int) -> list[dict[str, Any]]:
    return [
        {
            "id": f"{prefix}-p{i}",
            "messages": [
                {"role": "user", "content": f"{prefix} question {i}: explain {_TOPICS[i % len(_TOPICS)]}."}
            ],
        }
        for i in range(n)
    ]


def _spec() -> dict[str, Any]:
    spec = job_spec(
        short_max_new_tokens=MAX_NEW_TOKENS,
        long_max_new_tokens=MAX_NEW_TOKENS,
        priority="normal",
        weight=1.0,
    )
    return spec.model_dump(mode="json", exclude_defaults=True)


class Stack:
    """The child processes of one N, with the helpers the phases share."""

    def __init__(self, tmp: Path, redis_url: str, worker_env: dict[str, str]) -> None:
        self.tmp = tmp
        self.sim_url = f"http://127.0.0.1:{free_port()}"
        self.coordinator = f"http://127.0.0.1:{free_port()}"
        self.metrics_url = f"http://127.0.0.1:{free_port()}/metrics"
        self.storage_dir = tmp / "data"
        env = child_env(
            {
                "DATAGEN_REDIS_URL": redis_url,
                "DATAGEN_STORAGE": str(self.storage_dir),
                "DATAGEN_NAMESPACE": NAMESPACE,
            }
        )
        self.procs = ChildProcesses(tmp, env)
        self.spec = _spec()
        self.redis_url = redis_url
        self.redis = redis.Redis.from_url(redis_url)
        self.client = CoordinatorClient(self.coordinator)
        self.http = httpx.Client(base_url=self.coordinator, timeout=60.0)
        self.polls = 0  # HMGETs the benchmark sent while Redis was measured
        self.keys = Keys(NAMESPACE)
        self.worker_env = worker_env

    def start(self) -> None:
        sim_port = self.sim_url.rsplit(":", 1)[1]
        self.procs.spawn(
            "sim", "sim", "--port", sim_port, "--tokenizer", bundled_tokenizer_path(), "--time-scale", "0"
        )
        self.procs.spawn("coordinator", "coordinator", "--port", self.coordinator.rsplit(":", 1)[1])
        metrics_port = self.metrics_url.rsplit(":", 1)[1].split("/")[0]
        self.procs.env = dict(self.procs.env, DATAGEN_METRICS_PORT=metrics_port, **self.worker_env)
        self.procs.spawn("worker", "worker", "--server", f"{SERVER}={self.sim_url}")
        self.procs.wait_http(f"{self.sim_url}/health")
        self.procs.wait_http(f"{self.coordinator}/healthz")
        self.wait(
            "the worker to take the server",
            SERVER_UP_TIMEOUT_S,
            lambda: any(s["name"] == SERVER and s["state"] == ServerState.UP for s in self.client.servers()),
        )
        self.procs.wait_http(self.metrics_url)

    def stop(self) -> None:
        self.http.close()
        self.client.close()
        self.redis.close()
        self.procs.stop()

    def wait(self, what: str, timeout_s: float, check: Callable[[], Any], poll_s: float = 0.05) -> Any:
        deadline = time.monotonic() + timeout_s
        while not (value := check()):
            self.procs.check_alive()
            if time.monotonic() > deadline:
                raise SystemExit(f"timed out waiting for {what}; see the logs in {self.procs.log_dir}")
            time.sleep(poll_s)
        return value

    def dataset(self, name: str, rows: int) -> Path:
        path = self.tmp / "datasets" / f"{name}.jsonl"
        path.parent.mkdir(exist_ok=True)
        write_jsonl(path, _rows(name, rows))
        return path

    def submit(self, client: CoordinatorClient, job_id: str, dataset: Path) -> float:
        started = time.perf_counter()
        client.submit(dataset, self.spec, job_id=job_id)
        return (time.perf_counter() - started) * 1000

    def submit_many(self, prefix: str, count: int, rows: int, threads: int) -> list[float]:
        """``count`` jobs ``{prefix}{i}`` of ``rows`` prompts, from ``threads`` clients; each one's
        submit latency (ms)."""
        datasets = [self.dataset(f"{prefix}{i:05d}", rows) for i in range(count)]
        local = threading.local()

        def one(i: int) -> float:
            if not hasattr(local, "client"):
                local.client = CoordinatorClient(self.coordinator)
            return self.submit(local.client, f"{prefix}{i:05d}", datasets[i])

        with ThreadPoolExecutor(threads) as pool:
            return list(pool.map(one, range(count)))

    def job_fields(self, job_id: str) -> dict[str, str]:
        """``dispatched``, ``done`` and ``state`` of the job's hash: one HMGET, counted in ``polls``
        (cheaper and quicker than the API's ``GET /jobs/{id}``, and counted exactly)."""
        self.polls += 1
        names = ["dispatched", "done", "state"]
        values = self.redis.hmget(self.keys.job(job_id), names)
        return {n: (v.decode() if isinstance(v, bytes) else "") for n, v in zip(names, values, strict=True)}

    def in_flight_target(self) -> int:
        """The worker's in-flight limit for short prompts now (its KV controller moves it)."""
        match = _SHORT_TARGET.search(httpx.get(self.metrics_url, timeout=5.0).text)
        return int(float(match.group(1))) if match else 0

    def committed(self) -> int:
        match = _COMMITTED.search(httpx.get(self.metrics_url, timeout=5.0).text)
        return int(float(match.group(1))) if match else 0

    def jobs_by_prefix(self, prefix: str) -> list[dict[str, Any]]:
        return [j for j in self.client.jobs() if str(j["id"]).startswith(prefix)]

    def warm_up(self) -> None:
        self.submit(self.client, "warmup", self.dataset("warmup", 4))
        self.wait("the warm-up job", RUN_TIMEOUT_S, lambda: self.client.job("warmup")["state"] in _ENDED, 0.1)
        self.client.delete("warmup")


def _big_job_start(
    stack: Stack, job_id: str, prompts: int, poll_s: float
) -> tuple[float, float | None, float | None]:
    """Submit the big job and poll its hash until its first record is counted: (submit ms, s to
    its first dispatch, s to ``done >= 1``)."""
    submit_ms = stack.submit(stack.client, job_id, stack.dataset(job_id, prompts))
    returned = time.perf_counter()
    dispatched: float | None = None
    first_done: float | None = None
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while first_done is None and time.monotonic() < deadline:
        stack.procs.check_alive()
        job = stack.job_fields(job_id)
        now = time.perf_counter() - returned
        if dispatched is None and int(job["dispatched"] or 0) > 0:
            dispatched = now
        if int(job["done"] or 0) >= 1:
            first_done = now
        else:
            time.sleep(poll_s)
    return submit_ms, dispatched, first_done


def _storage_gap(storage_dir: Path, job_id: str) -> tuple[float | None, float | None]:
    """(earliest committed_at_ms, earliest finished_at_ms) of the job's committed records."""
    storage = Storage(str(storage_dir))
    commits = storage.list_commits(job_id)
    if not commits:
        return None, None
    first_commit = min(float(c["committed_at_ms"]) for c in commits)
    finished = [
        min(batch.column("finished_at_ms").to_pylist())
        for batch in storage.iter_record_batches(job_id, columns=["finished_at_ms"])
        if batch.num_rows
    ]
    return first_commit, (float(min(finished)) if finished else None)


def _list_latency(
    stack: Stack, limit: int | None, requests: int, *, close: bool = False
) -> tuple[float, float, int]:
    """p50 and p99 ms of ``GET /jobs`` and the response's bytes; on the client's kept-alive
    connection, or with ``close`` one connection per request (``Connection: close``)."""
    params = {} if limit is None else {"limit": limit}
    headers = {"Connection": "close"} if close else {}
    times, size = [], 0
    for _ in range(requests):
        started = time.perf_counter()
        response = stack.http.get("/jobs", params=params, headers=headers)
        times.append((time.perf_counter() - started) * 1000)
        response.raise_for_status()
        size = len(response.content)
    return statistics.median(times), _pct(times, 0.99), size


def _one_more_job(stack: Stack, prompts: int, idle: tuple[Snapshot, float]) -> Snapshot:
    """What one more small job costs Redis from its submit to its last record on the idle stack,
    less the idle background over that time (no polls: the worker's metrics say when it is done)."""
    dataset = stack.dataset("extra", prompts)
    committed = stack.committed()
    before, started = Snapshot.take(stack.redis), time.perf_counter()
    stack.submit(stack.client, "extra", dataset)
    stack.wait("the extra job", RUN_TIMEOUT_S, lambda: stack.committed() - committed >= prompts, 0.02)
    time.sleep(SETTLE_S)  # its acks land
    cost = Snapshot.take(stack.redis).minus(before)
    background, idle_s = idle
    return _less(cost, background, (time.perf_counter() - started) / idle_s)


def _one_more_job_counted(stack: Stack, prompts: int) -> tuple[int, int]:
    """One more small job again, its own commands counted with MONITOR as the small-job cost test
    counts them (`tests.support.redis_monitor.job_commands`): what names the job, no background.
    Returns its commands and how many of them the fleet's timers put there. Not the same job as
    `_one_more_job`'s: MONITOR costs Redis CPU, which that one measures."""
    dataset = stack.dataset(COUNTED_JOB, prompts)
    committed = stack.committed()
    with RedisMonitor(stack.redis_url) as monitor:
        stack.submit(stack.client, COUNTED_JOB, dataset)
        stack.wait("the counted job", RUN_TIMEOUT_S, lambda: stack.committed() - committed >= prompts, 0.02)
        time.sleep(SETTLE_S)  # its acks land
    counts, timed = job_commands(monitor.lines, COUNTED_JOB, NAMESPACE)
    return sum(counts.values()), timed


def _idle(stack: Stack) -> tuple[Snapshot, float]:
    """What the idle stack (every job ended) costs Redis over `IDLE_S`: its background loops."""
    before, started = Snapshot.take(stack.redis), time.perf_counter()
    time.sleep(IDLE_S)
    return Snapshot.take(stack.redis).minus(before), time.perf_counter() - started


def _poll_cost(stack: Stack, job_id: str, idle: tuple[Snapshot, float]) -> tuple[Snapshot, float]:
    """What `CALIBRATION_POLLS` calls of ``GET /jobs/{id}`` cost Redis, less the idle background
    over the same time; and one call's median latency (ms)."""
    before, started = Snapshot.take(stack.redis), time.perf_counter()
    times = []
    for _ in range(CALIBRATION_POLLS):
        one = time.perf_counter()
        stack.client.job(job_id)
        times.append((time.perf_counter() - one) * 1000)
    cost = Snapshot.take(stack.redis).minus(before)
    background, idle_s = idle
    factor = (time.perf_counter() - started) / idle_s
    return _less(cost, background, factor), statistics.median(times)


def _shares(stack: Stack, args: argparse.Namespace, k: int) -> Share:
    prefix = "fair"
    stack.client.set_queue_paused("short", True)
    time.sleep(PAUSE_TAKES_S)  # a pause stops dispatching within 2 s
    stack.submit_many(prefix, k, args.fair_prompts, args.threads)
    stack.wait(
        "the fairness jobs' ingestion",
        RUN_TIMEOUT_S,
        lambda: all(j["state"] != JobState.INGESTING.value for j in stack.jobs_by_prefix(prefix)),
        SLOW_POLL_S,
    )
    early = sum(int(j["done"]) + int(j["in_flight"]) for j in stack.jobs_by_prefix(prefix))
    total = k * args.fair_prompts
    base = stack.committed()
    stack.client.set_queue_paused("short", False)
    stack.wait(
        "half of the fairness prompts", RUN_TIMEOUT_S, lambda: stack.committed() - base >= total // 2, 0.02
    )
    stack.client.set_queue_paused("short", True)

    def settled() -> list[dict[str, Any]] | None:
        jobs = stack.jobs_by_prefix(prefix)
        return jobs if sum(j["in_flight"] for j in jobs) == 0 else None

    time.sleep(PAUSE_TAKES_S)
    jobs = stack.wait("the fairness jobs to settle", RUN_TIMEOUT_S, settled, SLOW_POLL_S)
    done = [int(j["done"]) for j in jobs]
    mean = statistics.fmean(done)
    deviation = max(abs(d / mean - 1) for d in done) if mean else float("inf")
    stack.client.set_queue_paused("short", False)
    return Share(deviation, min(done), max(done), len(done), sum(done) / total, early)


def run_n(n: int, args: argparse.Namespace) -> Row:
    with tempfile.TemporaryDirectory(prefix=f"tenants-{n}-") as tmp_dir, LocalRedis() as server:
        tmp = Path(tmp_dir)
        worker_env = dict(kv.split("=", 1) for kv in args.worker_env)
        stack = Stack(tmp, server.url, worker_env)
        try:
            stack.start()
            stack.warm_up()
            return _measure(stack, n, args)
        finally:
            stack.stop()
            if args.keep_logs:
                target = Path(args.keep_logs) / f"n{n}"
                target.mkdir(parents=True, exist_ok=True)
                for log in tmp.glob("*.log"):
                    shutil.copy(log, target / log.name)


def _measure(stack: Stack, n: int, args: argparse.Namespace) -> Row:
    big_id = "big"
    total = n * args.small_prompts + args.big_prompts
    notes: list[str] = []
    time.sleep(SETTLE_S)
    committed_before = stack.committed()
    started = time.perf_counter()
    before = Snapshot.take(stack.redis)
    probes = min(args.probes, n // 10) if n > 1 else n
    submit_ms = stack.submit_many("t", n - probes, args.small_prompts, args.threads)
    alone_ms = [
        stack.submit(stack.client, f"t{i:05d}", stack.dataset(f"t{i:05d}", args.small_prompts))
        for i in range(n - probes, n)
    ]
    before_big = Snapshot.take(stack.redis)
    polls_before_big = stack.polls
    big_submit_ms, dispatch_s, first_done_s = _big_job_start(
        stack, big_id, args.big_prompts, args.poll_ms / 1000
    )
    stack.wait(
        "every prompt committed",
        RUN_TIMEOUT_S,
        lambda: stack.committed() - committed_before >= total,
        METRICS_POLL_S,
    )
    stack.wait(
        "the big job's end", RUN_TIMEOUT_S, lambda: stack.job_fields(big_id)["state"] in _ENDED, SLOW_POLL_S
    )
    time.sleep(SETTLE_S)  # the last acks land
    after = Snapshot.take(stack.redis)
    run_s = time.perf_counter() - started
    slots = stack.in_flight_target()

    idle = _idle(stack)
    poll = _poll_cost(stack, big_id, idle)
    run_delta = after.minus(before)
    big_delta = after.minus(before_big)
    # The benchmark's own HMGETs are not the fleet's cost.
    run_delta = _without_own(run_delta, stack.polls)
    big_delta = _without_own(big_delta, stack.polls - polls_before_big)

    first_commit_ms, first_finish_ms = _storage_gap(stack.storage_dir, big_id)
    gap_ms = None if first_commit_ms is None or first_finish_ms is None else first_commit_ms - first_finish_ms
    first_record_ms = stack.redis.hget(stack.keys.job(big_id), "first_record_at_ms")
    done_gap_ms = (
        None if first_finish_ms is None or not first_record_ms else float(first_record_ms) - first_finish_ms
    )

    jobs = stack.client.jobs()
    unfinished = sum(1 for j in jobs if j["state"] not in _ENDED)
    if unfinished:
        notes.append(f"{unfinished} job(s) not ended when Redis was read")
    if len(jobs) != n + 1:
        notes.append(f"{len(jobs)} jobs listed, expected {n + 1}")
    list_default = _list_latency(stack, None, args.list_requests)
    list_max = _list_latency(stack, 1000, args.list_requests)
    list_close = _list_latency(stack, None, args.list_requests, close=True)
    row = Row(
        n=n,
        prompts=total,
        submit_ms=submit_ms,
        big_submit_ms=big_submit_ms,
        dispatch_s=dispatch_s,
        first_done_s=first_done_s,
        finish_to_commit_ms=gap_ms,
        finish_to_done_ms=done_gap_ms,
        run=PerPrompt.of(run_delta, total),
        big=PerPrompt.of(big_delta, args.big_prompts),
        own_polls=stack.polls,
        poll_commands=poll[0].total_calls / CALIBRATION_POLLS,
        job_get_ms=poll[1],
        idle_commands_s=idle[0].total_calls / idle[1],
        idle_cpu=idle[0].cpu_s / idle[1],
        alone_ms=alone_ms,
        slots=slots,
        run_s=run_s,
        list_default=list_default,
        list_max=list_max,
        list_close=list_close,
        unfinished=unfinished,
        notes=notes,
    )
    row.extra = PerPrompt.of(_one_more_job(stack, args.small_prompts, idle), args.small_prompts)
    row.extra_prompts = args.small_prompts
    row.counted = _one_more_job_counted(stack, args.small_prompts)
    if stack.client.job("extra")["state"] not in _ENDED:
        notes.append("the extra job had not ended when Redis was read")
    if n >= 100 and n <= args.fair_max_n:
        row.share = _shares(stack, args, min(n, args.fair_jobs))
    return row


def _without_own(delta: Snapshot, hmgets: int) -> Snapshot:
    """``delta`` less the benchmark's own ``hmgets`` (their µs and Redis CPU estimated as an average
    HMGET's and an average command's)."""
    calls = delta.calls.get("hmget", 0)
    usec = delta.usec.get("hmget", 0) * min(1.0, hmgets / calls) if calls else 0.0
    cpu_s = delta.cpu_s * hmgets / delta.total_calls if delta.total_calls else 0.0
    own = Snapshot({"hmget": hmgets}, {"hmget": round(usec)}, cpu_s)
    return _less(delta, own, 1.0)


def _less(delta: Snapshot, other: Snapshot, factor: float) -> Snapshot:
    """``delta`` less ``factor`` times ``other`` (never below zero)."""
    return Snapshot(
        {n: max(0, c - round(other.calls.get(n, 0) * factor)) for n, c in delta.calls.items()},
        {n: max(0, u - round(other.usec.get(n, 0) * factor)) for n, u in delta.usec.items()},
        max(0.0, delta.cpu_s - other.cpu_s * factor),
    )


def _ratio(value: float, base: float | None) -> str:
    return f"{value / base:.2f}x" if base else "-"


def _opt(value: float | None, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def _at_most(value: float | None, target: float) -> bool | None:
    return None if value is None else value <= target


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "NOT met")


def _p50(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _p99(values: list[float]) -> float | None:
    return _pct(values, 0.99) if values else None


def report(rows: list[Row]) -> None:
    base = next((r for r in rows if r.n == 1), rows[0])
    print()
    print("Redis per prompt (the benchmark's own reads taken out); idle: all jobs ended")
    print(
        f"{'N':>5} {'prompts':>7} {'run s':>6} {'slots':>5} {'cmd/p':>7} {'x1':>6} {'cpu us/p':>8} {'x1':>6} "
        f"{'evalsha/p':>9} {'evalsha us/p':>12} {'big cmd/p':>9} {'x1':>6} {'big cpu/p':>9} {'x1':>6} "
        f"{'idle cmd/s':>10} {'idle cpu':>8} {'+1 job cmd/p':>12} {'cpu us/p':>8}"
    )
    for r in rows:
        extra = r.extra
        print(
            f"{r.n:>5} {r.prompts:>7} {r.run_s:>6.1f} {r.slots:>5} {r.run.commands:>7.2f} "
            f"{_ratio(r.run.commands, base.run.commands):>6} {r.run.cpu_us:>8.1f} "
            f"{_ratio(r.run.cpu_us, base.run.cpu_us):>6} {r.run.evalsha:>9.2f} {r.run.evalsha_us:>12.1f} "
            f"{r.big.commands:>9.2f} {_ratio(r.big.commands, base.big.commands):>6} {r.big.cpu_us:>9.1f} "
            f"{_ratio(r.big.cpu_us, base.big.cpu_us):>6} {r.idle_commands_s:>10.0f} {r.idle_cpu:>8.1%} "
            f"{_opt(extra.commands if extra else None, '.1f'):>12} "
            f"{_opt(extra.cpu_us if extra else None, '.0f'):>8}"
        )
    print()
    print("Latency (ms unless said): submits (8 threads / alone), the big job, GET /jobs/{id} and GET /jobs")
    print(
        f"{'N':>5} {'submit8 p50':>11} {'p99':>7} {'alone p50':>9} {'big sub':>7} {'dispatch s':>10} "
        f"{'1st done s':>10} {'fin->commit':>11} {'fin->done':>9} {'job p50':>7} {'job cmd':>7} "
        f"{'list p50':>8} {'p99':>6} {'KiB':>6} {'list1000 p50':>12} {'p99':>6} {'KiB':>6} "
        f"{'close p50':>9} {'p99':>6}"
    )
    for r in rows:
        print(
            f"{r.n:>5} {_opt(_p50(r.submit_ms), '.1f'):>11} {_opt(_p99(r.submit_ms), '.1f'):>7} "
            f"{_opt(_p50(r.alone_ms), '.1f'):>9} {r.big_submit_ms:>7.1f} {_opt(r.dispatch_s, '.3f'):>10} "
            f"{_opt(r.first_done_s, '.3f'):>10} {_opt(r.finish_to_commit_ms, '.0f'):>11} "
            f"{_opt(r.finish_to_done_ms, '.0f'):>9} {r.job_get_ms:>7.1f} {r.poll_commands:>7.0f} "
            f"{r.list_default[0]:>8.1f} {r.list_default[1]:>6.1f} {r.list_default[2] / 1024:>6.1f} "
            f"{r.list_max[0]:>12.1f} {r.list_max[1]:>6.1f} {r.list_max[2] / 1024:>6.1f} "
            f"{r.list_close[0]:>9.1f} {r.list_close[1]:>6.1f}"
        )
    shared = [r for r in rows if r.share is not None]
    if shared:
        print()
        print("Shares: equal-weight jobs' done near half-way (dev: max |done/mean - 1|)")
        print(
            f"{'N':>5} {'jobs':>5} {'dev':>7} {'min done':>8} {'max done':>8} {'sampled at':>10} {'early':>5}"
        )
        for r in shared:
            assert r.share is not None
            sh = r.share
            print(
                f"{r.n:>5} {sh.jobs:>5} {sh.deviation:>7.1%} {sh.min_done:>8} {sh.max_done:>8} "
                f"{sh.fraction_done:>10.0%} {sh.early:>5}"
            )
    print()
    print("Targets (the issue's, for N=500; each N checked)")
    for r in rows:
        gap = None if r.finish_to_commit_ms is None else r.finish_to_commit_ms / 1000
        # The default page (100 jobs) with every job present: what `datagen status` and a client
        # paging through the jobs read; a 1,000-job page is shown beside it in the table.
        list_p99 = r.list_default[1]
        submit_p50 = _p50(r.alone_ms)
        share_dev = None if r.share is None else r.share.deviation
        less_idle = None if r.extra is None else r.extra.commands * r.extra_prompts
        own, timed = r.counted if r.counted is not None else (None, 0)
        checks = [
            (
                f"cmd/p {_ratio(r.run.commands, base.run.commands)} (<= {TARGET_RATIO}x)",
                r.run.commands <= TARGET_RATIO * base.run.commands,
            ),
            (
                f"cpu/p {_ratio(r.run.cpu_us, base.run.cpu_us)} (<= {TARGET_RATIO}x)",
                r.run.cpu_us <= TARGET_RATIO * base.run.cpu_us,
            ),
            (f"fin->commit {_opt(gap, '.3f')} s (<= {TARGET_GAP_S} s)", _at_most(gap, TARGET_GAP_S)),
            (
                f"GET /jobs p99 {list_p99:.1f} ms (<= {TARGET_LIST_P99_MS:.0f} ms)",
                list_p99 <= TARGET_LIST_P99_MS,
            ),
            (
                f"submit alone p50 {_opt(submit_p50, '.1f')} ms (<= {TARGET_SUBMIT_P50_MS:.0f} ms)",
                _at_most(submit_p50, TARGET_SUBMIT_P50_MS),
            ),
            (
                f"shares {'-' if share_dev is None else f'{share_dev:.1%}'} (<= {TARGET_SHARE:.0%})",
                _at_most(share_dev, TARGET_SHARE),
            ),
            (
                f"+1 job {_opt(None if own is None else own - timed, '.0f')} commands of its own "
                f"(<= {TARGET_JOB_COMMANDS:.0f}; {_opt(own, '.0f')} with the fleet's timers', "
                f"{_opt(less_idle, '.0f')} by Redis's totals less the idle background)",
                _at_most(None if own is None else own - timed, TARGET_JOB_COMMANDS),
            ),
        ]
        print(f"N={r.n}: " + "; ".join(f"{text}: {_verdict(ok)}" for text, ok in checks))
        polls = (
            f"{r.own_polls} own HMGETs taken out; one GET /jobs/{{id}} costs Redis "
            f"{r.poll_commands:.0f} commands (idle stack)"
        )
        print(f"       ({polls}{''.join('; ' + note for note in r.notes)})")
    _flat(rows)
    _top(rows, base, "whole run", lambda r: r.run)
    _top(rows, base, "big job's phase", lambda r: r.big)
    if all(r.extra is not None for r in rows):
        _top(rows, base, "one more small job on the idle stack", lambda r: r.extra or r.run)


def _flat(rows: list[Row]) -> None:
    """Whether ``GET /jobs``'s p99 (the default page) stays flat from the smallest N >= 300 to the
    largest: a page's read costs O(page), not O(jobs)."""
    many = sorted((r for r in rows if r.n >= LIST_FLAT_FROM_N), key=lambda r: r.n)
    if len(many) < 2:
        return
    low, high = many[0], many[-1]
    p99_low, p99_high = low.list_default[1], high.list_default[1]
    ok = p99_high <= max(TARGET_LIST_FLAT * p99_low, p99_low + LIST_NOISE_MS)
    print(
        f"GET /jobs p99 N={low.n} -> N={high.n}: {p99_low:.1f} -> {p99_high:.1f} ms "
        f"(flat: <= {TARGET_LIST_FLAT}x or +{LIST_NOISE_MS:.0f} ms): {_verdict(ok)}"
    )


def _top(rows: list[Row], base: Row, what: str, figures: Callable[[Row], PerPrompt]) -> None:
    print()
    print(f"Top commands per prompt (calls/prompt, {what}; x1: ÷ the N=1 figure)")
    names = sorted(
        {name for r in rows for name in figures(r).by_command},
        key=lambda name: -max(figures(r).by_command.get(name, 0.0) for r in rows),
    )[:10]
    print(f"{'command':>18} " + " ".join(f"{'N=' + str(r.n):>16}" for r in rows))
    for name in names:
        cells = []
        for r in rows:
            value = figures(r).by_command.get(name, 0.0)
            cells.append(f"{value:>8.2f} {_ratio(value, figures(base).by_command.get(name)):>7}")
        print(f"{name:>18} " + " ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", default="1,100,500,2000", help="numbers of small jobs, comma-separated")
    parser.add_argument("--threads", type=int, default=8, help="client threads submitting")
    parser.add_argument(
        "--probes", type=int, default=10, help="of the small jobs, submitted alone at the end (at most N/10)"
    )
    parser.add_argument("--small-prompts", type=int, default=3)
    parser.add_argument("--big-prompts", type=int, default=1500)
    parser.add_argument("--poll-ms", type=float, default=50.0, help="how often the big job is polled")
    parser.add_argument("--list-requests", type=int, default=50, help="GET /jobs requests per page size")
    parser.add_argument("--fair-jobs", type=int, default=500, help="at most this many jobs for shares")
    parser.add_argument("--fair-prompts", type=int, default=20)
    parser.add_argument("--fair-max-n", type=int, default=2000, help="measure shares only up to this N")
    parser.add_argument(
        "--worker-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a setting of the worker (DATAGEN_KV_CONTROLLER=0 pins its in-flight limit)",
    )
    parser.add_argument("--keep-logs", default=None, help="copy the child processes' logs here")
    args = parser.parse_args()
    offline_hub()
    rows = []
    for n in (int(v) for v in args.n.split(",")):
        started = time.perf_counter()
        rows.append(run_n(n, args))
        print(f"N={n} measured in {time.perf_counter() - started:.0f} s", flush=True)
    report(rows)


if __name__ == "__main__":
    main()
