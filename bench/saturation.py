"""Saturating one KV-bound server: a hand-written asyncio script against datagen, with and without
the KV-pressure controller.

One simulated SGLang server (``datagen sim`` in a child process) with a small KV pool
(``--kv-tokens``) and SGLang's admission rule at its usual steady-state reserve
(``--reserve-fraction 0.1``, SGLang's ``min_new_token_ratio``), so that the number of running
requests is set by the KV pool (a few dozen), far below ``max_running_requests`` (256). With
``--api vllm`` the simulator speaks vLLM's ``/v1/completions`` and metrics instead (the same
engine and token model; its context is the KV pool, as vLLM requires), the plain client posts
there, and the worker finds out by itself which engine it talks to. Output
lengths are the simulator's heavy-tailed lognormal draws (median about 200 tokens, p99 about
1,500, cut at ``--max-new-tokens``), and depend only on the prompt ids and ``sampling_seed``: every
variant sends the same N prompts and must generate the same number of tokens, which is checked.

Variants:

``(a) plain c=C``
    What people write by hand: ``asyncio.Semaphore(C)`` around ``httpx.AsyncClient.post`` of
    ``{"input_ids", "sampling_params"}`` to ``/generate``, all prompts gathered at once (vLLM:
    the worker's own ``/v1/completions`` body, token-id ``prompt`` with ``return_token_ids``,
    reading ``choices[0].token_ids``). Given a connection pool as large as C and no timeouts; no
    Redis, no storage. Swept over ``--sweep``; the best C is ``best(a)``.
``(b) datagen c=best``
    ``Ingestor.run`` (not timed) then ``Worker`` in burst mode with ``short_concurrency`` = the best
    C of (a) and ``kv_controller=False``: RQ bookkeeping, Parquet records committed before each
    job finishes. Timed from ``Worker.main()`` to its return.
``(c) datagen from 512 + controller``
    The same with ``short_concurrency=--start-limit`` (too high on purpose) and the KV controller
    on (``controller_interval_s`` 0.5 s), which must find the right in-flight target by itself.

Columns, first the throughput table:

- ``wall s``: the whole run: (a) from its first request to its last answer; (b) and (c) from
  ``Worker.main()`` to its return (startup, the last commit and the drain included).
- ``whole tok/s`` and ``whole x``: all generated tokens / wall, and its ratio to best(a), the (a)
  with the highest whole-run tok/s (the best hand-tuned client; issue #12's target for (c): at
  least 0.95).
- ``steady tok/s`` and ``steady x``: throughput while prompts remain queued, i.e. without the start
  and the tail. With t5 and t95 the times by which 5 % and 95 % of the prompts had completed, it is
  the output tokens of the prompts completing in (t5, t95], over t95 - t5. Its ratio is to the
  highest steady tok/s of (a).
- ``q95/run``: the server queue's p95 (``sglang:num_queue_reqs``; vLLM: ``vllm:num_requests_waiting``)
  over the whole run divided by the mean running requests (``sglang:num_running_reqs``;
  ``vllm:num_requests_running``): work parked in the server, which cannot move, pause or survive
  a restart (target for (c): at most 0.1).
- ``first s`` and ``tail s``: when the first prompt completed, from the start of the wall; and
  how long the last 5 % of prompts took (wall end - t95).

Then the server's own gauges sampled from ``/metrics`` every 0.25 s during the variant, each as
mean/p95: ``sglang:token_usage`` (KV), ``sglang:num_running_reqs`` (run), ``sglang:num_queue_reqs``
(wait), and the retractions counted meanwhile (vLLM: ``vllm:kv_cache_usage_perc``,
``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:num_preemptions_total``); and
the CPU seconds of this process during the variant (the client; the simulator and Redis are other
processes).

How to read it: the baseline is KV-bound when ``run`` stays far below 256 while ``wait`` is above
zero (the server had work queued and admitted no more); the simulator is not the bottleneck when
the variants that hold few requests in flight still reach the same tokens/s. For (c), the line
under the table gives p95 of waiting against mean running: a controller that keeps work out of
the server's queue keeps that p95 small, and the trace of its limit shows slow start (a small
window doubling until the server queues) and then the steady rules.

Run: ``python bench/saturation.py [--api sglang|vllm] [--n 600] [--time-scale 0.05]
[--sweep 16,32,64,128,256]`` (about three minutes on two cores).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import redis
from _common import offline_hub, short_rows, simulator_process, sweep_spec
from _load import (
    APIS,
    STATS_HEADER,
    Api,
    ServerSampler,
    Stats,
    ingest,
    percentile,
    plain_run,
    read_records,
    render,
    run_worker,
    worker_settings,
)

from datagen.records.storage import Storage
from datagen.states import PromptClass
from datagen_cli.local.redis_server import LocalRedis
from workers.worker import Worker

DEFAULT_N = 600
DEFAULT_TIME_SCALE = 0.05
DEFAULT_KV_TOKENS = 16384
DEFAULT_RESERVE_FRACTION = 0.1
DEFAULT_MAX_NEW_TOKENS = 2048
DEFAULT_SWEEP = "16,32,64,128,256"
DEFAULT_START_LIMIT = 512
DEFAULT_CONTROLLER_INTERVAL_S = 0.5
SERVER = "sim"
# Issue #12's targets for (c): whole-run tok/s against best(a), server-queue p95 against running.
TARGET_RATIO = 0.95
TARGET_QUEUE_RATIO = 0.1
# The steady-state window: between these percentiles of the completion times.
STEADY_FROM_PCT = 5
STEADY_TO_PCT = 95
TRACE_INTERVAL_S = 0.25
PROMPTS_FILE = "prompts.jsonl"
TRACE_SHOWN = 14
# The server queue counts as drained at or below this (the controller's own tolerance).
QUEUE_DRAINED = 2


@dataclass(frozen=True)
class Line:
    label: str
    wall_s: float
    tokens: int
    stats: Stats
    cpu_s: float
    # Per prompt: seconds from the start of the wall to its completion, and its output tokens.
    completions: list[tuple[float, int]]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s

    @property
    def steady_tokens_per_s(self) -> float:
        """Output tokens of the prompts completing in (t5, t95], over t95 - t5."""
        times = [t for t, _ in self.completions]
        t_from, t_to = percentile(times, STEADY_FROM_PCT), percentile(times, STEADY_TO_PCT)
        tokens = sum(n for t, n in self.completions if t_from < t <= t_to)
        return tokens / (t_to - t_from) if t_to > t_from else 0.0

    @property
    def first_s(self) -> float:
        return min((t for t, _ in self.completions), default=0.0)

    @property
    def tail_s(self) -> float:
        return self.wall_s - percentile([t for t, _ in self.completions], STEADY_TO_PCT)

    @property
    def queue_ratio(self) -> float:
        """The server queue's p95 over the mean running requests, over the whole run."""
        return self.stats.queue_p95 / self.stats.running_mean if self.stats.running_mean else 0.0


def trace_limits(trace: list[tuple[float, int, int]]) -> Callable[[Worker], Awaitable[None]]:
    """A watcher that records (time, this worker's short limit, in flight) every TRACE_INTERVAL_S."""

    async def watch(worker: Worker) -> None:
        server = worker.fleet.servers[0]
        while True:
            cls = PromptClass.SHORT
            trace.append((time.perf_counter(), server.limits[cls], server.in_flight[cls]))
            await asyncio.sleep(TRACE_INTERVAL_S)

    return watch


@dataclass(frozen=True)
class DatagenRun:
    line: Line
    trace: list[tuple[float, int, int]]  # (perf_counter, this worker's short limit, in flight)
    started_at: float
    sampler: ServerSampler


def run_datagen(
    label: str, client: redis.Redis, urls: tuple[str, str, Path], args: argparse.Namespace, **opts: object
) -> DatagenRun:
    """Ingest, then one burst worker.

    ``urls``: the simulator's URL, Redis's URL and the working directory (prompts.jsonl in it).
    """
    url, redis_url, tmp = urls
    storage = Storage(tempfile.mkdtemp(prefix="storage-", dir=tmp))
    ingest(client, storage, sweep_spec(args), tmp / PROMPTS_FILE, args.n)
    settings = worker_settings(redis_url, storage, args.time_scale, **opts)
    trace: list[tuple[float, int, int]] = []
    with ServerSampler({SERVER: url}, apis={SERVER: APIS[args.api]}) as sampler:
        run = asyncio.run(run_worker(settings, {SERVER: url}, trace_limits(trace)))
    records = read_records(client, storage, args.n)
    tokens = sum(r["output_len"] for r in records)
    # Records carry wall-clock milliseconds; the run's start is a perf_counter.
    started_ms = (time.time() - (time.perf_counter() - run.started_at)) * 1000
    completions = [((r["finished_at_ms"] - started_ms) / 1000, r["output_len"]) for r in records]
    line = Line(label, run.wall_s, tokens, sampler.stats(SERVER), run.cpu_s - sampler.cpu_s, completions)
    return DatagenRun(line, trace, run.started_at, sampler)


def report(sweep: list[Line], ours: list[Line], args: argparse.Namespace) -> None:
    best = max(sweep, key=lambda line: line.tokens_per_s)
    best_steady = max(sweep, key=lambda line: line.steady_tokens_per_s)
    print(
        f"saturation: N={args.n} prompts, time_scale={args.time_scale}, kv_tokens={args.kv_tokens}, "
        f"reserve_fraction={args.reserve_fraction}, max_new_tokens={args.max_new_tokens}, "
        f"max_running_requests=256{'' if args.api == 'sglang' else f', api={args.api}'}"
    )
    print(
        f"  {'variant':<34} {'wall s':>7} {'whole tok/s':>11} {'whole x':>8} {'steady tok/s':>12} "
        f"{'steady x':>8} {'q95/run':>7} {'first s':>7} {'tail s':>6}"
    )
    for line in [*sweep, *ours]:
        marks = [m for m, b in (("best(a)", best), ("best steady(a)", best_steady)) if line is b]
        print(
            f"  {line.label:<34} {line.wall_s:7.2f} {line.tokens_per_s:11.0f} "
            f"{line.tokens_per_s / best.tokens_per_s:7.3f}x {line.steady_tokens_per_s:12.0f} "
            f"{line.steady_tokens_per_s / best_steady.steady_tokens_per_s:7.3f}x {line.queue_ratio:7.2f} "
            f"{line.first_s:7.2f} {line.tail_s:6.2f}{'  <- ' + ', '.join(marks) if marks else ''}"
        )
    print(f"\n  {'variant':<34} {STATS_HEADER}   {'CPU s':>6}")
    for line in [*sweep, *ours]:
        print(f"  {line.label:<34} {line.stats.brief()}   {line.cpu_s:6.2f}")
    counts = {line.tokens for line in [*sweep, *ours]}
    same = "equal in every variant" if len(counts) == 1 else "MISMATCH"
    print(f"  generated tokens: {sorted(counts)} ({same})")
    for line in ours:
        ratio = line.tokens_per_s / best.tokens_per_s
        steady = line.steady_tokens_per_s / best_steady.steady_tokens_per_s
        verdict = "met" if ratio >= TARGET_RATIO else "NOT met"
        queue = "met" if line.queue_ratio <= TARGET_QUEUE_RATIO else "NOT met"
        print(
            f"  {line.label}: whole run {ratio:.3f} x best(a) (target >= {TARGET_RATIO}: {verdict}), "
            f"steady state {steady:.3f} x; server queue p95 {line.queue_ratio:.2f} x running "
            f"(target <= {TARGET_QUEUE_RATIO}: {queue})"
        )
    if len(counts) != 1:
        raise SystemExit("the variants generated different token counts; the comparison is void")


def report_controller(run: DatagenRun) -> None:
    stats = run.line.stats
    print(
        f"  (c) server queue over the whole run: p95 {stats.queue_p95:.0f} waiting "
        f"(mean {stats.queue_mean:.1f}) beside {stats.running_mean:.1f} running on average "
        f"(p95 {stats.running_p95:.0f})"
    )
    samples = run.sampler.samples[SERVER]
    peak = max(range(len(samples)), key=lambda i: samples[i].queue, default=0)
    drained = next((s.at for s in samples[peak:] if s.queue <= QUEUE_DRAINED), samples[-1].at)
    after = run.sampler.stats(SERVER, since=drained)
    print(
        f"  (c) after the first burst left the server queue ({drained - run.started_at:.1f} s in): p95 "
        f"{after.queue_p95:.0f} waiting (mean {after.queue_mean:.1f}) beside "
        f"{after.running_mean:.1f} running (p95 {after.running_p95:.0f}), KV {after.usage_mean:.0%}"
    )
    if run.trace:
        points = [(t - run.started_at, limit) for t, limit, _ in run.trace]
        changes = [points[0]] + [p for prev, p in itertools.pairwise(points) if p[1] != prev[1]]
        shown = ", ".join(f"{t:.1f}s:{limit}" for t, limit in changes[:TRACE_SHOWN])
        more = f" ... ({len(changes)} values)" if len(changes) > TRACE_SHOWN else ""
        print(f"  (c) this worker's short in-flight limit over time: {shown}{more}")
        peak_in_flight = max(in_flight for _, _, in_flight in run.trace)
        print(f"  (c) most requests in flight at once: {peak_in_flight}")
        # What the worker has in flight against what the server holds (running + waiting): the
        # difference is in transit (claimed, being sent, answered but not yet read).
        worker_mean = sum(n for _, _, n in run.trace) / len(run.trace)
        limit_mean = sum(limit for _, limit, _ in run.trace) / len(run.trace)
        held = stats.running_mean + stats.queue_mean
        print(
            f"  (c) in flight at the worker {worker_mean:.1f} on average (limit {limit_mean:.1f}), "
            f"at the server {held:.1f}: {worker_mean - held:.1f} in transit"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=DEFAULT_N, help="prompts (default %(default)s)")
    parser.add_argument("--time-scale", type=float, default=DEFAULT_TIME_SCALE, help="simulator speed")
    parser.add_argument("--kv-tokens", type=int, default=DEFAULT_KV_TOKENS, help="simulator KV pool")
    parser.add_argument("--reserve-fraction", type=float, default=DEFAULT_RESERVE_FRACTION)
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    parser.add_argument("--sweep", default=DEFAULT_SWEEP, help="plain concurrencies (default %(default)s)")
    parser.add_argument("--start-limit", type=int, default=DEFAULT_START_LIMIT, help="(c)'s in-flight limit")
    parser.add_argument("--controller-interval-s", type=float, default=DEFAULT_CONTROLLER_INTERVAL_S)
    parser.add_argument("--api", choices=sorted(APIS), default="sglang", help="the simulator's HTTP contract")
    args = parser.parse_args()
    offline_hub()
    spec = sweep_spec(args)
    params = spec.sampling.to_sglang(args.max_new_tokens)
    api: Api = APIS[args.api]
    sim = {"kv_tokens": args.kv_tokens, "reserve_fraction": args.reserve_fraction}
    sim |= api.sim_options(args.kv_tokens)
    with (
        tempfile.TemporaryDirectory(prefix="bench-saturation-") as tmp_name,
        LocalRedis() as server,
        simulator_process(time_scale=args.time_scale, **sim) as url,
    ):
        tmp = Path(tmp_name)
        prompts = render(spec, short_rows(args.n), tmp / PROMPTS_FILE)
        sweep: list[Line] = []
        for concurrency in [int(c) for c in args.sweep.split(",")]:
            with ServerSampler({SERVER: url}, apis={SERVER: api}) as sampler:
                plain = asyncio.run(plain_run([url], prompts, params, concurrency, api=api))
            label = f"(a) plain c={concurrency}"
            completions = [
                (t - plain.started_at, n) for t, n in zip(plain.done_at, plain.lengths, strict=True)
            ]
            stats = sampler.stats(SERVER)
            sweep.append(
                Line(label, plain.wall_s, plain.tokens, stats, plain.cpu_s - sampler.cpu_s, completions)
            )
            print(f"  ... {label}: {plain.tokens_per_s:.0f} tok/s", flush=True)
        best = max(sweep, key=lambda line: line.tokens_per_s)
        best_c = int(best.label.rsplit("=", 1)[1])
        client = redis.Redis.from_url(server.url)
        try:
            where = (url, server.url, tmp)
            label = f"(b) datagen c={best_c}, no controller"
            fixed = run_datagen(label, client, where, args, short_concurrency=best_c, kv_controller=False)
            print(f"  ... {fixed.line.label}: {fixed.line.tokens_per_s:.0f} tok/s", flush=True)
            label = f"(c) datagen from {args.start_limit} + controller"
            controlled = run_datagen(
                label,
                client,
                where,
                args,
                short_concurrency=args.start_limit,
                kv_controller=True,
                controller_interval_s=args.controller_interval_s,
            )
        finally:
            client.close()
    report(sweep, [fixed.line, controlled.line], args)
    report_controller(controlled)


if __name__ == "__main__":
    main()
