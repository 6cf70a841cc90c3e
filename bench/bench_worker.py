"""Slot use with heavy-tailed generation lengths: batch-and-wait against the datagen worker.

One simulated SGLang server (``datagen sim`` in a child process on a free loopback port, bundled
DeepSeek tokenizer, ``--time-scale`` so that one request takes a fraction of a second) and one
private Redis serve every variant. Output lengths are the simulator's lognormal draws (median
about 200 tokens, p99 about 1,500, cut at ``--max-new-tokens``); they depend only on the prompt ids
and ``sampling_seed``, so every variant must generate the same number of tokens, which is checked.

Variants, all with at most C requests in flight:

``baseline``
    What today's scripts do: send the prompts in batches of C with ``asyncio.gather`` over one
    ``SGLangClient`` and wait for the whole batch before sending the next. No Redis, no storage:
    tokens are only counted, which favours the baseline.
``sequential`` (only with ``--sequential``)
    A consumer like a stock RQ worker: one request at a time (batches of 1).
``ours``
    ``workers.worker.Worker`` in burst mode with ``short_concurrency=C`` on the same server,
    after ``Ingestor.run`` has enqueued the prompts (ingestion is not timed). It pays for the real
    RQ bookkeeping per prompt and commits every record to Parquet before finishing its job. Its
    wall time runs from ``Worker.main()`` to its return (start, run, drain and close included).

Columns: wall time; prompts/s; generated tokens/s; slot use = the sum of the server-reported
request latencies (``meta_info.e2e_latency``) / (C x wall time), i.e. the share of the C slots
that held a running request; CPU time of this process per prompt (the client side only: the
simulator and Redis run in other processes); and speed-up = baseline wall time / variant wall
time, which is also the ratio of prompts/s and of generated tokens/s.

Even a perfect scheduler stays below 100 % slot use here: with N/C rounds of about ten, the last
long requests run almost alone at the end. Larger ``--n`` shrinks that tail.

Timing knobs of the worker are scaled with ``--time-scale`` like the simulated GPU: the group
commit interval is the default 2 s times the time scale unless ``--commit-interval-s`` is given,
because a task keeps its slot until its record is committed.

Run: ``python bench/bench_worker.py [--n 300] [--concurrency 32] [--time-scale 0.02] [--sequential]``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import redis
from _common import (
    BENCH_JOB_ID,
    BENCH_NAMESPACE,
    offline_hub,
    short_rows,
    simulator_process,
    sweep_spec,
    write_jsonl,
)

from datagen.control.enqueue import EnqueueOptions
from datagen.control.jobs import JobStore
from datagen.control.keys import Keys
from datagen.prompts.dataset import Prompt, iter_prompts
from datagen.prompts.tokenization import renderer_for
from datagen.records.storage import Storage
from datagen.settings import (
    DEFAULT_COMMIT_INTERVAL_S,
    DEFAULT_ENQUEUE_CHUNK,
    DEFAULT_FAILURE_TTL_S,
    DEFAULT_RESULT_TTL_S,
    WorkerSettings,
)
from datagen.spec import JobSpec
from datagen.states import JobState, PromptClass
from datagen_cli.local.redis_server import LocalRedis
from service.ingest import IngestOptions, Ingestor
from workers.engines.http import ClientTimeouts
from workers.engines.sglang import SGLangClient
from workers.fleet.servers import ServerSpec
from workers.worker import Worker

DEFAULT_N = 300
DEFAULT_CONCURRENCY = 32
DEFAULT_TIME_SCALE = 0.02
DEFAULT_MAX_NEW_TOKENS = 2048
SERVER_NAME = "sim"
# Floor for the worker's scaled poll and commit intervals: below this the loop only spins.
MIN_INTERVAL_S = 0.01
# Generous: a request here takes seconds at most.
READ_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Result:
    label: str
    wall_s: float
    prompts: int
    generated_tokens: int
    latencies_s: list[float]
    cpu_s: float

    def slot_use(self, slots: int) -> float:
        return sum(self.latencies_s) / (slots * self.wall_s)


def read_prompts(path: Path, spec: JobSpec) -> list[Prompt]:
    with open(path, "rb") as stream:
        items = list(iter_prompts(stream, multi_turn=spec.multi_turn))
    prompts = [item for item in items if isinstance(item, Prompt)]
    if len(prompts) != len(items):
        raise SystemExit(f"{len(items) - len(prompts)} rows of the generated dataset were rejected")
    return prompts


# Baseline ---------------------------------------------------------------------------------------
async def batch_and_wait(
    url: str, prompt_ids: list[list[int]], spec: JobSpec, batch: int, label: str
) -> Result:
    """Send ``batch`` prompts at once, wait for all of them, then send the next batch."""
    timeouts = ClientTimeouts(read_s=READ_TIMEOUT_S)
    async with SGLangClient(SERVER_NAME, url, timeouts=timeouts, max_connections=batch) as client:
        context_len = await client.context_len()
        tokens = 0
        latencies: list[float] = []
        cpu_started = time.process_time()
        started = time.perf_counter()
        for first in range(0, len(prompt_ids), batch):
            calls = []
            for index in range(first, min(first + batch, len(prompt_ids))):
                ids = prompt_ids[index]
                # As the worker does: the class limit, cut to fit the context with one token clear.
                max_new = spec.max_new_tokens(PromptClass.SHORT)
                if context_len is not None:
                    max_new = min(max_new, context_len - len(ids) - 1)
                params = spec.sampling.to_sglang(max_new)
                calls.append(
                    client.generate(ids, params, rid=f"{label}-{index}", read_timeout_s=READ_TIMEOUT_S)
                )
            for result in await asyncio.gather(*calls):
                tokens += len(result.output_ids)
                latencies.append(result.e2e_latency_s or 0.0)
        wall_s = time.perf_counter() - started
        cpu_s = time.process_time() - cpu_started
    return Result(label, wall_s, len(prompt_ids), tokens, latencies, cpu_s)


# Ours -------------------------------------------------------------------------------------------
def ingest(client: redis.Redis, keys: Keys, storage: Storage, spec: JobSpec, path: Path, n: int) -> None:
    jobs = JobStore(client, keys)
    jobs.create(BENCH_JOB_ID, spec)
    options = IngestOptions(
        chunk=DEFAULT_ENQUEUE_CHUNK,
        enqueue=EnqueueOptions(
            result_ttl_s=DEFAULT_RESULT_TTL_S, failure_ttl_s=DEFAULT_FAILURE_TTL_S, max_worker_losses=3
        ),
    )
    Ingestor(client, keys, jobs, storage, options).run(BENCH_JOB_ID, path, threading.Event())
    progress = jobs.progress(BENCH_JOB_ID)
    if progress.state is JobState.FAILED or progress.accepted != n:
        raise SystemExit(f"ingestion did not accept all {n} prompts: {progress}")


def worker_settings(redis_url: str, storage: Storage, args: argparse.Namespace) -> WorkerSettings:
    commit_interval_s = args.commit_interval_s
    if commit_interval_s is None:
        commit_interval_s = max(MIN_INTERVAL_S, DEFAULT_COMMIT_INTERVAL_S * args.time_scale)
    return WorkerSettings(
        redis_url=redis_url,
        storage=str(storage.root),
        namespace=BENCH_NAMESPACE,
        metrics_port=0,
        short_concurrency=args.concurrency,
        # Every prompt here is short. Not 0: a burst worker with a class of capacity 0 never returns.
        long_concurrency=1,
        commit_interval_s=commit_interval_s,
        poll_interval_s=MIN_INTERVAL_S,
    )


async def run_worker(settings: WorkerSettings, url: str) -> tuple[float, float]:
    """Wall and CPU seconds (this process, all threads) of one burst run."""
    worker = Worker(settings, [ServerSpec(SERVER_NAME, url)], burst=True, install_signal_handlers=False)
    cpu_started = time.process_time()
    started = time.perf_counter()
    await worker.main()
    return time.perf_counter() - started, time.process_time() - cpu_started


def ours(client: redis.Redis, url: str, storage: Storage, args: argparse.Namespace, redis_url: str) -> Result:
    keys = Keys(BENCH_NAMESPACE)
    wall_s, cpu_s = asyncio.run(run_worker(worker_settings(redis_url, storage, args), url))
    progress = JobStore(client, keys).progress(BENCH_JOB_ID)
    if progress.state is not JobState.COMPLETED or progress.done != args.n:
        raise SystemExit(f"the worker did not finish every prompt: {progress}")
    rows = [row for batch in storage.iter_record_batches(BENCH_JOB_ID) for row in batch.to_pylist()]
    if len({r["sample_id"] for r in rows}) != args.n:
        raise SystemExit(f"expected {args.n} distinct records, found {len(rows)}")
    tokens = sum(r["output_len"] for r in rows)
    if tokens != progress.output_tokens:
        raise SystemExit(f"records hold {tokens} generated tokens, the job counter {progress.output_tokens}")
    latencies = [r["e2e_latency_s"] or 0.0 for r in rows]
    return Result("ours", wall_s, args.n, tokens, latencies, cpu_s)


# Report -----------------------------------------------------------------------------------------
def report(results: list[Result], args: argparse.Namespace, commit_interval_s: float) -> None:
    base = results[0]
    lat = sorted(base.latencies_s)
    p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
    print(
        f"bench_worker: N={args.n} prompts, C={args.concurrency}, time_scale={args.time_scale}, "
        f"max_new_tokens={args.max_new_tokens}, worker commit interval {commit_interval_s:.3f} s"
    )
    print(
        f"  request latency in the baseline: median {statistics.median(lat):.3f} s, "
        f"p99 {p99:.3f} s, max {lat[-1]:.3f} s"
    )
    print(
        f"  {'variant':<40} {'wall s':>8} {'prompts/s':>10} {'gen tok/s':>10} {'slot use':>9} "
        f"{'CPU ms/prompt':>14} {'speed-up':>9}"
    )
    for r in results:
        slots = 1 if r.label == "sequential" else args.concurrency
        print(
            f"  {_describe(r.label, args.concurrency):<40} {r.wall_s:8.2f} {r.prompts / r.wall_s:10.1f} "
            f"{r.generated_tokens / r.wall_s:10.0f} {r.slot_use(slots):9.1%} "
            f"{1000 * r.cpu_s / r.prompts:14.1f} {base.wall_s / r.wall_s:8.2f}x"
        )
    counts = {r.label: r.generated_tokens for r in results}
    same = len(set(counts.values())) == 1
    listed = ", ".join(f"{k} {v}" for k, v in counts.items())
    print(f"  generated tokens: {listed} ({'equal' if same else 'MISMATCH'})")
    ours_result = next(r for r in results if r.label == "ours")
    print(f"  ratio ours/baseline: {base.wall_s / ours_result.wall_s:.2f}x prompts/s and generated tokens/s")
    if not same:
        raise SystemExit("the variants generated different token counts; the comparison is void")


def _describe(label: str, concurrency: int) -> str:
    return {
        "baseline": f"baseline: batch-and-wait, batches of {concurrency}",
        "sequential": "sequential: one request at a time",
        "ours": f"ours: datagen Worker, burst, C={concurrency}",
    }[label]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=DEFAULT_N, help="prompts (default %(default)s)")
    parser.add_argument("--concurrency", "-c", type=int, default=DEFAULT_CONCURRENCY, help="slots C")
    parser.add_argument("--time-scale", type=float, default=DEFAULT_TIME_SCALE, help="simulator speed")
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    parser.add_argument("--commit-interval-s", type=float, default=None, help="default: 2 s x time scale")
    parser.add_argument("--sequential", action="store_true", help="also run one request at a time (slow)")
    args = parser.parse_args()
    offline_hub()

    spec = sweep_spec(args)
    renderer = renderer_for(spec)
    with (
        tempfile.TemporaryDirectory(prefix="bench-worker-") as tmp,
        LocalRedis() as server,
        simulator_process(time_scale=args.time_scale) as url,
    ):
        input_path = Path(tmp) / "prompts.jsonl"
        write_jsonl(input_path, short_rows(args.n))
        prompt_ids = [renderer.render(p.messages, p.tools) for p in read_prompts(input_path, spec)]
        results = [asyncio.run(batch_and_wait(url, prompt_ids, spec, args.concurrency, "baseline"))]
        if args.sequential:
            results.append(asyncio.run(batch_and_wait(url, prompt_ids, spec, 1, "sequential")))
        client = redis.Redis.from_url(server.url)
        try:
            storage = Storage(Path(tmp) / "storage")
            ingest(client, Keys(BENCH_NAMESPACE), storage, spec, input_path, args.n)
            results.append(ours(client, url, storage, args, server.url))
            commit_interval_s = worker_settings(server.url, storage, args).commit_interval_s
        finally:
            client.close()
    report(results, args, commit_interval_s)


if __name__ == "__main__":
    main()
