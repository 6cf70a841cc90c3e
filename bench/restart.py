"""A server killed and restarted under load: two datagen workers, three simulated servers.

Three simulated SGLang servers of the same speed (``datagen sim`` child processes, the small KV
pool of ``saturation.py``) and two ``Worker`` instances in this process (their own Redis clients,
metrics and server pools; one event loop), both listing all three servers, KV controller on,
health probes every 0.5 s. More prompts are queued than the run can finish, so every server
has work throughout. At ``--kill-at`` seconds server ``b`` gets SIGKILL (its in-flight requests
fail with a reset connection); ``--down-s`` later it is started again on the same port with
``--starting-s 2`` (``/health`` answers 503 while it "loads"). At ``--run-s`` the workers drain
(up to 2 s; the rest is handed back to the queue) and stop.

Reported:

- tokens/s of the fleet per one-second bucket (records by the time they finished), and their
  mean before the kill (from 3 s, after the start-up ramp), during the outage (from the kill to
  ``b``'s return to full load) and after it;
- prompts retried: the workers' ``datagen_worker_retries`` by reason, and the records that
  needed more than one charged attempt (a dead server does not charge one);
- ``b``'s timeline: kill, restart, ``/health`` 200 again (polled every 0.1 s), the workers
  marking it down and up, and **time to full load**: from its ``/health`` 200 to the first
  sample (every 0.2 s) in which it runs at least 90 % of its average running requests before the
  kill (target: at most 5 s);
- each server's gauges over the three phases (KV usage, running, waiting: mean/p95).

Run: ``python bench/restart.py [--n 3000] [--time-scale 0.25] [--kill-at 12] [--down-s 3] [--run-s 35]``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis
from _common import BENCH_JOB_ID, SimProcess, offline_hub, short_rows, sweep_spec
from _load import ServerSampler, ingest, render, worker_settings

from datagen.records.storage import Storage
from datagen.settings import DEFAULT_SHORT_CONCURRENCY, WorkerSettings
from datagen_cli.local.redis_server import LocalRedis
from workers.fleet.servers import ServerSpec
from workers.worker import Worker

DEFAULT_N = 3000
DEFAULT_TIME_SCALE = 0.25
DEFAULT_KV_TOKENS = 16384
DEFAULT_RESERVE_FRACTION = 0.1
DEFAULT_MAX_NEW_TOKENS = 2048
DEFAULT_KILL_AT_S = 12.0
DEFAULT_DOWN_S = 3.0
DEFAULT_RUN_S = 35.0
STARTING_S = 2.0
SERVERS = ("a", "b", "c")
VICTIM = "b"
WORKERS = 2
PROMPTS_FILE = "prompts.jsonl"
SAMPLE_INTERVAL_S = 0.2
HEALTH_POLL_S = 0.1
RAMP_S = 3.0  # the start-up ramp left out of "before"
FULL_LOAD = 0.9
TARGET_FULL_LOAD_S = 5.0
DRAIN_TIMEOUT_S = 2.0


@dataclass
class Timeline:
    started_at: float = 0.0  # perf_counter
    started_at_ms: float = 0.0  # wall clock, for records
    killed_at: float = 0.0
    restarted_at: float = 0.0
    healthy_at: float = 0.0
    stopped_at: float = 0.0
    events: list[tuple[float, str]] = field(default_factory=list)

    def rel(self, at: float) -> float:
        return at - self.started_at


class FleetEvents(logging.Handler):
    """Keeps the workers' "marked down" / "healthy again" log lines with their time."""

    def __init__(self, timeline: Timeline) -> None:
        super().__init__(logging.INFO)
        self.timeline = timeline

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "marked down" in message or "healthy again" in message:
            self.timeline.events.append((time.perf_counter(), message.split(":")[0]))


def settings(redis_url: str, storage: Storage, args: argparse.Namespace) -> WorkerSettings:
    return worker_settings(
        redis_url,
        storage,
        args.time_scale,
        short_concurrency=DEFAULT_SHORT_CONCURRENCY,
        kv_controller=True,
        controller_interval_s=0.5,
        control_interval_s=0.5,
        health_interval_s=0.5,
        health_timeout_s=1.0,
        heartbeat_interval_s=1.0,
        retry_base_s=0.05,
        retry_max_s=0.5,
        drain_timeout_s=DRAIN_TIMEOUT_S,
    )


async def scenario(
    workers: list[Worker], sims: dict[str, SimProcess], args: argparse.Namespace, tl: Timeline
) -> None:
    for worker in workers:
        await worker.start()
    tl.started_at, tl.started_at_ms = time.perf_counter(), time.time() * 1000
    runs = [asyncio.create_task(worker.run()) for worker in workers]
    await asyncio.sleep(args.kill_at)
    sims[VICTIM].kill()
    tl.killed_at = time.perf_counter()
    await asyncio.sleep(args.down_s)
    sims[VICTIM].start(wait_healthy=False)
    tl.restarted_at = time.perf_counter()
    async with httpx.AsyncClient(timeout=1.0) as client:
        while True:
            try:
                if (await client.get(f"{sims[VICTIM].url}/health")).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            await asyncio.sleep(HEALTH_POLL_S)
    tl.healthy_at = time.perf_counter()
    await asyncio.sleep(max(0.0, args.run_s - tl.rel(time.perf_counter())))
    tl.stopped_at = time.perf_counter()
    for worker in workers:
        worker.request_stop()
    await asyncio.gather(*runs)
    for worker in workers:
        await worker.drain()
    for worker in workers:
        await worker.close()


def records(storage: Storage) -> list[dict[str, Any]]:
    columns = ("output_len", "finished_at_ms", "attempts", "server")
    return [
        {k: row[k] for k in columns}
        for batch in storage.iter_record_batches(BENCH_JOB_ID)
        for row in batch.select(list(columns)).to_pylist()
    ]


def retries(workers: list[Worker]) -> dict[str, float]:
    totals: dict[str, float] = defaultdict(float)
    for worker in workers:
        for metric in worker.metrics.retries.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    totals[sample.labels["reason"]] += sample.value
    return dict(totals)


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def report(
    rows: list[dict[str, Any]],
    workers: list[Worker],
    sampler: ServerSampler,
    tl: Timeline,
    args: argparse.Namespace,
) -> None:
    seconds = int(tl.rel(tl.stopped_at))
    buckets = [0] * seconds
    for row in rows:
        at = (row["finished_at_ms"] - tl.started_at_ms) / 1000
        if 0 <= at < seconds:
            buckets[int(at)] += row["output_len"]
    victim = sampler.samples[VICTIM]
    before = [s.running for s in victim if RAMP_S <= tl.rel(s.at) < tl.rel(tl.killed_at)]
    full_at = next(
        (s.at for s in victim if s.at >= tl.healthy_at and s.running >= FULL_LOAD * _mean(before)), None
    )
    back_at = full_at if full_at is not None else tl.stopped_at
    phases = {
        "before": (tl.started_at + RAMP_S, tl.killed_at),
        "during": (tl.killed_at, back_at),
        "after": (back_at, tl.stopped_at),
    }
    print(
        f"restart: {WORKERS} workers (short_concurrency {DEFAULT_SHORT_CONCURRENCY}, KV controller on), "
        f"servers {', '.join(SERVERS)} at time_scale {args.time_scale}, kv_tokens {args.kv_tokens}; "
        f"{VICTIM} killed at {args.kill_at:.0f} s, restarted {args.down_s:.0f} s later "
        f"with --starting-s {STARTING_S:.0f}"
    )
    print("  fleet tokens/s per second (k = 1,000):")
    for first in range(0, seconds, 12):
        cells = " ".join(f"{b / 1000:5.1f}k" for b in buckets[first : first + 12])
        print(f"    {first:3d}-{min(seconds, first + 12) - 1:3d} s: {cells}")
    for name, (since, until) in phases.items():
        lo, hi = int(tl.rel(since)), int(tl.rel(until))
        rate = _mean([float(b) for b in buckets[lo:hi]])
        print(f"  {name:<7} {tl.rel(since):5.1f}-{tl.rel(until):5.1f} s: {rate:7.0f} tok/s", end="")
        for server in SERVERS:
            stats = sampler.stats(server, since=since, until=until)
            print(f"   {server}: run {stats.running_mean:4.1f}/{stats.running_p95:3.0f} wait "
                  f"{stats.queue_mean:4.1f}/{stats.queue_p95:3.0f}", end="")  # fmt: skip
        print()
    events = sorted(
        [
            (tl.killed_at, f"{VICTIM} killed (SIGKILL)"),
            (tl.restarted_at, f"{VICTIM} process started again"),
            (tl.healthy_at, f"{VICTIM} /health 200"),
            *((at, f"a worker: {msg}") for at, msg in tl.events if at > tl.started_at),
        ]
    )
    if full_at is not None and before:
        events.append((full_at, f"{VICTIM} at >= {FULL_LOAD:.0%} of its running requests before the kill"))
    print("  timeline: " + "; ".join(f"{tl.rel(at):.2f} s {what}" for at, what in sorted(events)))
    if not before:
        print(f"  time to full load: no samples of {VICTIM} from {RAMP_S:.0f} s to the kill: raise --kill-at")
    elif full_at is None:
        print(f"  time to full load: never within the run (target <= {TARGET_FULL_LOAD_S:.0f} s: NOT met)")
    else:
        delay = full_at - tl.healthy_at
        verdict = "met" if delay <= TARGET_FULL_LOAD_S else "NOT met"
        print(
            f"  time to full load after /health 200: {delay:.2f} s "
            f"(pre-kill average {_mean(before):.1f} running; target <= {TARGET_FULL_LOAD_S:.0f} s: {verdict})"
        )
    retried = retries(workers)
    charged = sum(1 for row in rows if row["attempts"] > 1)
    print(
        f"  retries (datagen_worker_retries, both workers): {sum(retried.values()):.0f} "
        f"({', '.join(f'{k} {v:.0f}' for k, v in sorted(retried.items())) or 'none'}); "
        f"records with more than one charged attempt: {charged}; records written: {len(rows)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=DEFAULT_N, help="prompts queued (more than the run needs)")
    parser.add_argument("--time-scale", type=float, default=DEFAULT_TIME_SCALE)
    parser.add_argument("--kv-tokens", type=int, default=DEFAULT_KV_TOKENS)
    parser.add_argument("--reserve-fraction", type=float, default=DEFAULT_RESERVE_FRACTION)
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    parser.add_argument("--kill-at", type=float, default=DEFAULT_KILL_AT_S, help="seconds into the run")
    parser.add_argument("--down-s", type=float, default=DEFAULT_DOWN_S, help="from the kill to the restart")
    parser.add_argument("--run-s", type=float, default=DEFAULT_RUN_S, help="length of the run")
    args = parser.parse_args()
    offline_hub()
    sim_options = {
        "kv_tokens": args.kv_tokens,
        "reserve_fraction": args.reserve_fraction,
        "starting_s": STARTING_S,
    }
    sims = {name: SimProcess(time_scale=args.time_scale, **sim_options) for name in SERVERS}
    timeline = Timeline()
    handler = FleetEvents(timeline)
    fleet_log = logging.getLogger("workers.fleet.servers")
    fleet_log.addHandler(handler)
    fleet_log.setLevel(logging.INFO)
    with tempfile.TemporaryDirectory(prefix="bench-restart-") as tmp_name, LocalRedis() as server:
        try:
            for sim in sims.values():
                sim.start(wait_healthy=False)
            for sim in sims.values():
                sim.wait_healthy()
            tmp = Path(tmp_name)
            render(sweep_spec(args), short_rows(args.n), tmp / PROMPTS_FILE)
            client = redis.Redis.from_url(server.url)
            storage = Storage(tmp / "storage")
            ingest(client, storage, sweep_spec(args), tmp / PROMPTS_FILE, args.n)
            client.close()
            specs = [ServerSpec(name, sim.url) for name, sim in sims.items()]
            workers = [
                Worker(settings(server.url, storage, args), specs, burst=False, install_signal_handlers=False)
                for _ in range(WORKERS)
            ]
            urls = {name: sim.url for name, sim in sims.items()}
            with ServerSampler(urls, interval_s=SAMPLE_INTERVAL_S) as sampler:
                asyncio.run(scenario(workers, sims, args, timeline))
        finally:
            for sim in sims.values():
                sim.stop()
        rows = records(storage)
    fleet_log.removeHandler(handler)
    report(rows, workers, sampler, timeline, args)


if __name__ == "__main__":
    main()
