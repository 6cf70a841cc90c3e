"""The worker's capture path against a bare speculators-style client, both timed whole, on the same
simulated capture server in the same run (the issue's target: ours ≥ 0.95x the baseline).

One ``datagen sim --api vllm`` child process captures hidden states into a temporary directory:
``--capture-layers`` 2,16,29,32 of 32, hidden size ``--hidden`` 1,024, bf16, each file written
``--write-delay-ms`` 20 after its answer. At ``--time-scale`` 1 the simulated prefill runs about
20,000 tokens/s (an 8B target on one H200 does about 27,000); a smaller scale makes the server
faster until this machine's CPUs, not the simulated GPU, set the pace. N sequences of random token
ids (fixed seed, lengths uniform within ±25 % of ``--tokens`` 512: about 4 MiB a file) are
captured by each line, C requests in flight and 2C sequences under way, as speculators runs it
(``--concurrency`` 32 requests, twice as many async workers):

``baseline``
    What ``vllm-project/speculators`` ``scripts/data_generation_offline.py`` does: one
    ``httpx.AsyncClient`` (a pool of C connections), ``POST /v1/completions`` with the prompt ids,
    ``max_tokens`` 1 and ``return_token_ids`` under an ``asyncio.Semaphore(C)``, the echo checked,
    then ``flock(LOCK_EX | LOCK_NB)`` on ``<file>.lock`` polled every ``--poll-s`` (0.1 s, as
    speculators; the project polls every 20 ms), the lock deleted, and ``shutil.move`` of the file
    to an output directory (the same file system: a rename) as ``hs_{i}.safetensors``. No check
    of the file, no hash, no fsync.
``ours bf16`` / ``ours fp8``
    ``workers.run.capture.Capturer.capture`` for each sequence as a ``Record``: a slot on a
    ``Fleet`` holding the simulator as one capture server (built as ``Worker._make_server`` does,
    C capture slots, probed as the health probe does), the request, the lock awaited, the file
    checked and copied into the spool (ids, rows, layers, finite values, sha256, fsync; FP8 with
    per-token scales for ``fp8``), adopted into a local ``Storage`` (fsync, rename), and the
    server's file and lock deleted.

Every line runs ``--rounds`` times (2), the order reversed every other round, all in this process
after one warm-up of each path; the output and storage directories are emptied between runs.
Printed per run: wall seconds (first request to last file stored), sequences/s, prompt tokens/s,
GB/s of captured bf16 hidden-state bytes, ``x base`` (the same round's baseline wall / this
wall), ``steady tok/s`` and ``steady x`` (the tokens of the sequences finished between the times
by which 5 % and 95 % had finished, over that span, and its ratio to the baseline's), this
process's CPU seconds per GB (``time.process_time``, threads included), the simulator's
(``/proc/PID/stat``), and ``cores``: both processes' CPU seconds over the wall (this machine's
CPUs bound it). Then each line's median and a projection: an 8B target on one H200 captures
about 27k prefill tokens/s, about 0.9 GB/s at 32 KiB a token (4 layers x 4,096 x bf16), so one
busy core of a worker process keeps up with ``1 / (CPU s/GB x 0.9)`` such servers; and the same
with the CPU split into a per-token part and a per-byte part (`print_summary`).

``--profile`` runs ``ours bf16`` once more with each phase of ``Capturer._once`` timed (wall
seconds summed over the captures, and the CPU seconds of the phases that run in a thread) by
wrappers this script puts around the capturer's collaborators, then under cProfile (the event
loop's thread only) with its top functions.

Run: ``python bench/capture.py [--n 300] [--concurrency 32] [--tokens 512] [--hidden 1024]
[--layers 2,16,29,32] [--num-layers 32] [--time-scale 1] [--write-delay-ms 20] [--poll-s 0.1]
[--rounds 2] [--no-fp8] [--profile] [--dir DIR]`` (about a minute at the defaults).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import fcntl
import inspect
import io
import os
import pstats
import shutil
import statistics
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from _common import SimProcess, offline_hub

import workers.run.capture as capture_module
from datagen.features.capture_file import check_and_store
from datagen.features.locks import wait_for_write
from datagen.records.schema import Record
from datagen.records.storage import Storage
from datagen.settings import WorkerSettings
from datagen.spec import FeatureDtype, FeaturesSpec
from datagen.states import EngineChoice, PromptClass, ServerRole
from workers.engines.detect import build_engine
from workers.engines.http import ClientTimeouts
from workers.fleet.servers import CAPTURE_CLASS, Fleet, Server
from workers.metrics import WorkerMetrics
from workers.run.capture import Capturer

DEFAULT_N = 300
DEFAULT_CONCURRENCY = 32
DEFAULT_TOKENS = 512
DEFAULT_HIDDEN = 1024
DEFAULT_LAYERS = "2,16,29,32"
DEFAULT_NUM_LAYERS = 32
DEFAULT_TIME_SCALE = 1.0
DEFAULT_WRITE_DELAY_MS = 20.0
# speculators' wait_for_lock_async(poll_interval=0.1).
DEFAULT_POLL_S = 0.1
DEFAULT_ROUNDS = 2
# Sequence lengths are uniform within this fraction of --tokens.
LENGTH_SPREAD = 0.25
# Token ids every vocabulary has (the simulator's bundled tokenizer has about 128k).
TOKEN_ID_RANGE = (100, 30_000)
SEED = 1234
# speculators: 2 x concurrency async workers, concurrency requests in flight.
WORKERS_PER_SLOT = 2
# speculators' lock bound and request timeout.
LOCK_TIMEOUT_S = 10.0
REQUEST_TIMEOUT_S = 120.0
BENCH_JOB_ID = "bench_capture"
BF16_BYTES = 2
GB = 1e9
# The projection: an 8B target on one H200 (the figures).
H200_PREFILL_TOK_S = 27_000
H200_BYTES_PER_TOKEN = 32 * 1024
PROFILE_TOP = 20
LINE_BASELINE = "baseline"
# The steady state: between the times by which these shares of the sequences had finished.
STEADY_LOW, STEADY_HIGH = 0.05, 0.95


@dataclass(frozen=True)
class Done:
    at: float  # perf_counter
    tokens: int


def steady_tok_s(done: list[Done]) -> float:
    """Tokens/s of the sequences finished between the 5th and the 95th percentile of finish times:
    the rate while work remains, without the start and the tail."""
    at = sorted(d.at for d in done)
    t5, t95 = at[int(STEADY_LOW * (len(at) - 1))], at[int(STEADY_HIGH * (len(at) - 1))]
    tokens = sum(d.tokens for d in done if t5 < d.at <= t95)
    return tokens / (t95 - t5) if t95 > t5 else float("nan")


@dataclass(frozen=True)
class Run:
    line: str
    round: int
    wall_s: float
    cpu_s: float
    sim_cpu_s: float
    sequences: int
    tokens: int
    captured_bytes: int
    steady_tok_s: float

    @property
    def gb(self) -> float:
        return self.captured_bytes / GB


def sequences(n: int, tokens: int) -> list[list[int]]:
    rng = np.random.default_rng(SEED)
    low, high = int(tokens * (1 - LENGTH_SPREAD)), int(tokens * (1 + LENGTH_SPREAD))
    lengths = rng.integers(low, high + 1, size=n)
    return [rng.integers(*TOKEN_ID_RANGE, size=int(k)).tolist() for k in lengths]


def captured_bytes(seqs: list[list[int]], layers: int, hidden: int) -> int:
    """The hidden-state bytes the server writes for ``seqs`` (bf16; headers and ids aside)."""
    return sum(len(s) for s in seqs) * layers * hidden * BF16_BYTES


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def bounded(
    items: list[list[int]], workers: int, each: Callable[[int, list[int]], Awaitable[None]]
) -> list[Done]:
    """``each(i, item)`` for every item, ``workers`` at a time (speculators' worker pool); when
    each one finished, in order."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(items)):
        queue.put_nowait(i)
    done: list[Done] = []

    async def worker() -> None:
        while not queue.empty():
            i = queue.get_nowait()
            await each(i, items[i])
            done.append(Done(time.perf_counter(), len(items[i])))

    await asyncio.gather(*(worker() for _ in range(workers)))
    return done


# The baseline ---------------------------------------------------------------------------------------
def _lock_free(lock: str) -> bool:
    """speculators' check: ``flock(LOCK_EX | LOCK_NB)`` succeeds."""
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def _exists(path: str) -> bool:
    return os.path.exists(path)


async def _wait_lock(lock: str, poll_s: float) -> None:
    deadline = time.monotonic() + LOCK_TIMEOUT_S
    while not _lock_free(lock):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{lock} still held after {LOCK_TIMEOUT_S} s")
        await asyncio.sleep(poll_s)
    os.remove(lock)


async def run_baseline(
    url: str, seqs: list[list[int]], out: Path, *, concurrency: int, poll_s: float
) -> list[Done]:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=REQUEST_TIMEOUT_S) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        requests = asyncio.Semaphore(concurrency)

        async def one(i: int, ids: list[int]) -> None:
            body = {"model": model, "prompt": ids, "max_tokens": 1, "return_token_ids": True}
            async with requests:
                response = await client.post("/v1/completions", json=body)
            response.raise_for_status()
            reply = response.json()
            if reply["choices"][0]["prompt_token_ids"] != ids:
                raise RuntimeError(f"sequence {i}: prompt token ids mismatch")
            path = reply["kv_transfer_params"]["hidden_states_path"]
            if _exists(f"{path}.lock"):
                await _wait_lock(f"{path}.lock", poll_s)
            await asyncio.to_thread(shutil.move, path, out / f"hs_{i}.safetensors")

        return await bounded(seqs, WORKERS_PER_SLOT * concurrency, one)


# The project's path ---------------------------------------------------------------------------------
def _record(i: int, ids: list[int]) -> Record:
    """A generated record as the capture sees it: only the job, the sample and the ids matter."""
    return Record(
        job_id=BENCH_JOB_ID,
        sample_id=f"s{i}",
        turn=0,
        gen=0,
        partition="train",
        cls=PromptClass.SHORT.value,
        input_ids=ids,
        prompt_len=len(ids),
        finish_type="length",
        finish_matched=None,
        finish_length=None,
        max_new_tokens=1,
        server="",
        tokenizer="bench",
        sampling_params="{}",
        rid=f"bench-{i}",
        worker="bench",
        attempts=1,
        cached_tokens=0,
        num_retractions=0,
        e2e_latency_s=None,
        enqueued_at_ms=None,
        started_at_ms=0,
        finished_at_ms=0,
    )


@dataclass
class Ours:
    capturer: Capturer
    fleet: Fleet
    storage: Storage

    async def aclose(self) -> None:
        for server in self.fleet.servers:
            await server.client.aclose()


async def start_ours(url: str, capture_dir: Path, storage_dir: Path, *, concurrency: int) -> Ours:
    """A capturer over one capture server, probed as `workers.fleet.health.HealthProbe` does."""
    settings = WorkerSettings(
        capture_dir=capture_dir, capture_concurrency=concurrency, storage=str(storage_dir)
    )
    metrics = WorkerMetrics()
    servers = []
    for role in (ServerRole.GENERATE, ServerRole.CAPTURE):
        # Worker._make_server's: vLLM forced, capture_concurrency connections and capture slots.
        timeouts = ClientTimeouts(connect_s=settings.connect_timeout_s, read_s=settings.long_read_timeout_s)
        client = build_engine(
            f"sim-{role.value}", url, choice=EngineChoice.VLLM, timeouts=timeouts, max_connections=concurrency
        )
        limits = dict.fromkeys(PromptClass, 0) | {CAPTURE_CLASS: concurrency}
        servers.append(Server(client.name, client, max_limits=limits, up=False, role=role))
    # A fleet needs a generation server; this one is never asked for a slot.
    fleet = Fleet(servers, metrics)
    storage = Storage(storage_dir)
    capturer = Capturer(settings, fleet, storage, metrics, tag="bench")
    server = fleet.capturers[0]
    await server.client.start()
    server.context_len = (await server.client.facts()).context_len
    reason = await capturer.probe(server)
    if reason is not None:
        raise RuntimeError(reason)
    await fleet.mark_up(server)
    return Ours(capturer, fleet, storage)


async def run_ours(
    ours: Ours, seqs: list[list[int]], features: FeaturesSpec, *, concurrency: int
) -> list[Done]:
    async def one(i: int, ids: list[int]) -> None:
        stored = await ours.capturer.capture(_record(i, ids), features, rq_id=f"bench-{i}")
        if stored.features_file is None:
            raise RuntimeError(f"sequence {i}: {stored.features_error}")

    return await bounded(seqs, WORKERS_PER_SLOT * concurrency, one)


# Phases of the project's path (--profile) -----------------------------------------------------------
@dataclass
class Phases:
    wall_s: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    cpu_s: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, name: str, wall_s: float, cpu_s: float | None = None) -> None:
        with self.lock:
            self.wall_s[name] += wall_s
            if cpu_s is not None:
                self.cpu_s[name] += cpu_s

    def in_thread(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(name, time.perf_counter() - t0, time.thread_time() - c0)

        return timed

    def awaited(self, name: str, fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return await fn(*args, **kwargs)
            finally:
                self.add(name, time.perf_counter() - t0)

        return timed


@contextmanager
def phases_timed(ours: Ours, phases: Phases) -> Iterator[None]:
    """Time ``Capturer._once``'s phases by wrapping what it calls (this script's objects only, and
    the capture module's two imported functions, restored after)."""
    client = ours.fleet.capturers[0].client.current()
    module_fns = {"check_and_store": check_and_store, "wait_for_write": wait_for_write}
    wrapped: list[tuple[object, str]] = [
        (ours.fleet, "acquire"),
        (client, "capture"),
        (ours.storage, "adopt_feature"),
        (ours.capturer, "_clean"),
    ]
    patched = {
        "check_and_store": phases.in_thread("check_and_store", check_and_store),
        "wait_for_write": phases.awaited("wait_for_write", wait_for_write),
    }
    for name, timed_fn in patched.items():
        setattr(capture_module, name, timed_fn)
    names = {"acquire": "slot", "capture": "request", "adopt_feature": "adopt_feature", "_clean": "delete"}
    for obj, attr in wrapped:
        fn = getattr(obj, attr)
        timed = (
            phases.awaited(names[attr], fn)
            if inspect.iscoroutinefunction(fn)
            else phases.in_thread(names[attr], fn)
        )
        setattr(obj, attr, timed)
    try:
        yield
    finally:
        for name, original in module_fns.items():
            setattr(capture_module, name, original)
        for obj, attr in wrapped:
            delattr(obj, attr)


async def profile(
    ours: Ours, seqs: list[list[int]], features: FeaturesSpec, storage: Path, concurrency: int
) -> None:
    phases = Phases()
    _empty(storage)
    cpu0, t0 = time.process_time(), time.perf_counter()
    with phases_timed(ours, phases):
        await run_ours(ours, seqs, features, concurrency=concurrency)
    wall_s, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    n = len(seqs)
    print(f"\nphases of ours bf16 ({n} captures, wall {wall_s:.2f} s, CPU {cpu:.2f} s), per capture:")
    print(f"  {'phase':<16} {'wall ms':>8} {'thread CPU ms':>14}")
    for name, total in phases.wall_s.items():
        thread_cpu = phases.cpu_s.get(name)
        shown = f"{thread_cpu / n * 1000:>14.2f}" if thread_cpu is not None else f"{'-':>14}"
        print(f"  {name:<16} {total / n * 1000:>8.2f} {shown}")
    _empty(storage)
    profiler = cProfile.Profile()
    profiler.enable()
    await run_ours(ours, seqs, features, concurrency=concurrency)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(PROFILE_TOP)
    print("\ncProfile of ours bf16 (the event loop's thread), by own time:")
    print(text.getvalue())


# Running --------------------------------------------------------------------------------------------
def _empty(directory: Path) -> None:
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)


async def bench(args: argparse.Namespace, sim: SimProcess, tmp: Path) -> list[Run]:
    assert sim.proc is not None
    layers = [int(x) for x in args.layers.split(",")]
    seqs = sequences(args.n, args.tokens)
    nbytes, tokens = captured_bytes(seqs, len(layers), args.hidden), sum(map(len, seqs))
    out, jobs = tmp / "out", tmp / "storage" / "jobs"
    _empty(out)
    ours = await start_ours(sim.url, tmp / "capture", tmp / "storage", concurrency=args.concurrency)
    lines = [LINE_BASELINE, "ours bf16"] + ([] if args.no_fp8 else ["ours fp8"])
    runs: list[Run] = []
    try:
        # A warm-up of each path: connections open, first calls made.
        warm = seqs[: args.concurrency]
        await run_baseline(sim.url, warm, out, concurrency=args.concurrency, poll_s=args.poll_s)
        await run_ours(ours, warm, FeaturesSpec(layers=layers), concurrency=args.concurrency)
        for rnd in range(args.rounds):
            for line in lines if rnd % 2 == 0 else lines[::-1]:
                _empty(out)
                _empty(jobs)
                if line == LINE_BASELINE:
                    body = run_baseline(sim.url, seqs, out, concurrency=args.concurrency, poll_s=args.poll_s)
                else:
                    spec = FeaturesSpec(layers=layers, dtype=FeatureDtype(line.split()[-1]))
                    body = run_ours(ours, seqs, spec, concurrency=args.concurrency)
                sim0, cpu0, t0 = cpu_s(sim.proc.pid), time.process_time(), time.perf_counter()
                done = await body
                wall_s, cpu = time.perf_counter() - t0, time.process_time() - cpu0
                runs.append(
                    Run(
                        line,
                        rnd,
                        wall_s,
                        cpu,
                        cpu_s(sim.proc.pid) - sim0,
                        len(seqs),
                        tokens,
                        nbytes,
                        steady_tok_s(done),
                    )
                )
            for run in runs[-len(lines) :]:
                print_run(run, runs)
        if args.profile:
            await profile(ours, seqs, FeaturesSpec(layers=layers), jobs, args.concurrency)
    finally:
        await ours.aclose()
    return runs


# Reporting ------------------------------------------------------------------------------------------
def _baseline_of(run: Run, runs: list[Run]) -> Run:
    return next(r for r in runs if r.line == LINE_BASELINE and r.round == run.round)


def print_header() -> None:
    print(
        f"{'line':<10} {'round':>5} {'wall s':>7} {'seq/s':>7} {'tok/s':>8} {'GB/s':>6} {'x base':>7} "
        f"{'steady tok/s':>12} {'steady x':>8} {'CPU s/GB':>9} {'sim s/GB':>9} {'cores':>6}"
    )


def print_run(run: Run, runs: list[Run]) -> None:
    base = _baseline_of(run, runs)
    ratio = base.wall_s / run.wall_s
    rates = f"{run.sequences / run.wall_s:>7.1f} {run.tokens / run.wall_s:>8.0f} {run.gb / run.wall_s:>6.3f}"
    steady = f"{run.steady_tok_s:>12.0f} {run.steady_tok_s / base.steady_tok_s:>8.3f}"
    cpu = f"{run.cpu_s / run.gb:>9.2f} {run.sim_cpu_s / run.gb:>9.2f}"
    print(
        f"{run.line:<10} {run.round:>5} {run.wall_s:>7.2f} {rates} {ratio:>7.3f} {steady} {cpu} "
        f"{(run.cpu_s + run.sim_cpu_s) / run.wall_s:>6.2f}",
        flush=True,
    )


def print_summary(runs: list[Run]) -> None:
    """Each line's medians, and what one worker core keeps up with on a node of H200s.

    Two projections: at the measured CPU seconds per GB as they are (``per core``), and split into
    a per-token part (the baseline's CPU per token: HTTP and the JSON ids, which scale with tokens)
    and a per-byte part (this line's CPU per GB beyond the baseline's: reading, checking, hashing
    and writing the file), which an H200's 4,096-wide hidden states weigh far more than this run's.
    """
    server_gb_s = H200_PREFILL_TOK_S * H200_BYTES_PER_TOKEN / GB
    base = [r for r in runs if r.line == LINE_BASELINE]
    base_cpu_per_token = statistics.median(r.cpu_s / r.tokens for r in base)
    base_cpu_per_gb = statistics.median(r.cpu_s / r.gb for r in base)
    print("\nmedian over rounds (x base: each round's baseline wall / this line's, then the median):")
    print(
        f"projection: one H200 capture server of an 8B target = {H200_PREFILL_TOK_S:,} tok/s = "
        f"{server_gb_s:.2f} GB/s of bf16 hidden states"
    )
    for line in dict.fromkeys(r.line for r in runs):
        mine = [r for r in runs if r.line == line]
        ratios = [_baseline_of(r, runs).wall_s / r.wall_s for r in mine]
        steady = [r.steady_tok_s / _baseline_of(r, runs).steady_tok_s for r in mine]
        wall_s = statistics.median(r.wall_s for r in mine)
        cpu_per_gb = statistics.median(r.cpu_s / r.gb for r in mine)
        split_cores = (
            base_cpu_per_token * H200_PREFILL_TOK_S + max(0.0, cpu_per_gb - base_cpu_per_gb) * server_gb_s
        )
        print(
            f"  {line:<10} wall {wall_s:.2f} s, {mine[0].gb / wall_s:.3f} GB/s, x base "
            f"{statistics.median(ratios):.3f} ({', '.join(f'{x:.3f}' for x in ratios)}), steady x "
            f"{statistics.median(steady):.3f} ({', '.join(f'{x:.3f}' for x in steady)})\n"
            f"  {'':<10} CPU {cpu_per_gb:.2f} s/GB = {1 / cpu_per_gb:.2f} GB/s per busy core = "
            f"{1 / cpu_per_gb / server_gb_s:.1f} servers per worker core; split "
            f"({base_cpu_per_token * 1e6:.1f} us/token + {max(0.0, cpu_per_gb - base_cpu_per_gb):.2f} s/GB): "
            f"{split_cores:.2f} cores per server = {1 / split_cores:.1f} servers per worker core"
        )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--n", type=int, default=DEFAULT_N)
    parser.add_argument("--concurrency", type=int, default=DEFAULT_CONCURRENCY)
    parser.add_argument("--tokens", type=int, default=DEFAULT_TOKENS)
    parser.add_argument("--hidden", type=int, default=DEFAULT_HIDDEN)
    parser.add_argument("--layers", default=DEFAULT_LAYERS)
    parser.add_argument("--num-layers", type=int, default=DEFAULT_NUM_LAYERS)
    parser.add_argument("--time-scale", type=float, default=DEFAULT_TIME_SCALE)
    parser.add_argument("--write-delay-ms", type=float, default=DEFAULT_WRITE_DELAY_MS)
    parser.add_argument("--poll-s", type=float, default=DEFAULT_POLL_S)
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS)
    parser.add_argument("--no-fp8", action="store_true")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--dir", default=None, help="where the temporary directory goes (default: $TMPDIR)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    offline_hub()
    layers = args.layers.split(",")
    seqs = sequences(args.n, args.tokens)
    nbytes = captured_bytes(seqs, len(layers), args.hidden)
    print(
        f"{args.n} sequences, {sum(map(len, seqs)):,} tokens, {nbytes / GB:.2f} GB of bf16 hidden states "
        f"({len(layers)} layers x {args.hidden}); C = {args.concurrency} requests in flight, "
        f"{WORKERS_PER_SLOT * args.concurrency} sequences under way; time scale {args.time_scale:g}, write "
        f"delay {args.write_delay_ms:g} ms; the baseline polls the lock every {args.poll_s:g} s; "
        f"{os.cpu_count()} CPUs, load {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    with tempfile.TemporaryDirectory(prefix="bench-capture-", dir=args.dir) as name:
        tmp = Path(name)
        sim = SimProcess(
            time_scale=args.time_scale,
            api="vllm",
            capture_dir=str(tmp / "capture"),
            capture_layers=args.layers,
            capture_num_layers=args.num_layers,
            capture_hidden_size=args.hidden,
            capture_write_delay_ms=args.write_delay_ms,
        )
        sim.start()
        try:
            print_header()
            runs = asyncio.run(bench(args, sim, tmp))
        finally:
            sim.stop()
    print_summary(runs)
    print(f"load after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
