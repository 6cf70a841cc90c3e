"""A fleet of three KV-bound servers of different speeds: datagen's routing and KV controller against
the sum of what each server does alone.

Three simulated SGLang servers (``datagen sim`` child processes) with the same small KV pool as
``saturation.py`` and decode steps that cost 1x, 1.5x and 3x (``--time-scale`` T, 1.5 T, 3 T).
N prompts; output lengths depend only on the prompt ids and ``sampling_seed``, so the token
totals are checked equal across variants. ``--api vllm`` makes every simulator speak vLLM's
``/v1/completions`` and metrics (the same engine and token model), and a list such as
``--api sglang,vllm,sglang`` gives each server its own, in the order x1, x1.5, x3: a mixed fleet
in one worker, which finds out by itself which engine each server runs. A vLLM server has no
decode-rate gauge: its decode rate is the rate of ``vllm:generation_tokens_total`` between samples
(vLLM counts every engine step; the simulator counts a request's tokens when it finishes, which
over a solo run's few seconds overstates a slow server's rate, so the capacity too).

Lines:

``solo <server>``
    Each server alone with the hand-written asyncio + httpx script (``Semaphore(C)`` around
    ``POST /generate``, ``--solo-concurrency`` 128, a KV-saturating concurrency: ``saturation.py``
    finds 64 to 256 equally good on this KV pool) for a warm-up of 3 s x its step cost, then
    ``--solo-s`` seconds more; then the requests left are cancelled and aborted. Its capacity is
    its own decode rate (``sglang:gen_throughput``, sampled) averaged after the warm-up. The sum
    of the three is the ``capacity``: what a perfect scheduler would get from the fleet.
``datagen + controller, backups``
    One ``Worker`` (burst) over the three servers with speed-aware routing (the fastest server
    with a free slot), the KV controller on (``controller_interval_s`` 0.5 s) and backup requests
    on (the default, ``workers/run/backup.py``); each server's limit starts at ``--limit`` (default:
    the production default ``short_concurrency`` of 64).
``datagen + controller, no backups``
    The same with ``backup_requests`` off: the slowest server finishes its last requests alone.
``datagen 512/server, no controller`` (only with ``--fixed``)
    The same worker with equal fixed limits of 512 per server, the controller and backups off:
    every prompt is sent at once, a third to each server, the way a hand-written script spreads
    work.
``plain round robin`` (only with ``--round-robin``)
    The hand-written script over the three servers, prompt i to server i mod 3, 512 per server.

Columns: wall seconds; generated tokens/s over the whole run (all tokens / wall, from the
worker's start to its return) and its ratio to the capacity (target: at least 0.9);
``steady``: tokens/s in the steady state, defined as the records that completed between the
5th and the 95th percentile of the completion times, over that span (it leaves out the start,
before the first completions, and the tail, the last 5 % of prompts) and its ratio; ``tail s``:
seconds from the 95th percentile completion to the end of the run; ``drain s``: seconds from
the moment the last prompt left the queue to the end of the run; ``decode``: the servers'
summed decode rate while prompts were left to send (from the start to the moment the last
prompt left the queue; "-" when everything was sent at once) and its ratio; how many prompts
each server answered (a backup that won counts for its server); backups that won / all that
ran; and the servers' gauges sampled from ``/metrics`` every 0.25 s over the whole run, summed
over the three servers (KV usage is their mean), each as mean/p95.

Then two lines of a model, not a measurement: ``ideal scheduler (model)`` is the makespan of a
scheduler with no overhead that starts the prompts in the dataset's order, each the moment a slot
frees on the fastest server with one, each server with as many slots as its solo run kept running
and its solo seconds per token (mean running / decode rate), knowing nothing of the output lengths
(the records' lengths, in the dataset's order); ``, end-of-backlog hold`` adds the worker's rule
that a clearly slower server starts nothing near the end (``Fleet.held_back``). It is what the
whole-run ratio can be at this N without knowing output lengths: one long answer started on the
slow server mid-run, while the fast ones were full, ends the run alone. Under the table, per
datagen line: where the prompts that started in the last 2 s of dispatch went, and the prompt that
completed last.

Run: ``python bench/fleet.py [--api sglang|vllm|A,B,C] [--n 1200] [--time-scale 0.1] [--limit 64] [--fixed]
[--round-robin]``.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from _common import SimProcess, offline_hub, short_rows, sweep_spec
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
from datagen.settings import DEFAULT_SHORT_CONCURRENCY
from datagen_cli.local.redis_server import LocalRedis
from workers.fleet.servers import SAME_SPEED_FACTOR

DEFAULT_N = 1200
DEFAULT_TIME_SCALE = 0.1
DEFAULT_KV_TOKENS = 16384
DEFAULT_RESERVE_FRACTION = 0.1
DEFAULT_MAX_NEW_TOKENS = 2048
DEFAULT_SOLO_CONCURRENCY = 128
DEFAULT_SOLO_S = 8.0
# Solo runs, x the server's step cost: the decode rate counts only after this. A cold KV-bound
# server first admits more requests than it can keep (none has generated anything yet) and runs
# a larger batch for a few seconds before it settles.
SOLO_WARMUP_S = 3.0
DEFAULT_LIMIT = DEFAULT_SHORT_CONCURRENCY  # the production default, 64
DEFAULT_CONTROLLER_INTERVAL_S = 0.5
FIXED_LIMIT = 512
SPEEDS = {"x1": 1.0, "x1.5": 1.5, "x3": 3.0}  # server name: decode step cost multiplier
TARGET_RATIO = 0.9  # issue 12: whole run >= 0.9 x the sum of the solo capacities
# The steady state: records completed between these percentiles of the completion times.
STEADY_PERCENTILES = (5, 95)
PROMPTS_FILE = "prompts.jsonl"
# A "while prompts were left to send" window shorter than this share of the run (everything was
# sent at once) says nothing about feeding the servers: no figure.
MIN_FED_SHARE = 0.25
# The end of dispatch: prompts that started this long before the last one did, by server.
END_GAME_S = 2.0


@dataclass(frozen=True)
class Line:
    label: str
    wall_s: float
    tokens: int  # generated tokens the client received (0 for solo lines: they are cut short)
    fed: Stats  # the servers' gauges while every prompt was not yet sent (solo: after the warm-up)
    fed_s: float  # how long that was
    by_server: dict[str, int]
    stats: Stats  # over the whole run
    steady_tps: float = 0.0  # tokens/s of the records completed between STEADY_PERCENTILES
    tail_s: float = 0.0  # from the last percentile's completion to the end of the run
    drain_s: float = 0.0  # from the last prompt's dispatch to the end of the run
    backups: tuple[int, int] = (0, 0)  # backup requests that won, that ran
    end_game: dict[str, int] = field(default_factory=dict)  # prompts started in the last END_GAME_S
    last_prompt: tuple[str, int, float, float] | None = None  # server, tokens, started s, ended s
    lengths: tuple[int, ...] = ()  # output tokens of each prompt, in the dataset's order

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s


def server_apis(args: argparse.Namespace) -> dict[str, Api]:
    """Each server's API from ``--api``: one name for all, or one per server in SPEEDS' order."""
    names = args.api.split(",")
    if len(names) == 1:
        names *= len(SPEEDS)
    unknown = sorted(set(names) - set(APIS))
    if len(names) != len(SPEEDS) or unknown:
        raise SystemExit(
            f"--api {args.api}: give one of {', '.join(APIS)}, or {len(SPEEDS)} separated by commas"
        )
    return {name: APIS[api] for name, api in zip(SPEEDS, names, strict=True)}


def warmup_s(name: str, args: argparse.Namespace) -> float:
    """A cold server first admits more than it can keep (nothing generated yet): skip that."""
    return SOLO_WARMUP_S * SPEEDS[name]


def solo(
    name: str, url: str, prompts: list[list[int]], params: dict[str, object], args: argparse.Namespace
) -> Line:
    """The plain script on one server, warm-up then --solo-s seconds; capacity: its mean decode rate."""
    duration_s = warmup_s(name, args) + args.solo_s
    api = server_apis(args)[name]
    with ServerSampler({name: url}, apis={name: api}) as sampler:
        run = asyncio.run(
            plain_run(
                [url],
                prompts,
                params,
                args.solo_concurrency,
                label=f"solo-{name}",
                duration_s=duration_s,
                api=api,
            )
        )
    if run.wall_s < duration_s:
        raise SystemExit(
            f"solo {name} answered all {len(prompts)} prompts before its {duration_s:.0f} s: raise --n"
        )
    fed = sampler.stats(name, since=run.started_at + warmup_s(name, args))
    answered = sum(1 for done in run.done_at if done)
    label = f"solo {name} (plain, c={args.solo_concurrency})"
    return Line(label, run.wall_s, 0, fed, args.solo_s, {name: answered}, sampler.stats(name))


def round_robin(
    urls: dict[str, str], prompts: list[list[int]], params: dict[str, object], args: argparse.Namespace
) -> Line:
    apis = server_apis(args)
    with ServerSampler(urls, apis=apis) as sampler:
        run = asyncio.run(
            plain_run(list(urls.values()), prompts, params, FIXED_LIMIT, label="rr", api=list(apis.values()))
        )
    last_sent = max(run.sent_at)
    fed = sampler.all_stats(until=last_sent)
    by_server = {name: run.servers.count(i) for i, name in enumerate(urls)}
    label = f"plain round robin, {FIXED_LIMIT}/server"
    return Line(
        label, run.wall_s, run.tokens, fed, last_sent - run.started_at, by_server, sampler.all_stats()
    )


def datagen(
    label: str,
    client: redis.Redis,
    where: tuple[dict[str, str], str, Path],
    args: argparse.Namespace,
    **opts: object,
) -> Line:
    urls, redis_url, tmp = where
    storage = Storage(tempfile.mkdtemp(prefix="storage-", dir=tmp))
    ingest(client, storage, sweep_spec(args), tmp / PROMPTS_FILE, args.n)
    settings = worker_settings(redis_url, storage, args.time_scale, **opts)
    with ServerSampler(urls, apis=server_apis(args)) as sampler:
        wall_started_ms = time.time() * 1000
        run = asyncio.run(run_worker(settings, urls))
    records = read_records(client, storage, args.n)
    # The last prompt left the queue when its request started (perf_counter time of that moment).
    last_sent = run.started_at + (max(r["started_at_ms"] for r in records) - wall_started_ms) / 1000
    by_server = {name: sum(1 for r in records if r["server"] == name) for name in urls}
    tokens = sum(r["output_len"] for r in records)
    fed = sampler.all_stats(until=last_sent)
    steady_tps, tail_s = steady_state(records, (wall_started_ms + run.wall_s * 1000) / 1000)
    outcomes = {
        sample.labels["outcome"]: sample.value
        for metric in run.worker.metrics.backup_requests.collect()
        for sample in metric.samples
        if sample.name.endswith("_total")
    }
    backups = (int(outcomes.get("won", 0)), int(sum(outcomes.values())))
    # The prompts that started in the last END_GAME_S before the last one left the queue, by server.
    end_ms = max(r["started_at_ms"] for r in records) - END_GAME_S * 1000
    end_game = {
        name: sum(1 for r in records if r["server"] == name and r["started_at_ms"] > end_ms) for name in urls
    }
    # The last prompt to complete: its server, output tokens, and when it started and ended.
    last = max(records, key=lambda r: r["finished_at_ms"])
    last_prompt = (
        str(last["server"]),
        int(last["output_len"]),
        (last["started_at_ms"] - wall_started_ms) / 1000,
        (last["finished_at_ms"] - wall_started_ms) / 1000,
    )
    return Line(
        label,
        run.wall_s,
        tokens,
        fed,
        last_sent - run.started_at,
        by_server,
        sampler.all_stats(),
        steady_tps,
        tail_s,
        run.wall_s - (last_sent - run.started_at),
        backups,
        end_game,
        last_prompt,
        tuple(r["output_len"] for r in sorted(records, key=lambda r: _row_index(r["sample_id"]))),
    )


def _row_index(sample_id: str) -> int:
    match = re.match(r"p(\d+)", sample_id)
    if match is None:
        raise SystemExit(f"unexpected sample id {sample_id!r}")
    return int(match.group(1))


def ideal_makespan(lengths: tuple[int, ...], servers: list[tuple[int, float]], *, hold: bool) -> float:
    """Seconds an ideal scheduler takes: no overhead, ``servers`` as (slots, seconds per output token)
    at a constant speed, the prompts in the dataset's order, each started the moment a slot frees
    on the fastest server with one; it does not know the output lengths. With ``hold``, the same
    end-of-backlog rule as ``Fleet.held_back`` (with the mean length as the typical one)."""
    slots = [[0.0] * n for n, _ in servers]
    for heap in slots:
        heapq.heapify(heap)
    typical = sum(lengths) / len(lengths)
    speeds = [spt for _, spt in servers]

    def held(i: int, backlog: int) -> bool:
        faster = [j for j in range(len(servers)) if speeds[j] * SAME_SPEED_FACTOR < speeds[i]]
        if not hold or not faster:
            return False
        rate = sum(servers[j][0] / (typical * speeds[j]) for j in faster)
        return backlog / rate + typical * min(speeds[j] for j in faster) < typical * speeds[i]

    now = end = 0.0
    for k, length in enumerate(lengths):
        while True:
            ready = [i for i, heap in enumerate(slots) if heap[0] <= now and not held(i, len(lengths) - k)]
            if ready:
                break
            now = min(heap[0] for heap in slots if heap[0] > now)
        i = min(ready, key=lambda j: speeds[j])
        heapq.heappop(slots[i])
        done = now + length * speeds[i]
        heapq.heappush(slots[i], done)
        end = max(end, done)
    return end


def steady_state(records: list[dict[str, Any]], ended_at_s: float) -> tuple[float, float]:
    """Tokens/s of the records completed between the STEADY_PERCENTILES of the completion times,
    over that span; and the seconds from the upper one to ``ended_at_s`` (wall clock)."""
    finished = [r["finished_at_ms"] / 1000 for r in records]
    low, high = (percentile(finished, q) for q in STEADY_PERCENTILES)
    inside = sum(r["output_len"] for r, at in zip(records, finished, strict=True) if low < at <= high)
    return inside / (high - low), ended_at_s - high


def report(solos: list[Line], lines: list[Line], args: argparse.Namespace) -> None:
    capacity = sum(line.fed.gen_tps_mean for line in solos)
    print(
        f"fleet: N={args.n} prompts, servers {', '.join(SPEEDS)} (decode step cost; time_scale "
        f"{args.time_scale} x cost), kv_tokens={args.kv_tokens}, reserve_fraction={args.reserve_fraction}, "
        f"max_new_tokens={args.max_new_tokens}{'' if args.api == 'sglang' else f', api={args.api}'}"
    )
    print(
        f"  {'line':<38} {'wall s':>6} {'tok/s':>7} {'vs cap':>7} {'steady':>7} {'vs cap':>7} {'tail s':>6} "
        f"{'drain s':>7} {'decode':>7} {'vs cap':>7} {'prompts x1/x1.5/x3':>19} {'backups':>9}   "
        f"{STATS_HEADER}"
    )
    blank = f"{'':>7} {'':>7} {'':>6} {'':>7}"
    for line in solos:
        shares = "/".join(str(line.by_server.get(name, 0)) for name in SPEEDS)
        print(
            f"  {line.label:<38} {line.wall_s:6.2f} {'-':>7} {'':>7} {blank} {line.fed.gen_tps_mean:7.0f} "
            f"{'':>7} {shares:>19} {'':>9}   {line.stats.brief()}"
        )
    cap = f"{capacity:7.0f} {1:6.3f}x"
    print(f"  {'capacity: sum of solo decode rates':<38} {'':>6} {cap} {cap} {'':>6} {'':>7} {cap}")
    for line in lines:
        print(f"  {_row(line, capacity)}   {line.stats.brief()}")
    counts = {line.tokens for line in lines}
    same = len(counts) == 1
    print(f"  generated tokens: {sorted(counts)} ({'equal in every fleet variant' if same else 'MISMATCH'})")
    for line in lines:
        ratio = line.tokens_per_s / capacity
        verdict = "met" if ratio >= TARGET_RATIO else "NOT met"
        print(
            f"  {line.label}: {ratio:.3f} x capacity over the whole run (target >= {TARGET_RATIO}: "
            f"{verdict}), {line.steady_tps / capacity:.3f} x in the steady state"
        )
    model = [(round(line.fed.running_mean), line.fed.running_mean / line.fed.gen_tps_mean) for line in solos]
    lengths = next((line.lengths for line in lines if line.lengths), ())
    if lengths and all(n > 0 for n, _ in model):
        tokens = sum(lengths)
        for hold in (False, True):
            span = ideal_makespan(lengths, model, hold=hold)
            label = "ideal scheduler (model)" + (", end-of-backlog hold" if hold else "")
            print(
                f"  {label:<38} {span:6.2f} {tokens / span:7.0f} {tokens / span / capacity:6.3f}x   (each "
                f"server as its solo run: slots = mean running, s/token = running / decode rate)"
            )
    for line in lines:
        if line.last_prompt is not None:
            server, tokens, started, ended = line.last_prompt
            shares = "/".join(str(line.end_game.get(name, 0)) for name in SPEEDS)
            print(
                f"    {line.label}: prompts started in the last {END_GAME_S:.0f} s of dispatch "
                f"x1/x1.5/x3 {shares}; the last to complete: {tokens} tokens on {server}, "
                f"started at {started:.1f} s, ended at {ended:.1f} s"
            )
    fed = lines[0].fed
    print(
        f"    {lines[0].label}: servers' queues while prompts were left to send: {fed.queue_mean:.1f} "
        f"waiting on average, p95 {fed.queue_p95:.0f}, beside {fed.running_mean:.1f} running"
    )
    if not same:
        raise SystemExit("the variants generated different token counts; the comparison is void")


def _row(line: Line, capacity: float) -> str:
    shares = "/".join(str(line.by_server.get(name, 0)) for name in SPEEDS)
    rate = f"{line.tokens_per_s:7.0f} {line.tokens_per_s / capacity:6.3f}x"
    steady = (
        f"{line.steady_tps:7.0f} {line.steady_tps / capacity:6.3f}x {line.tail_s:6.2f} {line.drain_s:7.2f}"
    )
    decode = f"{line.fed.gen_tps_mean:7.0f} {line.fed.gen_tps_mean / capacity:6.3f}x"
    if line.fed_s < MIN_FED_SHARE * line.wall_s:
        decode = f"{'-':>7} {'-':>7}"
    backups = f"{line.backups[0]}/{line.backups[1]}"
    return f"{line.label:<38} {line.wall_s:6.2f} {rate} {steady} {decode} {shares:>19} {backups:>9}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=DEFAULT_N, help="prompts (default %(default)s)")
    parser.add_argument("--time-scale", type=float, default=DEFAULT_TIME_SCALE, help="of the fastest server")
    parser.add_argument("--kv-tokens", type=int, default=DEFAULT_KV_TOKENS)
    parser.add_argument("--reserve-fraction", type=float, default=DEFAULT_RESERVE_FRACTION)
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    parser.add_argument("--solo-concurrency", type=int, default=DEFAULT_SOLO_CONCURRENCY)
    parser.add_argument("--solo-s", type=float, default=DEFAULT_SOLO_S, help="length of each solo run")
    parser.add_argument(
        "--limit", type=int, default=DEFAULT_LIMIT, help="datagen's starting limit per server"
    )
    parser.add_argument("--controller-interval-s", type=float, default=DEFAULT_CONTROLLER_INTERVAL_S)
    parser.add_argument("--fixed", action="store_true", help=f"also run datagen with {FIXED_LIMIT}/server")
    parser.add_argument("--round-robin", action="store_true", help="also run the plain round-robin script")
    parser.add_argument(
        "--api",
        default="sglang",
        help="sglang, vllm, or one per server in x1,x1.5,x3 order (sglang,vllm,vllm)",
    )
    args = parser.parse_args()
    offline_hub()
    spec = sweep_spec(args)
    params = spec.sampling.to_sglang(args.max_new_tokens)
    apis = server_apis(args)
    sims = {
        name: SimProcess(
            time_scale=args.time_scale * cost,
            kv_tokens=args.kv_tokens,
            reserve_fraction=args.reserve_fraction,
            **apis[name].sim_options(args.kv_tokens),
        )
        for name, cost in SPEEDS.items()
    }
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp_name, LocalRedis() as server:
        try:
            for sim in sims.values():
                sim.start(wait_healthy=False)
            for sim in sims.values():
                sim.wait_healthy()
            urls = {name: sim.url for name, sim in sims.items()}
            tmp = Path(tmp_name)
            prompts = render(spec, short_rows(args.n), tmp / PROMPTS_FILE)
            solos = []
            for name in SPEEDS:
                solos.append(solo(name, urls[name], prompts, params, args))
                print(f"  ... {solos[-1].label}: {solos[-1].fed.gen_tps_mean:.0f} tok/s decoded", flush=True)
            client = redis.Redis.from_url(server.url)
            where = (urls, server.url, tmp)
            lines = []
            for backups in (True, False):
                label = f"datagen + controller, {'backups' if backups else 'no backups'}"
                controlled = dict(kv_controller=True, controller_interval_s=args.controller_interval_s)
                lines.append(
                    datagen(
                        label,
                        client,
                        where,
                        args,
                        short_concurrency=args.limit,
                        backup_requests=backups,
                        **controlled,
                    )
                )
                print(f"  ... {lines[-1].label}: {lines[-1].tokens_per_s:.0f} tok/s", flush=True)
            if args.fixed:
                label = f"datagen {FIXED_LIMIT}/server, no controller"
                fixed = dict(short_concurrency=FIXED_LIMIT, kv_controller=False, backup_requests=False)
                lines.append(datagen(label, client, where, args, **fixed))
                print(f"  ... {lines[-1].label}: {lines[-1].tokens_per_s:.0f} tok/s", flush=True)
            if args.round_robin:
                lines.append(round_robin(urls, prompts, params, args))
            client.close()
        finally:
            for sim in sims.values():
                sim.stop()
    report(solos, lines, args)


if __name__ == "__main__":
    main()
