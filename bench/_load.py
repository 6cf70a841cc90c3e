"""Load and observation shared by the KV-bound benchmarks (saturation, fleet, overhead, restart).

Not a benchmark itself. Four pieces:

- :class:`Api` (:data:`SGLANG`, :data:`VLLM`): all the benchmarks know of the two engines' HTTP
  contracts: the generation route, its body and where the output ids are, how to abort, and the
  names of the gauges.
- :class:`ServerSampler`: a thread that reads each simulator's ``/metrics`` every
  ``interval_s`` (KV usage, running and waiting requests, retractions or preemptions, the decode
  rate) so a report can show that a server was KV-bound and never idle, and that the client was
  not the bottleneck.
- :func:`plain_run`: the hand-written client people use today, an ``asyncio.Semaphore`` over
  one ``httpx.AsyncClient`` posting token ids to SGLang's ``/generate`` or vLLM's
  ``/v1/completions`` (round robin over several servers when given several, a semaphore per
  server). It is the baseline, so it is given every advantage a careful person would give it:
  one pooled client, as many connections as the semaphore allows, no timeouts, no retries, no
  storage.
- The datagen side: :func:`ingest`, :func:`worker_settings`, :func:`run_worker` and
  :func:`read_records`: the same job through a coordinator's ingestion and a worker in burst
  mode, with the worker's timing knobs scaled like the simulated GPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import statistics
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import redis
from _common import BENCH_JOB_ID, BENCH_NAMESPACE, write_jsonl
from prometheus_client.parser import text_string_to_metric_families

from datagen.control.enqueue import EnqueueOptions
from datagen.control.jobs import JobStore
from datagen.control.keys import Keys
from datagen.prompts.dataset import Prompt, iter_prompts
from datagen.prompts.tokenization import renderer_for
from datagen.records.storage import Storage
from datagen.settings import (
    DEFAULT_ENQUEUE_CHUNK,
    DEFAULT_FAILURE_TTL_S,
    DEFAULT_RESULT_TTL_S,
    WorkerSettings,
)
from datagen.spec import JobSpec
from datagen.states import JobState
from service.ingest import IngestOptions, Ingestor
from workers.engines.vllm import vllm_request
from workers.fleet.servers import ServerSpec
from workers.worker import Worker

__all__ = [
    "APIS",
    "SAMPLE_INTERVAL_S",
    "SGLANG",
    "VLLM",
    "Api",
    "PlainResult",
    "ServerSampler",
    "Stats",
    "WorkerRun",
    "ingest",
    "percentile",
    "plain_run",
    "read_records",
    "render",
    "run_worker",
    "worker_settings",
]

SAMPLE_INTERVAL_S = 0.25
METRICS_TIMEOUT_S = 2.0
# Floor for the worker's scaled poll and commit intervals: below this the loop only spins.
MIN_INTERVAL_S = 0.01
# The production defaults these scale from (seconds on a real GPU).
COMMIT_INTERVAL_AT_SCALE_1_S = 2.0


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


# The two engines' HTTP contracts -------------------------------------------------------------------
@dataclass(frozen=True)
class Api:
    """What the benchmarks send to and read from one engine (``datagen sim --api NAME``)."""

    name: str
    generate_path: str
    # (prompt ids, sampling params under SGLang's names, request id) -> the request body.
    body: Callable[[Sequence[int], Mapping[str, Any], str], dict[str, Any]]
    # The reply body -> the generated ids.
    output_ids: Callable[[Any], list[int]]
    # The route that aborts every request; None: closing a request's connection aborts it.
    abort_path: str | None
    # Metric family (as the Prometheus parser names it: counters without _total) -> Sample field.
    gauges: Mapping[str, str]
    # A counter of generated tokens whose rate is the decode rate (an engine with no such gauge).
    generated_counter: str | None = None

    def sim_options(self, kv_tokens: int) -> dict[str, str | int]:
        """``datagen sim`` options for this API with a KV pool of ``kv_tokens``. vLLM does not
        start unless one whole context fits the pool, so its context is the pool (the prompts
        here take at most a few thousand tokens)."""
        if self is SGLANG:
            return {}  # the simulator's default API: the command line as before
        return {"api": self.name, "context_len": kv_tokens}


SGLANG = Api(
    name="sglang",
    generate_path="/generate",
    body=lambda ids, params, rid: {"input_ids": ids, "sampling_params": params, "rid": rid},
    output_ids=lambda reply: reply["output_ids"],
    abort_path="/abort_request",
    gauges={
        "sglang:token_usage": "token_usage",
        "sglang:num_running_reqs": "running",
        "sglang:num_queue_reqs": "queue",
        "sglang:gen_throughput": "gen_tps",
        "sglang:num_retracted_requests": "retracted",
    },
)
# The body is the worker's own (workers/engines/vllm.py), so that both sides send the same thing; the
# served model is left null (the server's only one).
VLLM = Api(
    name="vllm",
    generate_path="/v1/completions",
    body=lambda ids, params, rid: vllm_request(ids, params, rid=rid, model=None),
    output_ids=lambda reply: reply["choices"][0]["token_ids"],
    abort_path=None,
    gauges={
        "vllm:kv_cache_usage_perc": "token_usage",
        "vllm:num_requests_running": "running",
        "vllm:num_requests_waiting": "queue",
        "vllm:num_preemptions": "retracted",
    },
    generated_counter="vllm:generation_tokens",
)
APIS = {api.name: api for api in (SGLANG, VLLM)}


# Sampling the servers ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Sample:
    at: float  # time.perf_counter()
    token_usage: float = 0.0
    running: float = 0.0
    queue: float = 0.0
    gen_tps: float = 0.0  # the server's decode tokens/s over its last 40 decode steps
    retracted: float = 0.0
    generated: float = 0.0  # the API's generated-tokens counter, if it has one

    @classmethod
    def parse(cls, at: float, text: str, api: Api = SGLANG) -> Sample:
        gauges = dict(api.gauges)
        if api.generated_counter is not None:
            gauges[api.generated_counter] = "generated"
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            name = gauges.get(family.name)
            if name is not None:
                values[name] = sum(
                    s.value for s in family.samples if not s.name.endswith(("_created", "_bucket"))
                )
        return cls(at, **values)


@dataclass(frozen=True)
class Stats:
    """Mean and p95 of the gauges over a window, the mean decode rate and the retractions in it."""

    samples: int
    usage_mean: float
    usage_p95: float
    running_mean: float
    running_p95: float
    queue_mean: float
    queue_p95: float
    gen_tps_mean: float
    retractions: float

    @classmethod
    def of(cls, samples: Sequence[Sample]) -> Stats:
        usage = [s.token_usage for s in samples]
        running = [s.running for s in samples]
        queue = [s.queue for s in samples]
        return cls(
            samples=len(samples),
            usage_mean=_mean(usage),
            usage_p95=percentile(usage, 95),
            running_mean=_mean(running),
            running_p95=percentile(running, 95),
            queue_mean=_mean(queue),
            queue_p95=percentile(queue, 95),
            gen_tps_mean=_mean([s.gen_tps for s in samples]),
            # A restarted server starts its counter again; count only increases.
            retractions=sum(max(0.0, b.retracted - a.retracted) for a, b in itertools.pairwise(samples)),
        )

    def brief(self) -> str:
        usage = f"{self.usage_mean:4.0%}/{self.usage_p95:4.0%}"
        running = f"{self.running_mean:5.1f}/{self.running_p95:4.0f}"
        queue = f"{self.queue_mean:5.1f}/{self.queue_p95:4.0f}"
        retractions, decode = f"{self.retractions:4.0f}", f"{self.decode_per_running:7.0f}"
        return f"{usage:>11}  {running:>12}  {queue:>13}  {retractions}  {decode}"

    @property
    def decode_per_running(self) -> float:
        """Decode tokens/s per running request: how fast the server steps. At equal batches a
        lower figure is the simulator losing CPU to the other processes on the machine."""
        return self.gen_tps_mean / self.running_mean if self.running_mean else 0.0


def _mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else 0.0


STATS_HEADER = "KV mean/p95  run mean/p95  wait mean/p95  retr  tok/s/run"


class ServerSampler:
    """Polls each server's ``/metrics`` from a thread; a context manager around one variant.

    ``cpu_s`` is the thread's own CPU time, so a benchmark can take it out of the process's.
    A server that does not answer (killed, restarting) is simply not sampled that round.
    """

    def __init__(
        self,
        urls: dict[str, str],
        interval_s: float = SAMPLE_INTERVAL_S,
        apis: Mapping[str, Api] | None = None,
    ) -> None:
        """``apis``: each server's API by name (default: SGLang)."""
        self.urls = urls
        self.interval_s = interval_s
        self.apis = {name: (apis or {}).get(name, SGLANG) for name in urls}
        self.samples: dict[str, list[Sample]] = {name: [] for name in urls}
        self.cpu_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-sampler", daemon=True)

    def __enter__(self) -> ServerSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        started_cpu = time.thread_time()
        with httpx.Client(timeout=METRICS_TIMEOUT_S) as client:
            while not self._stop.is_set():
                for name, url in self.urls.items():
                    try:
                        text = client.get(f"{url}/metrics").text
                    except httpx.HTTPError:
                        continue
                    self._add(name, Sample.parse(time.perf_counter(), text, self.apis[name]))
                self._stop.wait(self.interval_s)
        self.cpu_s = time.thread_time() - started_cpu

    def _add(self, name: str, sample: Sample) -> None:
        samples = self.samples[name]
        if self.apis[name].generated_counter is not None and samples:
            # No decode-rate gauge: the counter's rate since the last sample (0 across a restart).
            previous = samples[-1]
            rate = max(0.0, sample.generated - previous.generated) / (sample.at - previous.at)
            sample = replace(sample, gen_tps=rate)
        samples.append(sample)

    def stats(self, name: str, since: float = -math.inf, until: float = math.inf) -> Stats:
        return Stats.of([s for s in self.samples[name] if since <= s.at <= until])

    def all_stats(self, since: float = -math.inf, until: float = math.inf) -> Stats:
        """Over every server: each sample round's gauges summed (KV usage: the mean over servers)."""
        rounds = zip(*(self.samples[n] for n in self.urls), strict=False)
        merged = [
            Sample(
                r[0].at,
                token_usage=_mean([s.token_usage for s in r]),
                running=sum(s.running for s in r),
                queue=sum(s.queue for s in r),
                gen_tps=sum(s.gen_tps for s in r),
                retracted=sum(s.retracted for s in r),
            )
            for r in rounds
        ]
        return Stats.of([s for s in merged if since <= s.at <= until])


# The hand-written baseline -------------------------------------------------------------------------
@dataclass
class PlainResult:
    label: str
    concurrency: int
    wall_s: float
    tokens: int
    cpu_s: float
    # Per prompt, in prompt order: output length, server index, sent and answered (perf_counter).
    lengths: list[int] = field(default_factory=list)
    servers: list[int] = field(default_factory=list)
    sent_at: list[float] = field(default_factory=list)
    done_at: list[float] = field(default_factory=list)
    started_at: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s


async def plain_run(
    urls: Sequence[str],
    prompts: Sequence[list[int]],
    params: dict[str, Any],
    concurrency: int,
    label: str = "plain",
    duration_s: float | None = None,
    api: Api | Sequence[Api] = SGLANG,
) -> PlainResult:
    """``concurrency`` requests in flight per server; prompt i goes to server i mod len(urls).

    ``api``: the servers' API, or each server's. With ``duration_s`` the run stops then:
    unanswered requests are cancelled (length 0, done_at 0.0) and aborted on the servers, so that
    they do not keep running into the next measurement.
    """
    apis = [api] * len(urls) if isinstance(api, Api) else list(api)
    semaphores = [asyncio.Semaphore(concurrency) for _ in urls]
    n = len(prompts)
    result = PlainResult(label, concurrency, 0.0, 0, 0.0)
    result.lengths, result.servers = [0] * n, [i % len(urls) for i in range(n)]
    result.sent_at, result.done_at = [0.0] * n, [0.0] * n
    # A pool as large as the semaphores (httpx's default of 100 connections would cap it) and no
    # timeouts (httpx's default 5 s pool timeout would fail requests queued behind the semaphore).
    limits = httpx.Limits(max_connections=concurrency * len(urls), max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=None) as client:

        async def one(index: int) -> None:
            server = result.servers[index]
            async with semaphores[server]:
                result.sent_at[index] = time.perf_counter()
                speaks = apis[server]
                body = speaks.body(prompts[index], params, f"{label}-{index}")
                response = await client.post(f"{urls[server]}{speaks.generate_path}", json=body)
                response.raise_for_status()
                result.lengths[index] = len(speaks.output_ids(response.json()))
                result.done_at[index] = time.perf_counter()

        cpu_started = time.process_time()
        result.started_at = time.perf_counter()
        tasks = [asyncio.ensure_future(one(i)) for i in range(n)]
        done, pending = await asyncio.wait(tasks, timeout=duration_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for task in done:
            task.result()  # an HTTP error fails the benchmark
        result.wall_s = time.perf_counter() - result.started_at
        result.cpu_s = time.process_time() - cpu_started
        for url, speaks in zip(urls, apis, strict=True):
            if pending and speaks.abort_path is not None:
                await client.post(f"{url}{speaks.abort_path}", json={"abort_all": True})
    result.tokens = sum(result.lengths)
    return result


# The datagen side ----------------------------------------------------------------------------------
def render(spec: JobSpec, rows: list[dict[str, Any]], path: Path) -> list[list[int]]:
    """Write ``rows`` to ``path`` as JSONL and return each prompt's ids as ingestion renders them."""
    write_jsonl(path, rows)
    with open(path, "rb") as stream:
        items = list(iter_prompts(stream, multi_turn=spec.multi_turn))
    prompts = [item for item in items if isinstance(item, Prompt)]
    if len(prompts) != len(rows):
        raise SystemExit(f"{len(rows) - len(prompts)} rows of the generated dataset were rejected")
    renderer = renderer_for(spec)
    return [renderer.render(p.messages, p.tools) for p in prompts]


def ingest(client: redis.Redis, storage: Storage, spec: JobSpec, path: Path, n: int) -> float:
    """Flush Redis and enqueue the file as one job (``Ingestor.run``, as the coordinator does);
    returns the seconds ``Ingestor.run`` took."""
    client.flushdb()
    keys = Keys(BENCH_NAMESPACE)
    jobs = JobStore(client, keys)
    jobs.create(BENCH_JOB_ID, spec)
    options = IngestOptions(
        chunk=DEFAULT_ENQUEUE_CHUNK,
        enqueue=EnqueueOptions(
            result_ttl_s=DEFAULT_RESULT_TTL_S, failure_ttl_s=DEFAULT_FAILURE_TTL_S, max_worker_losses=3
        ),
    )
    ingestor = Ingestor(client, keys, jobs, storage, options)
    started = time.perf_counter()
    ingestor.run(BENCH_JOB_ID, path, threading.Event())
    elapsed_s = time.perf_counter() - started
    progress = jobs.progress(BENCH_JOB_ID)
    if progress.state is JobState.FAILED or progress.accepted != n:
        raise SystemExit(f"ingestion did not accept all {n} prompts: {progress}")
    return elapsed_s


def worker_settings(redis_url: str, storage: Storage, time_scale: float, **overrides: Any) -> WorkerSettings:
    """Worker settings for a benchmark: the group commit scaled like the GPU, a short poll."""
    values: dict[str, Any] = {
        "redis_url": redis_url,
        "storage": str(storage.root),
        "namespace": BENCH_NAMESPACE,
        "metrics_port": 0,
        # Every prompt here is short. Not 0: a burst worker with a class of capacity 0 never returns.
        "long_concurrency": 1,
        "commit_interval_s": max(MIN_INTERVAL_S, COMMIT_INTERVAL_AT_SCALE_1_S * time_scale),
        "poll_interval_s": MIN_INTERVAL_S,
    }
    values.update(overrides)
    return WorkerSettings(**values)


@dataclass(frozen=True)
class WorkerRun:
    wall_s: float
    cpu_s: float
    started_at: float  # perf_counter at Worker.main()
    worker: Worker


async def run_worker(
    settings: WorkerSettings,
    servers: dict[str, str],
    watch: Callable[[Worker], Awaitable[None]] | None = None,
) -> WorkerRun:
    """One burst run of one ``Worker``; wall and CPU seconds of this process (all threads).

    The steps of ``Worker.main()`` (start, run, drain, close), so that ``watch(worker)`` can run
    beside it once the worker has started (to trace its limits, say); it is cancelled at the end.
    """
    specs = [ServerSpec(name, url) for name, url in servers.items()]
    worker = Worker(settings, specs, burst=True, install_signal_handlers=False)
    cpu_started = time.process_time()
    started = time.perf_counter()
    await worker.start()
    watcher = asyncio.create_task(watch(worker)) if watch is not None else None
    try:
        await worker.run()
    finally:
        await worker.drain()
        await worker.close()
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
    return WorkerRun(time.perf_counter() - started, time.process_time() - cpu_started, started, worker)


def read_records(client: redis.Redis, storage: Storage, n: int) -> list[dict[str, Any]]:
    """Every record of the benchmark job, after checking the job completed with ``n`` distinct ones."""
    progress = JobStore(client, Keys(BENCH_NAMESPACE)).progress(BENCH_JOB_ID)
    if progress.state is not JobState.COMPLETED or progress.done != n:
        raise SystemExit(f"the worker did not finish every prompt: {progress}")
    columns = ["sample_id", "output_len", "server", "rid", "attempts", "started_at_ms", "finished_at_ms"]
    rows = [
        {k: row[k] for k in columns}
        for b in storage.iter_record_batches(BENCH_JOB_ID)
        for row in b.to_pylist()
    ]
    if len({r["sample_id"] for r in rows}) != n:
        raise SystemExit(f"expected {n} distinct records, found {len(rows)}")
    return rows
