"""The control plane at fleet scale: K worker processes x M simulated servers against one Redis, and
how many GPUs that Redis and one worker process can feed.

M ``datagen sim`` child processes answer at ``--time-scale`` (0: as fast as the simulator's Python
can), K ``datagen worker --burst`` child processes share them (each worker takes every server), and
one job of N prompts is ingested into one private Redis, as the coordinator does (``Ingestor.run``).
The workers' own log lines go to a temporary file.

Printed, over the whole job (ingest, claims, finishes, idle polling while the last prompts end):

- prompts/s: N over the wall time from the workers' start to the last worker's exit;
- Redis commands per prompt, with the most frequent (``INFO commandstats`` difference: Lua's own
  ``redis.call``s count, as they cost the same) and Redis CPU per prompt (``INFO cpu``
  ``used_cpu_sys + used_cpu_user`` difference);
- worker CPU per prompt (the worker processes' own user + system time, from ``wait4``, less the
  start-up CPU of a burst worker that finds nothing to do);
- idle cost: Redis commands per second issued by one worker with nothing queued, over ``--idle-s``,
  with the production defaults (the burst workers poll every 0.05 s, as benchmarks do);
- the projection: for a GPU that generates T tokens/s at a mean output length L, one GPU finishes
  T / L prompts/s; one Redis core (1 s of CPU per second) finishes 1 / (Redis CPU per prompt)
  prompts/s, so it feeds that many / (T / L) GPUs; one worker process (one core) likewise. The
  default rows: an 8B-class target near 20,000 output tokens/s per H200 and a 70B-class one near
  3,000 (published serving figures; pass your own with ``--gpu``), each at 300-token answers and
  2,000-token reasoning outputs.

The figures are for this machine's cores, which the simulators, workers and Redis share: on two
cores Redis CPU per prompt is inflated by contention, so the projection is conservative.

With ``--baseline-tree DIR`` (another checkout, e.g. ``git worktree add /tmp/base <commit>``) the same
job runs first with that checkout's workers, on a fresh Redis and fresh simulators, and the ratios
are printed: the baseline of the same run.

Run: ``python bench/scale.py [--n 2000] [--workers 2] [--servers 2] [--time-scale 0] [--idle-s 10]
[--baseline-tree DIR]``.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import redis
from _common import BENCH_JOB_ID, BENCH_NAMESPACE, SimProcess, job_spec, offline_hub, short_rows, write_jsonl
from _load import ingest
from rq import Queue
from rq.job import Job
from rq.serializers import JSONSerializer

from datagen.control.dispatch import Claimant, Dispatch
from datagen.control.job_outcomes import AckItem, AckTarget
from datagen.control.jobs import JobStore
from datagen.control.keys import Keys
from datagen.control.payload import parse_payload
from datagen.control.rq_format import payload_of
from datagen.records.storage import Storage
from datagen.settings import ENV_PREFIX
from datagen.states import JobState, PromptClass
from datagen_cli.local.redis_server import LocalRedis

DEFAULT_N = 2000
DEFAULT_WORKERS = 2
DEFAULT_SERVERS = 2
DEFAULT_IDLE_S = 10.0
DEFAULT_MAX_NEW_TOKENS = 256
# Prompts per claim measured for the control plane alone: one, a two-core worker's few, and a busy
# GPU node's tens (its completion rate times the gather window of `workers.claim.admission`).
DEFAULT_CLAIM_SIZES = "1,4,32"
# Prompts per ack call: a shard's worth, as a worker's group commit acks them.
ACK_SHARD = 64
WORKER_TIMEOUT_S = 900
TOP_COMMANDS = 10
# (label, output tokens/s per GPU): published serving figures for one H200.
DEFAULT_GPUS = ("8B=20000", "70B=3000")
OUTPUT_LENGTHS = (300, 2000)


@dataclass(frozen=True)
class Usage:
    commands: Counter[str]
    redis_cpu_s: float
    # Microseconds Redis spent executing each command (a script's includes its own calls); the rest
    # of its CPU is reading and writing sockets.
    usec: Counter[str]
    # Socket reads Redis processed: client round trips (a pipeline's commands may share one).
    reads: int


def usage(client: redis.Redis) -> Usage:
    stats = client.info("commandstats")
    cpu = client.info("cpu")
    commands = Counter({name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()})
    usec = Counter({name.removeprefix("cmdstat_"): int(v["usec"]) for name, v in stats.items()})
    reads = int(client.info("stats").get("total_reads_processed", 0))
    return Usage(commands, float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]), usec, reads)


def delta(after: Usage, before: Usage) -> Usage:
    commands = after.commands - before.commands
    commands["info"] -= 3  # our own three INFO calls
    return Usage(
        +commands,
        after.redis_cpu_s - before.redis_cpu_s,
        +(after.usec - before.usec),
        after.reads - before.reads,
    )


def worker_env(
    redis_url: str, storage: Storage, servers: list[str], *, burst_poll_s: float, tree: Path | None = None
) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    if tree is not None:
        # The baseline's workers import the other checkout's packages (its command line, from there).
        env["PYTHONPATH"] = str(tree)
    env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "DATAGEN_REDIS_URL": redis_url,
            "DATAGEN_STORAGE": str(storage.root),
            "DATAGEN_NAMESPACE": BENCH_NAMESPACE,
            "DATAGEN_METRICS_PORT": "0",
            "DATAGEN_SERVERS": ",".join(servers),
            "DATAGEN_POLL_INTERVAL_S": str(burst_poll_s),
        }
    )
    return env


def cli_module(env: dict[str, str]) -> str:
    """The command line's package in the tree the workers run from: ``datagen_cli``, or ``datagen``
    in a checkout from before it moved out of the core (issue 37)."""
    tree = env.get("PYTHONPATH")
    return "datagen" if tree and not (Path(tree) / "datagen_cli").is_dir() else "datagen_cli"


def run_workers(k: int, env: dict[str, str], log: Path) -> tuple[float, float]:
    """K burst workers; returns (wall seconds, their summed CPU seconds)."""
    command = [sys.executable, "-m", cli_module(env), "worker", "--burst"]
    cwd = env.get("PYTHONPATH")
    with open(log, "ab") as out:
        started = time.perf_counter()
        procs = [
            subprocess.Popen(command, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
            for _ in range(k)
        ]
        cpu_s = 0.0
        deadline = time.monotonic() + WORKER_TIMEOUT_S
        for proc in procs:
            # wait4 gives the child's own resource usage, which Popen.wait() throws away.
            _pid, status, rusage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
            cpu_s += rusage.ru_utime + rusage.ru_stime
            if proc.returncode != 0 or time.monotonic() > deadline:
                raise SystemExit(f"a worker exited with {proc.returncode}; see {log}")
        return time.perf_counter() - started, cpu_s


# The worker's last log line: "worker NAME stopped: P prompts started by C claims".
_STOPPED = re.compile(r"stopped: (\d+) prompts started by (\d+) claims")


def claim_size(log: Path, offset: int) -> float:
    """Prompts per claim over the workers that logged their stop after ``offset`` in ``log``."""
    with open(log, "rb") as f:
        f.seek(offset)
        found = _STOPPED.findall(f.read().decode(errors="replace"))
    claims = sum(int(c) for _, c in found)
    return sum(int(p) for p, _ in found) / claims if claims else 0.0


def idle_commands_per_s(
    client: redis.Redis, env: dict[str, str], idle_s: float, log: Path
) -> tuple[float, str]:
    """Redis commands per second of one long-running worker with nothing queued."""
    command = [sys.executable, "-m", cli_module(env), "worker"]
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            command, env=env, cwd=env.get("PYTHONPATH"), stdout=out, stderr=subprocess.STDOUT
        )
        try:
            time.sleep(min(5.0, idle_s))  # start-up: probes, registration
            before = usage(client)
            time.sleep(idle_s)
            spent = delta(usage(client), before)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    top = ", ".join(f"{name} {calls / idle_s:.1f}" for name, calls in spent.commands.most_common(6))
    return sum(spent.commands.values()) / idle_s, top


def projection(redis_cpu_ms: float, worker_cpu_ms: float, gpus: list[tuple[str, float]]) -> list[str]:
    header = "  GPU class   tok/s/GPU  output len  prompts/s/GPU  GPUs one Redis core feeds"
    lines = [header + "  GPUs one worker process feeds"]
    for label, tokens_per_s in gpus:
        for length in OUTPUT_LENGTHS:
            per_gpu = tokens_per_s / length
            redis_gpus = (1000 / redis_cpu_ms) / per_gpu if redis_cpu_ms > 0 else float("inf")
            worker_gpus = (1000 / worker_cpu_ms) / per_gpu if worker_cpu_ms > 0 else float("inf")
            lines.append(
                f"  {label:<9} {tokens_per_s:>11,.0f} {length:>11} {per_gpu:>14.1f} "
                f"{redis_gpus:>26,.0f} {worker_gpus:>31,.1f}"
            )
    return lines


def parse_gpus(values: list[str]) -> list[tuple[str, float]]:
    out = []
    for value in values:
        label, _, rate = value.partition("=")
        out.append((label, float(rate)))
    return out


@dataclass(frozen=True)
class Figures:
    wall_s: float
    commands: float  # per prompt
    ingest_commands: float
    redis_ms: float  # Redis CPU per prompt
    executing_ms: float
    worker_ms: float
    startup_cpu_s: float
    idle_per_s: float
    idle_top: str
    round_trips: float  # per prompt
    prompts_per_claim: float
    top: str
    timed: str


def measure(args: argparse.Namespace, tree: Path | None) -> Figures:
    """One whole job on a fresh Redis and fresh simulators; ``tree``: run another checkout's workers."""
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="scale-") as tmp_name:
        tmp = Path(tmp_name)
        redis_server = stack.enter_context(LocalRedis())
        client = redis.Redis.from_url(redis_server.url)
        sims = [SimProcess(time_scale=args.time_scale) for _ in range(args.servers)]
        for sim in sims:
            sim.start()
            stack.callback(sim.stop)
        servers = [f"s{i}={sim.url}" for i, sim in enumerate(sims)]
        storage = Storage(tmp / "data")
        rows_path = tmp / "prompts.jsonl"
        write_jsonl(rows_path, short_rows(args.n))
        log = tmp / "workers.log"
        env = worker_env(redis_server.url, storage, servers, burst_poll_s=0.05, tree=tree)

        # A burst worker with nothing to do: its CPU is the start-up (imports, tokenizer, probes) that
        # every worker pays once, taken out of the per-prompt figure.
        _wall, startup_cpu_s = run_workers(1, env, log)
        before = usage(client)
        ingest(client, storage, job_spec(short_max_new_tokens=args.max_new_tokens), rows_path, args.n)
        ingested = usage(client)
        log_offset = log.stat().st_size
        wall_s, worker_cpu_s = run_workers(args.workers, env, log)
        prompts_per_claim = claim_size(log, log_offset)
        spent = delta(usage(client), before)
        ingest_part = delta(ingested, before)
        progress = JobStore(client, Keys(BENCH_NAMESPACE)).progress(BENCH_JOB_ID)
        if progress.state is not JobState.COMPLETED or progress.done != args.n:
            raise SystemExit(f"the job did not complete: {progress}; see {log}")
        # Idle cost with the production defaults (the burst workers above poll faster).
        idle_env = {k: v for k, v in env.items() if k != "DATAGEN_POLL_INTERVAL_S"}
        idle_per_s, idle_top = idle_commands_per_s(client, idle_env, args.idle_s, log)
    n = args.n
    # Scripts' time includes the commands they call, which are also listed on their own.
    executing_us = sum(us for name, us in spent.usec.items() if not name.startswith("eval"))
    return Figures(
        wall_s=wall_s,
        commands=sum(spent.commands.values()) / n,
        ingest_commands=sum(ingest_part.commands.values()) / n,
        redis_ms=1000 * spent.redis_cpu_s / n,
        executing_ms=executing_us / 1000 / n,
        worker_ms=1000 * max(0.0, worker_cpu_s - args.workers * startup_cpu_s) / n,
        startup_cpu_s=startup_cpu_s,
        idle_per_s=idle_per_s,
        idle_top=idle_top,
        round_trips=spent.reads / n,
        prompts_per_claim=prompts_per_claim,
        top=", ".join(f"{name} {calls / n:.2f}" for name, calls in spent.commands.most_common(TOP_COMMANDS)),
        timed=", ".join(f"{name} {us / n:.1f}" for name, us in spent.usec.most_common(TOP_COMMANDS)),
    )


@dataclass(frozen=True)
class ClaimCost:
    size: int
    redis_ms: float  # Redis CPU per prompt: ingest, claims of ``size`` and the acks
    ingest_ms: float  # ... of which ingest
    commands: float  # per prompt, all of it


def claim_costs(
    client: redis.Redis, storage: Storage, rows: Path, n: int, sizes: list[int]
) -> list[ClaimCost]:
    """The control plane alone, at a given number of prompts per claim: the job ingested as the
    coordinator does, then claimed through the worker's claim script ``size`` prompts at a time
    and acked through its ack script a shard (``ACK_SHARD``) at a time, one client, no servers.
    What a busy GPU node's worker pays per prompt when its claims start tens of prompts (its
    completion rate times the gather window, `workers.claim.admission`), which two cores cannot reach
    in the whole run above."""
    keys = Keys(BENCH_NAMESPACE)
    dispatch = Dispatch(client, keys)
    jobs = JobStore(client, keys)
    queue = Queue(keys.queue_name(PromptClass.SHORT), connection=client)
    claimant = Claimant(queue.key, queue.started_job_registry.key, "bench", "x", ttl_s=600)
    target = AckTarget(queue.started_job_registry.key, queue.finished_job_registry.key, "x")
    out = []
    for size in sizes:
        before = usage(client)
        ingest(client, storage, job_spec(), rows, n)
        ingested = usage(client)
        claimed: list[AckItem] = []
        while items := dispatch.claim_many(PromptClass.SHORT, size, claimant):
            for item in items:
                job = Job(item.rq_id, connection=client, serializer=JSONSerializer)
                job.restore(item.fields)
                prompt = parse_payload(payload_of(job)).require()
                claimed.append(
                    AckItem(item.rq_id, prompt.job, prompt.incarnation, 1, "", "short", "stop", 600)
                )
        for start in range(0, len(claimed), ACK_SHARD):
            jobs.outcomes.ack_done(target, claimed[start : start + ACK_SHARD])
        spent = delta(usage(client), before)
        progress = jobs.progress(BENCH_JOB_ID)
        if progress.state is not JobState.COMPLETED or progress.done != n:
            raise SystemExit(f"claims of {size}: the job did not complete: {progress}")
        out.append(
            ClaimCost(
                size,
                1000 * spent.redis_cpu_s / n,
                1000 * delta(ingested, before).redis_cpu_s / n,
                sum(spent.commands.values()) / n,
            )
        )
    return out


def report(label: str, n: int, f: Figures) -> None:
    print(f"  {label}:")
    print(f"    whole run: {f.wall_s:.2f} s, {n / f.wall_s:,.0f} prompts/s (workers' start to the last exit)")
    print(
        f"    Redis: {f.commands:.1f} commands/prompt ({f.ingest_commands:.1f} of them ingest), "
        f"{f.redis_ms:.3f} ms CPU/prompt -> {1000 / f.redis_ms:,.0f} prompts/s per Redis core"
    )
    print(f"      top commands per prompt: {f.top}; client round trips per prompt: {f.round_trips:.2f}")
    print(f"      prompts per claim: {f.prompts_per_claim:.1f}")
    print(f"      executing commands: {f.executing_ms:.3f} ms/prompt; top by time (us/prompt): {f.timed}")
    print(
        f"    workers: {f.worker_ms:.2f} ms CPU/prompt (start-up of {f.startup_cpu_s:.1f} s CPU per process "
        f"taken out) -> {1000 / f.worker_ms:,.0f} prompts/s per worker process core"
    )
    print(f"    idle worker: {f.idle_per_s:.1f} Redis commands/s with nothing queued ({f.idle_top})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=DEFAULT_N)
    parser.add_argument("--workers", type=int, default=DEFAULT_WORKERS)
    parser.add_argument("--servers", type=int, default=DEFAULT_SERVERS)
    parser.add_argument("--time-scale", type=float, default=0.0)
    parser.add_argument("--idle-s", type=float, default=DEFAULT_IDLE_S)
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    parser.add_argument("--gpu", action="append", help="LABEL=TOKENS_PER_S (repeatable)")
    parser.add_argument(
        "--baseline-tree",
        type=Path,
        help="another checkout (e.g. `git worktree add /tmp/base <commit>`) whose workers run the same "
        "job first, as the baseline of the same run",
    )
    parser.add_argument(
        "--claim-sizes",
        default=DEFAULT_CLAIM_SIZES,
        help="prompts per claim for the control plane alone (comma-separated; '' skips it)",
    )
    args = parser.parse_args()
    offline_hub()
    gpus = parse_gpus(args.gpu or list(DEFAULT_GPUS))
    sizes = [int(v) for v in args.claim_sizes.split(",") if v.strip()]
    costs = []
    if sizes:
        with LocalRedis() as redis_server, tempfile.TemporaryDirectory(prefix="scale-") as tmp_name:
            rows = Path(tmp_name) / "prompts.jsonl"
            write_jsonl(rows, short_rows(args.n))
            client = redis.Redis.from_url(redis_server.url)
            costs = claim_costs(client, Storage(Path(tmp_name) / "data"), rows, args.n, sizes)
    baseline = measure(args, args.baseline_tree.resolve()) if args.baseline_tree else None
    ours = measure(args, None)
    n = args.n
    print(
        f"scale: N={n} prompts, {args.workers} worker processes x {args.servers} simulated servers "
        f"(time scale {args.time_scale}), one Redis; {os.cpu_count()} CPUs shared by all"
    )
    if baseline is not None:
        report(f"baseline: workers of {args.baseline_tree}", n, baseline)
    report("this tree", n, ours)
    if baseline is not None:
        print(
            f"  ratios (this tree / baseline): commands/prompt {ours.commands / baseline.commands:.2f}x, "
            f"Redis CPU/prompt {ours.redis_ms / baseline.redis_ms:.2f}x, worker CPU/prompt "
            f"{ours.worker_ms / baseline.worker_ms:.2f}x, idle commands/s "
            f"{ours.idle_per_s / baseline.idle_per_s:.2f}x, "
            f"whole-run prompts/s {baseline.wall_s / ours.wall_s:.2f}x"
        )
    print("  projection for this tree (prompts/s per GPU = tokens/s / output length):")
    for line in projection(ours.redis_ms, ours.worker_ms, gpus):
        print(line)
    if costs:
        print(
            f"  the control plane alone (one client, no servers; acks {ACK_SHARD} per call, as a shard "
            "commits), by prompts per claim:"
        )
        for cost in costs:
            print(
                f"    {cost.size:>4} per claim: Redis {cost.redis_ms:.3f} ms CPU/prompt "
                f"({cost.ingest_ms:.3f} of it ingest), {cost.commands:.1f} commands/prompt -> "
                f"{1000 / cost.redis_ms:,.0f} prompts/s per Redis core"
            )
        busy = costs[-1]
        print(f"  projection at {busy.size} prompts per claim (a busy GPU node's worker):")
        for line in projection(busy.redis_ms, ours.worker_ms, gpus):
            print(line)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"  (this script's own peak memory: {peak_mib:.0f} MiB)")


if __name__ == "__main__":
    main()
