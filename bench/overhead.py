"""Per-prompt overhead of one worker process: datagen's Worker against a bare asyncio + httpx loop on a
simulator with zero model time.

One simulated SGLang server with ``--time-scale 0`` (every request is answered as fast as the
simulator's Python can: the heavy-tailed output lengths are still generated and sent back, a
median of about 200 ids per reply), so what limits prompts/s is the client side and the two
cores this machine shares between the client, the simulator and Redis.

For each C in ``--concurrency`` (default 8, and 64, the production default ``short_concurrency``),
two lines, each with at most C requests in flight and the same N prompts (the generated token
totals are checked equal):

``bare``
    ``asyncio.Semaphore(C)`` around ``httpx.AsyncClient.post(/generate)``, counting the output
    ids: no Redis, no storage, nothing durable.
``datagen``
    ``Ingestor.run`` (not timed), then ``workers.worker.Worker`` in burst mode with the
    production defaults (KV controller, health probes, heartbeats, reaper) except
    ``short_concurrency=C`` and a 0.5 s group commit (``--commit-interval-s``; a task frees its
    server slot when the reply arrives, so the interval only delays the end of a burst). A prompt
    counts once its record is committed to Parquet and its RQ job is finished: durably recorded.
    Timed from ``Worker.main()`` to its return.

Columns: C; wall seconds; prompts/s (the absolute figure; the aim is 400/s, on a machine with more
than two cores to spare); the ratio to ``bare`` at the same C; CPU milliseconds per prompt of this process
(the client; the sampler thread's own CPU is taken out), of the simulator and of Redis (read
from ``/proc`` for the child processes); and the simulator's running/waiting requests sampled
every 0.25 s (mean/p95): waiting above zero would mean the simulator, not the client, was the
bottleneck. Below: Redis commands per prompt (``INFO commandstats`` difference over the datagen
run / N, with the most frequent commands), and with ``--profile`` the functions where the
worker's time goes (cProfile over one more datagen run at the smallest C, where the pool costs
least; own time summed by package, then the top functions; profiling slows the run, so its wall
time is not reported).

httpx's connection pool (httpcore 1.0) does work proportional to the square of its size on
every request it starts or ends, so the bare loop's own cost per prompt grows with C; comparing
the two C values shows how much of either line is that.

Run: ``python bench/overhead.py [--n 2000] [--concurrency 8,64] [--profile]``.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import os
import pstats
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import redis
from _common import SimProcess, offline_hub, short_rows, sweep_spec
from _load import ServerSampler, Stats, ingest, plain_run, read_records, render, run_worker, worker_settings

from datagen.records.storage import Storage
from datagen.settings import DEFAULT_POLL_INTERVAL_S, WorkerSettings
from datagen_cli.local.redis_server import LocalRedis

DEFAULT_N = 2000
DEFAULT_CONCURRENCY = "8,64"
DEFAULT_COMMIT_INTERVAL_S = 0.5
DEFAULT_MAX_NEW_TOKENS = 2048
AIM_PROMPTS_PER_S = 400
SERVER = "sim"
PROMPTS_FILE = "prompts.jsonl"
TOP_COMMANDS = 8
TOP_FUNCTIONS = 25
TOP_PACKAGES = 15
PROJECT_ROOT = Path(__file__).resolve().parent.parent
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Line:
    label: str
    concurrency: int
    wall_s: float
    prompts: int
    tokens: int
    cpu_s: float
    sim_cpu_s: float
    redis_cpu_s: float
    stats: Stats

    @property
    def prompts_per_s(self) -> float:
        return self.prompts / self.wall_s

    def ms_per_prompt(self, cpu_s: float) -> float:
        return 1000 * cpu_s / self.prompts


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of another process so far (Linux ``/proc/<pid>/stat``)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


class ChildCpu:
    """CPU seconds the simulator and Redis spend between enter and exit."""

    def __init__(self, sim_pid: int, redis_pid: int) -> None:
        self.pids = (sim_pid, redis_pid)
        self.sim_s = self.redis_s = 0.0

    def __enter__(self) -> ChildCpu:
        self._start = [process_cpu_s(pid) for pid in self.pids]
        return self

    def __exit__(self, *exc: object) -> None:
        sim, red = (process_cpu_s(pid) - start for pid, start in zip(self.pids, self._start, strict=True))
        self.sim_s, self.redis_s = sim, red


def command_calls(client: redis.Redis) -> Counter[str]:
    stats = client.info("commandstats")
    return Counter({name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()})


def bare(url: str, prompts: list[list[int]], c: int, args: argparse.Namespace, pids: tuple[int, int]) -> Line:
    params = sweep_spec(args).sampling.to_sglang(args.max_new_tokens)
    with ChildCpu(*pids) as children, ServerSampler({SERVER: url}) as sampler:
        run = asyncio.run(plain_run([url], prompts, params, c, label="bare"))
    cpu_s = run.cpu_s - sampler.cpu_s
    stats = sampler.stats(SERVER)
    cpu = (cpu_s, children.sim_s, children.redis_s)
    return Line("bare asyncio + httpx", c, run.wall_s, len(prompts), run.tokens, *cpu, stats)


def ours(
    client: redis.Redis, where: tuple[str, str, Path], c: int, args: argparse.Namespace, pids: tuple[int, int]
) -> tuple[Line, Counter[str]]:
    url, redis_url, tmp = where
    storage = Storage(tempfile.mkdtemp(prefix="storage-", dir=tmp))
    ingest(client, storage, sweep_spec(args), tmp / PROMPTS_FILE, args.n)
    settings = _settings(redis_url, storage, c, args)
    before = command_calls(client)
    with ChildCpu(*pids) as children, ServerSampler({SERVER: url}) as sampler:
        run = asyncio.run(run_worker(settings, {SERVER: url}))
    commands = command_calls(client) - before
    commands["info"] -= 1  # our own INFO call
    tokens = sum(r["output_len"] for r in read_records(client, storage, args.n))
    cpu_s = run.cpu_s - sampler.cpu_s
    stats = sampler.stats(SERVER)
    cpu = (cpu_s, children.sim_s, children.redis_s)
    line = Line("datagen Worker (burst)", c, run.wall_s, args.n, tokens, *cpu, stats)
    return line, commands


def profile(client: redis.Redis, where: tuple[str, str, Path], c: int, args: argparse.Namespace) -> str:
    url, redis_url, tmp = where
    storage = Storage(tempfile.mkdtemp(prefix="storage-", dir=tmp))
    ingest(client, storage, sweep_spec(args), tmp / PROMPTS_FILE, args.n)
    profiler = cProfile.Profile()
    profiler.enable()
    asyncio.run(run_worker(_settings(redis_url, storage, c, args), {SERVER: url}))
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    total = sum(tt for _cc, _nc, tt, _ct, _callers in stats.stats.values())  # type: ignore[attr-defined]
    out.write(f"Own time by package (of {total:.1f} s; blocking socket calls count the time they wait):\n")
    for package, seconds in by_package(stats).most_common(TOP_PACKAGES):
        out.write(f"  {seconds:7.2f} s {seconds / total:6.1%}  {package}\n")
    out.write("\n")
    stats.strip_dirs()
    stats.sort_stats("tottime").print_stats(TOP_FUNCTIONS)
    stats.sort_stats("cumulative").print_stats(TOP_FUNCTIONS)
    return out.getvalue()


def by_package(stats: pstats.Stats) -> Counter[str]:
    """Own (not cumulative) time per installed package, project package or builtin function."""
    totals: Counter[str] = Counter()
    for (filename, _line, func), (_cc, _nc, tt, _ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        if filename == "~":
            name = f"builtin {func}"
        elif "site-packages/" in filename:
            name = filename.split("site-packages/", 1)[1].split("/", 1)[0]
        elif filename.startswith(str(PROJECT_ROOT)):
            name = "project: " + Path(filename).relative_to(PROJECT_ROOT).parts[0]
        else:
            path = Path(filename)
            # asyncio/events.py -> asyncio; socket.py -> socket
            module = path.stem if path.parent.name.startswith("python3") else path.parent.name
            name = f"stdlib {module}"
        totals[name] += tt
    return totals


def _settings(redis_url: str, storage: Storage, c: int, args: argparse.Namespace) -> WorkerSettings:
    # Production defaults otherwise (time scale 1: nothing is scaled down).
    return worker_settings(
        redis_url,
        storage,
        1.0,
        short_concurrency=c,
        commit_interval_s=args.commit_interval_s,
        poll_interval_s=DEFAULT_POLL_INTERVAL_S,
    )


def report(lines: list[Line], commands: dict[int, Counter[str]], args: argparse.Namespace) -> None:
    print(
        f"overhead: N={args.n} prompts, simulator time_scale=0, commit interval {args.commit_interval_s} s, "
        f"{os.cpu_count()} CPUs shared by client, simulator and Redis"
    )
    print(
        f"  {'line':<24} {'C':>3} {'wall s':>7} {'prompts/s':>10} {'vs bare':>8} {'client ms/p':>12} "
        f"{'sim ms/p':>9} {'redis ms/p':>11}   {'sim run mean/p95':>16}  {'sim wait mean/p95':>17}"
    )
    bare_rate = {line.concurrency: line.prompts_per_s for line in lines if line.label.startswith("bare")}
    for line in lines:
        st = line.stats
        ratio = line.prompts_per_s / bare_rate[line.concurrency]
        print(
            f"  {line.label:<24} {line.concurrency:3d} {line.wall_s:7.2f} {line.prompts_per_s:10.1f} "
            f"{ratio:7.3f}x {line.ms_per_prompt(line.cpu_s):12.2f} "
            f"{line.ms_per_prompt(line.sim_cpu_s):9.2f} {line.ms_per_prompt(line.redis_cpu_s):11.2f}   "
            f"{st.running_mean:9.1f}/{st.running_p95:6.0f}  {st.queue_mean:10.1f}/{st.queue_p95:6.0f}"
        )
    counts = {line.tokens for line in lines}
    print(f"  generated tokens: {sorted(counts)} ({'equal' if len(counts) == 1 else 'MISMATCH'})")
    for line in lines:
        if line.label.startswith("bare"):
            continue
        c = line.concurrency
        verdict = "met" if line.prompts_per_s >= AIM_PROMPTS_PER_S else "not met"
        print(
            f"  datagen at C={c}: {line.prompts_per_s:.0f} durably recorded prompts/s "
            f"({verdict} against the aim of {AIM_PROMPTS_PER_S}/s), "
            f"{line.prompts_per_s / bare_rate[c]:.3f} x bare, "
            f"worker CPU {line.ms_per_prompt(line.cpu_s):.2f} ms/prompt"
        )
        total = sum(commands[c].values())
        top = ", ".join(
            f"{name} {calls / args.n:.2f}" for name, calls in commands[c].most_common(TOP_COMMANDS)
        )
        print(f"    Redis commands per prompt: {total / args.n:.1f} ({top})")
    if len(counts) != 1:
        raise SystemExit("the lines generated different token counts; the comparison is void")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=DEFAULT_N, help="prompts (default %(default)s)")
    parser.add_argument(
        "--concurrency", "-c", default=DEFAULT_CONCURRENCY, help="comma list (default %(default)s)"
    )
    parser.add_argument("--commit-interval-s", type=float, default=DEFAULT_COMMIT_INTERVAL_S)
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    parser.add_argument("--profile", action="store_true", help="also profile a datagen run with cProfile")
    args = parser.parse_args()
    offline_hub()
    sim = SimProcess(time_scale=0.0)
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp_name, LocalRedis() as server:
        sim.start()
        try:
            assert sim.proc is not None and server.process is not None
            pids = (sim.proc.pid, server.process.pid)
            tmp = Path(tmp_name)
            prompts = render(sweep_spec(args), short_rows(args.n), tmp / PROMPTS_FILE)
            client = redis.Redis.from_url(server.url)
            where = (sim.url, server.url, tmp)
            lines: list[Line] = []
            commands: dict[int, Counter[str]] = {}
            concurrencies = [int(c) for c in args.concurrency.split(",")]
            for c in concurrencies:
                lines.append(bare(sim.url, prompts, c, args, pids))
                line, commands[c] = ours(client, where, c, args, pids)
                lines.append(line)
                print(
                    f"  ... C={c}: bare {lines[-2].prompts_per_s:.0f}/s, datagen {line.prompts_per_s:.0f}/s",
                    flush=True,
                )
            profiled = profile(client, where, min(concurrencies), args) if args.profile else None
            client.close()
        finally:
            sim.stop()
    report(lines, commands, args)
    if profiled is not None:
        smallest = min(int(c) for c in args.concurrency.split(","))
        print(
            f"\ncProfile of one more datagen run at C={smallest} "
            "(this process's event loop; not the writer's thread):"
        )
        print(profiled)


if __name__ == "__main__":
    main()
