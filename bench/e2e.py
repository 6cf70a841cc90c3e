"""The user's whole run, timed from the outside: ``datagen submit DATASET --wait`` against a warm
fleet, and the best hand-written client as a script of its own (issue 25).

A private Redis, one KV-bound ``datagen sim`` (saturation.py's server: ``--kv-tokens`` 16,384,
``--reserve-fraction`` 0.1, ``--time-scale`` 0.05, outputs up to ``--max-new-tokens`` 2,048), a
``datagen coordinator`` and a ``datagen worker --server sim=URL`` run as child processes with the
production defaults, but for the worker settings each variant names. N short one-turn prompts
(saturation.py's) are the job. Every variant generates the same tokens (checked).

Variants, each timed from the start of its child process to its exit:

``plain c=C``
    The baseline: a Python script (``PLAIN_CLIENT`` below, run with ``python -c``) that loads the
    prompts as **pre-rendered token ids** (a JSON file written beforehand, so it does no
    tokenization), posts ``{"input_ids", "sampling_params"}`` to ``/generate`` under an
    ``asyncio.Semaphore(C)`` over one ``httpx.AsyncClient`` (a pool of C connections, no
    timeouts), and writes every answer's output ids to a JSONL file before it exits; saturation.py's
    ``(a)``. Swept over ``--sweep`` (or only ``--plain-c``) once each; the C with the shortest run
    is best(a), which runs ``--repeats`` more times after the datagen variants. The baseline's time
    is its best run at best(a), the sweep's included.
``datagen c=C, no controller``
    ``python -m datagen_cli submit DATASET --spec SPEC --coordinator URL --wait`` against a worker with
    ``DATAGEN_SHORT_CONCURRENCY`` = best(a) (or ``--limit``) and ``DATAGEN_KV_CONTROLLER=0``
    (saturation.py's ``(b)``).
``datagen from 512 + controller``
    The same against a worker with ``DATAGEN_SHORT_CONCURRENCY=--start-limit`` (512) and the KV
    controller on at ``--controller-interval-s`` 0.5 s (saturation.py's ``(c)``; the production
    default interval is 2 s).

Each worker starts fresh for its variant and first runs one warm-up job of ``WARMUP_ROWS`` other
prompts through the same command, so it has loaded its tokenizer, opened its connections and gone
idle (the coordinator too). Each datagen variant runs ``--repeats`` times; its time is the best.

The breakdown comes from the clients' own clocks and the job's timestamps (wall-clock ms):
``start`` the child process's start; ``created`` the job's ``created_at_ms`` (``GET /jobs/{id}``:
the coordinator stored the upload and created the job; ingestion starts then); ``first req`` the
first request sent (the records' earliest ``started_at_ms``; the baseline's earliest send);
``last done`` the last answer received (the records' latest ``finished_at_ms``; the baseline's
latest answer); ``completed`` the job's ``finished_at_ms`` (the ack of the last record, after its
shard was committed); ``exit`` the child's exit. The baseline has no job: its ``start -> first
req`` is the interpreter, ``import httpx`` and loading the ids, its ``last done -> exit`` writing
the outputs and exiting. Nothing polls the simulator: its scheduler shares one event loop with its
HTTP server, so a ``/metrics`` poll every 10 ms (how this benchmark read the server first) took a
quarter of its CPU and stretched its decode steps (py-spy on the simulator, 2026-12-02).

Printed: each run's intervals in seconds, whole-run wall and tok/s; then ``whole x`` (baseline
whole ÷ ours; issue 25's target ≥ 0.95) and ``steady x`` (throughput while prompts remain: the
output tokens of the prompts completing between the 5th and 95th percentile of completion times,
over that span, from the records' ``finished_at_ms`` and the baseline's answer times).

Run: ``python bench/e2e.py [--n 600] [--repeats 1] [--sweep 16,32,64,128,256] [--plain-c C]
[--limit C] [--time-scale 0.05] [--kv-tokens 16384] [--reserve-fraction 0.1] [--logs DIR]``
(about four minutes on two cores with the defaults). Run it with this checkout first on
``sys.path`` (``PYTHONPATH=.``) when the installed ``datagen`` is another checkout: the child
processes run ``python -m datagen_cli`` from the repository root.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from _common import SIM_MAX_LAG_MS, offline_hub, short_rows, sweep_spec, write_jsonl
from _load import percentile, render

# The same scenario as saturation.py: its server, its prompts, its sweep and its controller settings.
from saturation import (
    DEFAULT_CONTROLLER_INTERVAL_S,
    DEFAULT_KV_TOKENS,
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_N,
    DEFAULT_RESERVE_FRACTION,
    DEFAULT_START_LIMIT,
    DEFAULT_SWEEP,
    DEFAULT_TIME_SCALE,
)

from datagen.prompts.tokenization import bundled_tokenizer_path
from datagen.records.storage import Storage
from datagen.states import JobState
from datagen_cli.client import CoordinatorClient
from datagen_cli.local.processes import ChildProcesses, child_env
from datagen_cli.local.redis_server import LocalRedis, free_port

SERVER = "sim"
NAMESPACE = "e2e"
TARGET_RATIO = 0.95
STEADY_FROM_PCT = 5
STEADY_TO_PCT = 95
WARMUP_ROWS = 32
RUN_TIMEOUT_S = 600.0

# The baseline, as a careful user writes it: ids rendered once beforehand, one pooled client, all
# prompts gathered under a semaphore, the outputs saved. Its only extra is the answer times on stdout.
PLAIN_CLIENT = """
import asyncio, json, sys, time
import httpx

async def main(url, prompts_path, out_path, concurrency):
    with open(prompts_path) as fh:
        job = json.load(fh)
    prompts, params = job["input_ids"], job["sampling_params"]
    semaphore = asyncio.Semaphore(concurrency)
    outputs, sent_at, done_at = [None] * len(prompts), [0.0] * len(prompts), [0.0] * len(prompts)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=None) as client:
        async def one(i):
            async with semaphore:
                body = {"input_ids": prompts[i], "sampling_params": params, "rid": f"plain-{i}"}
                sent_at[i] = time.time()
                response = await client.post(f"{url}/generate", json=body)
                response.raise_for_status()
                outputs[i] = response.json()["output_ids"]
                done_at[i] = time.time()
        await asyncio.gather(*(one(i) for i in range(len(prompts))))
    with open(out_path, "w") as fh:
        for i, ids in enumerate(outputs):
            fh.write(json.dumps({"index": i, "output_ids": ids}) + "\\n")
    json.dump({"lengths": [len(o) for o in outputs], "sent_at": sent_at, "done_at": done_at}, sys.stdout)

asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])))
"""


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuWatch:
    """CPU seconds each long-lived child and the timed command spent over one run."""

    def __init__(self, stack: Stack) -> None:
        self.pids = {name: proc.pid for name, proc in stack.processes.procs.items()}
        self.before = {name: cpu_s(pid) for name, pid in self.pids.items()}
        self.children_before = _children_cpu_s()

    def spent(self) -> dict[str, float]:
        out = {name: cpu_s(pid) - self.before[name] for name, pid in self.pids.items()}
        out["command"] = _children_cpu_s() - self.children_before
        return out


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@dataclass
class Run:
    """One whole run; times are ``time.time()`` seconds."""

    label: str
    start: float
    exit: float
    tokens: int
    first_req: float
    last_done: float
    completions: list[tuple[float, int]] = field(default_factory=list)  # (time, output tokens)
    created: float | None = None  # ours only: the job's created_at_ms
    cpu: dict[str, float] = field(default_factory=dict)  # CPU seconds by process over the run
    completed: float | None = None  # ours only: the job's finished_at_ms

    @property
    def wall_s(self) -> float:
        return self.exit - self.start

    @property
    def steady_tokens_per_s(self) -> float:
        times = [t for t, _ in self.completions]
        t_from, t_to = percentile(times, STEADY_FROM_PCT), percentile(times, STEADY_TO_PCT)
        tokens = sum(n for t, n in self.completions if t_from < t <= t_to)
        return tokens / (t_to - t_from) if t_to > t_from else 0.0

    def intervals(self) -> list[tuple[str, float]]:
        if self.created is None or self.completed is None:
            points = [("start", self.start), ("first req", self.first_req)]
            points += [("last done", self.last_done), ("exit", self.exit)]
        else:
            points = [("start", self.start), ("created", self.created), ("first req", self.first_req)]
            points += [("last done", self.last_done), ("completed", self.completed), ("exit", self.exit)]
        return [(f"{a}->{b}", tb - ta) for (a, ta), (b, tb) in itertools.pairwise(points)]


@dataclass
class Stack:
    """What the runs need: the child processes, the URLs, the files."""

    tmp: Path
    env: dict[str, str]
    processes: ChildProcesses
    sim_url: str
    coordinator: str
    args: argparse.Namespace


def run_plain(stack: Stack, concurrency: int) -> Run:
    """The baseline script in a child process, from its start to its exit."""
    tmp = stack.tmp
    command = [
        sys.executable,
        "-c",
        PLAIN_CLIENT,
        stack.sim_url,
        str(tmp / "ids.json"),
        str(tmp / "out.jsonl"),
    ]
    cpu = CpuWatch(stack)
    start = time.time()
    done = subprocess.run(
        [*command, str(concurrency)], env=stack.env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )
    exit_ = time.time()
    spent = cpu.spent()
    if done.returncode != 0:
        raise SystemExit(f"the plain client failed:\n{done.stderr[-3000:]}")
    report = json.loads(done.stdout)
    first_req, last_done = min(report["sent_at"]), max(report["done_at"])
    completions = list(zip(report["done_at"], report["lengths"], strict=True))
    return Run(
        f"plain c={concurrency}",
        start,
        exit_,
        sum(report["lengths"]),
        first_req,
        last_done,
        completions,
        cpu=spent,
    )


def submit(stack: Stack, dataset: Path) -> tuple[str, float, float]:
    """``datagen submit DATASET --wait`` as a child process; (job id, start, exit)."""
    command = [
        sys.executable,
        "-m",
        "datagen_cli",
        "submit",
        str(dataset),
        "--spec",
        str(stack.tmp / "spec.json"),
    ]
    command += ["--coordinator", stack.coordinator, "--wait"]
    start = time.time()
    done = subprocess.run(command, env=stack.env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    exit_ = time.time()
    if done.returncode != 0:
        raise SystemExit(
            f"datagen submit exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        )
    return done.stdout.split()[0], start, exit_


def run_ours(stack: Stack, label: str) -> Run:
    cpu = CpuWatch(stack)
    job_id, start, exit_ = submit(stack, stack.tmp / "prompts.jsonl")
    spent = cpu.spent()
    with CoordinatorClient(stack.coordinator) as client:
        job = client.job(job_id)
    n = stack.args.n
    if job["state"] != JobState.COMPLETED or job["done"] != n:
        raise SystemExit(f"job {job_id} did not complete all {n} prompts: {job}")
    storage = Storage(stack.tmp / "data")
    records = [
        row
        for batch in storage.iter_record_batches(
            job_id, columns=["output_len", "started_at_ms", "finished_at_ms"]
        )
        for row in batch.to_pylist()
    ]
    completions = [(r["finished_at_ms"] / 1000, r["output_len"]) for r in records]
    first_req = min(r["started_at_ms"] for r in records) / 1000
    last_done = max(r["finished_at_ms"] for r in records) / 1000
    return Run(
        label,
        start,
        exit_,
        int(job["generated_tokens"]),
        first_req,
        last_done,
        completions,
        created=job["created_at_ms"] / 1000,
        completed=job["finished_at_ms"] / 1000,
        cpu=spent,
    )


def datagen_variant(stack: Stack, name: str, label: str, worker_env: dict[str, str]) -> list[Run]:
    """A fresh worker ``name`` with ``worker_env``, one warm-up job, then ``--repeats`` timed runs."""
    stack.processes.env = dict(stack.env, DATAGEN_METRICS_PORT="0", **worker_env)
    worker = stack.processes.spawn(name, "worker", "--server", f"{SERVER}={stack.sim_url}")
    try:
        submit(stack, stack.tmp / "warmup.jsonl")
        runs = []
        for _ in range(stack.args.repeats):
            runs.append(run_ours(stack, label))
            print(f"  ... {label}: {runs[-1].wall_s:.2f} s", flush=True)
        return runs
    finally:
        worker.terminate()
        worker.wait(timeout=30)
        stack.processes.procs.pop(name)


def prepare(tmp: Path, args: argparse.Namespace) -> None:
    """The dataset, the warm-up dataset, the spec file, and the baseline's pre-rendered ids."""
    spec = sweep_spec(args)
    ids = render(spec, short_rows(args.n), tmp / "prompts.jsonl")
    warmup = [dict(r, id=f"w{r['id']}") for r in short_rows(args.n + WARMUP_ROWS)[args.n :]]
    write_jsonl(tmp / "warmup.jsonl", warmup)
    (tmp / "spec.json").write_text(json.dumps(spec.model_dump(mode="json", exclude_defaults=True)))
    params = spec.sampling.to_sglang(args.max_new_tokens)
    (tmp / "ids.json").write_text(json.dumps({"input_ids": ids, "sampling_params": params}))


def measure(stack: Stack) -> tuple[list[Run], list[Run], list[list[Run]]]:
    args = stack.args
    sweep = [int(c) for c in args.sweep.split(",")] if args.plain_c is None else [args.plain_c]
    plain: list[Run] = []
    for concurrency in sweep:
        plain.append(run_plain(stack, concurrency))
        print(f"  ... {plain[-1].label}: {plain[-1].wall_s:.2f} s", flush=True)
    best_c = int(min(plain, key=lambda r: r.wall_s).label.rsplit("=", 1)[1])
    limit = args.limit or best_c
    fixed_env = {"DATAGEN_SHORT_CONCURRENCY": str(limit), "DATAGEN_KV_CONTROLLER": "0"}
    controlled_env = {
        "DATAGEN_SHORT_CONCURRENCY": str(args.start_limit),
        "DATAGEN_KV_CONTROLLER": "1",
        "DATAGEN_CONTROLLER_INTERVAL_S": str(args.controller_interval_s),
    }
    ours = [
        datagen_variant(stack, "worker-fixed", f"datagen c={limit}, no controller", fixed_env),
        datagen_variant(
            stack, "worker-controller", f"datagen from {args.start_limit} + controller", controlled_env
        ),
    ]
    after: list[Run] = []
    for _ in range(args.repeats):
        after.append(run_plain(stack, best_c))
        print(f"  ... {after[-1].label} (again): {after[-1].wall_s:.2f} s", flush=True)
    return plain, after, ours


def report(plain: list[Run], after: list[Run], ours: list[list[Run]], args: argparse.Namespace) -> None:
    best_c_label = after[0].label
    baseline = min([r for r in plain if r.label == best_c_label] + after, key=lambda r: r.wall_s)
    steady_base = max(r.steady_tokens_per_s for r in [*plain, *after])
    print(
        f"\ne2e: N={args.n} prompts, time_scale={args.time_scale}, kv_tokens={args.kv_tokens}, "
        f"reserve_fraction={args.reserve_fraction}, max_new_tokens={args.max_new_tokens}"
    )
    print("  baseline: a python -c script loading pre-rendered input_ids (no tokenization), writing outputs")
    print("  ours: python -m datagen_cli submit DATASET --spec SPEC --coordinator URL --wait (warm fleet)")
    print(f"\n  {'run':<38} {'wall s':>7} {'tok/s':>7} {'steady tok/s':>12}  intervals (s)")
    for run in [*plain, *after, *(r for runs in ours for r in runs)]:
        steps = "  ".join(f"{name} {s:.3f}" for name, s in run.intervals())
        mark = "  <- baseline" if run is baseline else ""
        print(
            f"  {run.label:<38} {run.wall_s:7.2f} {run.tokens / run.wall_s:7.0f} "
            f"{run.steady_tokens_per_s:12.0f}  {steps}{mark}"
        )
    print("\n  CPU seconds by process over each run (the simulator stands in for a GPU; on two cores")
    print("  every other process's CPU is time the simulator may lose):")
    for run in [*plain, *after, *(r for runs in ours for r in runs)]:
        spent = "  ".join(f"{name} {s:.2f}" for name, s in sorted(run.cpu.items()))
        print(f"  {run.label:<38} {spent}")
    counts = {r.tokens for r in [*plain, *after, *(r for runs in ours for r in runs)]}
    print(
        f"  generated tokens: {sorted(counts)} ({'equal in every run' if len(counts) == 1 else 'MISMATCH'})"
    )
    print(f"\n  baseline: {baseline.label}, best whole run {baseline.wall_s:.2f} s")
    for runs in ours:
        best = min(runs, key=lambda r: r.wall_s)
        ratio = baseline.wall_s / best.wall_s
        steady = best.steady_tokens_per_s / steady_base
        verdict = "met" if ratio >= TARGET_RATIO else "NOT met"
        walls = ", ".join(f"{r.wall_s:.2f}" for r in runs)
        median = statistics.median(r.wall_s for r in runs)
        print(
            f"  {best.label}: whole run {best.wall_s:.2f} s (runs {walls}; median {median:.2f}); "
            f"whole x {ratio:.3f} (target >= {TARGET_RATIO}: {verdict}); steady x {steady:.3f}"
        )
        print("    " + "  ".join(f"{name} {s:.3f}" for name, s in best.intervals()))
    if len(counts) != 1:
        raise SystemExit("the runs generated different token counts; the comparison is void")


def run(args: argparse.Namespace) -> None:
    offline_hub()
    with tempfile.TemporaryDirectory(prefix="bench-e2e-") as tmp_name, LocalRedis() as redis_server:
        tmp = Path(tmp_name)
        prepare(tmp, args)
        sim_port, coord_port = free_port(), free_port()
        sim_url, coordinator = f"http://127.0.0.1:{sim_port}", f"http://127.0.0.1:{coord_port}"
        env = child_env(
            {
                "DATAGEN_REDIS_URL": redis_server.url,
                "DATAGEN_STORAGE": str(tmp / "data"),
                "DATAGEN_NAMESPACE": NAMESPACE,
            }
        )
        processes = ChildProcesses(tmp, env)
        sim = ["sim", "--port", str(sim_port), "--tokenizer", bundled_tokenizer_path()]
        sim += ["--time-scale", str(args.time_scale), "--kv-tokens", str(args.kv_tokens)]
        sim += ["--reserve-fraction", str(args.reserve_fraction), "--max-lag-ms", str(SIM_MAX_LAG_MS)]
        try:
            processes.spawn("sim", *sim)
            processes.spawn("coordinator", "coordinator", "--port", str(coord_port))
            processes.wait_http(f"{sim_url}/health")
            processes.wait_http(f"{coordinator}/healthz")
            stack = Stack(tmp, env, processes, sim_url, coordinator, args)
            plain, after, ours = measure(stack)
        finally:
            processes.stop()
            if args.logs is not None:
                args.logs.mkdir(parents=True, exist_ok=True)
                for log in tmp.glob("*.log"):
                    shutil.copy(log, args.logs / log.name)
    report(plain, after, ours, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=DEFAULT_N, help="prompts (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs of each datagen variant")
    parser.add_argument("--sweep", default=DEFAULT_SWEEP, help="plain concurrencies (default %(default)s)")
    parser.add_argument("--plain-c", type=int, help="the baseline's concurrency: no sweep")
    parser.add_argument("--limit", type=int, help="the fixed-limit variant's limit (default: best plain C)")
    parser.add_argument("--time-scale", type=float, default=DEFAULT_TIME_SCALE, help="simulator speed")
    parser.add_argument("--kv-tokens", type=int, default=DEFAULT_KV_TOKENS, help="simulator KV pool")
    parser.add_argument("--reserve-fraction", type=float, default=DEFAULT_RESERVE_FRACTION)
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    parser.add_argument("--start-limit", type=int, default=DEFAULT_START_LIMIT, help="the controller's start")
    parser.add_argument("--controller-interval-s", type=float, default=DEFAULT_CONTROLLER_INTERVAL_S)
    parser.add_argument("--logs", type=Path, help="copy the child processes' logs to this directory")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    run(args)


if __name__ == "__main__":
    main()
