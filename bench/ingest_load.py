"""Ingesting a large dataset through a real coordinator process while a worker runs (issue 5, case 10).

One private Redis, one simulated SGLang server (``datagen sim``, ``--time-scale 0`` by default),
one ``datagen coordinator`` and one ``datagen worker`` run as child processes. N one-turn prompts
(default 1,000,000) are written to a file (JSONL unless ``--format`` says otherwise) and
submitted with ``POST /jobs``; the worker takes prompts off the queue while the coordinator
ingests the rest.

``--format`` writes the rows as JSONL (plain, ``.gz``, ``.zst``) or one Parquet file (``messages`` a
list of structs, in row groups of 100,000), and ``--by-reference`` names the file with ``dataset_url``
(the coordinator reads it from the local disk, under ``DATAGEN_DATASET_ALLOWLIST``) instead of
uploading it.

Lines printed:

``raw tokenizer``
    ``PromptRenderer.render`` on the first ``--render-n`` rows (the same in every format, parsed
    beforehand from JSONL), in this process before anything else starts and again once the stack
    has stopped: the ceiling of the coordinator's single ingestion thread, measured in the same
    run. The ratio is to the mean of the two; on a shared machine whose speed drifts from minute
    to minute, the two differ, and one measured only before would tilt the ratio either way. Then
    the same in two processes at once, their rates added: what this machine's cores give together
    (a shared VM's two cores can give well under twice one's rate once both are busy), the ceiling
    of any ingestion that keeps both busy and what two rendering processes could reach against one.
``transformers' own apply_chat_template``
    ``apply_chat_template(tokenize=True)`` with the job's template on the same rows, once the stack
    has stopped: what a hand-written script pays a row, for the same ids (checked on 100 rows).
    ``PromptRenderer.render`` pays less: it renders each row once, within the render budget, inside
    transformers' own call, and hands the text to the tokenizers library itself.
``ingest``
    From the ``202`` of ``POST /jobs`` to the job leaving ``ingesting``: parse, render, duplicate
    guard, and each chunk landed in one script (prompts, counters, checkpoint), in the coordinator
    process, with Redis, the worker and the simulator sharing the machine. The ratio to the raw
    tokenizer rate is printed (1.0 would mean ingestion costs nothing beyond rendering). The submit
    (``POST /jobs`` until ``202``: the upload, if any) is printed on its own line, and so is the
    time from sending it to the job's first prompt enqueued (issue 41: within 1 s of the submit,
    with no pass over the whole input first), with how far the input was read then: rows of the
    total where the format knows it (Parquet's footer), bytes otherwise. ``--until-first-prompt``
    stops there and prints only those two lines (for a dataset far too large to ingest here:
    ``--n 10000000``).
``GET /jobs/{id}``
    Latency of the progress route sampled every ``--sample-interval-s`` during ingestion, p50, p99
    and max (target: p99 < 100 ms), so that a busy ingestion thread does not stall the API.
    Redis PING latency from the benchmark is sampled alongside: when both are high, Redis was
    busy (a chunk's landing script runs as one command); when only the route is slow, the coordinator
    process was (its ingestion thread shares the GIL with the API).
``CPU``
    CPU time per prompt during ingestion, from ``/proc``: the coordinator process (its ingestion
    thread, API and background threads), its rendering processes (``DATAGEN_INGEST_PROCESSES``),
    and Redis (``INFO cpu``). From them, the projection: the prompts/s one coordinator process
    can reach whatever its cores (its ingestion thread holds the GIL, so the coordinator's own
    CPU per prompt bounds it), and the cores a rate needs (every process's CPU per prompt). The
    ceiling line puts that CPU in raw renders a prompt and says what this machine's cores would
    ingest at it, all of them busy, and how much of that the run reached: ingestion's ratio to the
    raw rate is the ceiling's ratio times that share, so a row that costs more and cores left idle
    show apart (on 2 cores a ratio of 0.9 needs at most 2.2 raw renders' CPU a prompt, every core
    busy). The fleet lines use the issue's figures: 65 chat-length prompts/s per H200 of an 8B target, about
    10.5 at reasoning lengths, for 256 GPUs.
``memory``
    Peak RSS of the coordinator (``VmHWM``, the kernel's high-water mark) and Redis's
    ``used_memory_peak``, with bytes per prompt. ``--max-queued`` sets
    ``DATAGEN_MAX_QUEUED_PER_CLASS``; by default it is N, so ingestion never waits for room and
    Redis holds every prompt at the end (about 1.2 KiB each: job hash with its payload, queue entry,
    guard-set member). With ``--drain-per-s R`` a thread pops R prompts a second off the queue and
    deletes their job hashes (a fast fleet whose results expire), and a ``--max-queued`` below N
    then keeps Redis to a bounded window, which the ``memory`` line shows.

Rates are lower bounds on a 2-core machine that also runs Redis, the simulator and the worker:
compare the ratio, not the rates. ``tests/faults/test_fault_ingest_memory.py`` is the CI check
that memory stays flat with size.

Run: ``python bench/ingest_load.py [--n 1000000] [--format jsonl|jsonl.gz|jsonl.zst|parquet]
[--by-reference] [--until-first-prompt] [--workers 1] [--chunk 1000] [--max-queued N] [--drain-per-s R]
[--render-n 100000] [--concurrency 32] [--time-scale 0] [--sample-interval-s 0.05]``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import multiprocessing
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import redis
import zstandard
from _common import job_spec, offline_hub, simulator_process, transformers_ids

from datagen.control.dispatch import Dispatch
from datagen.control.keys import Keys
from datagen.errors import ConfigError
from datagen.prompts.dataset import Prompt, iter_prompts
from datagen.prompts.tokenization import PromptRenderer, renderer_for
from datagen.settings import DEFAULT_ENQUEUE_CHUNK
from datagen.states import Priority, PromptClass
from datagen_cli.local.processes import ChildProcesses, child_env
from datagen_cli.local.redis_server import LocalRedis, free_port
from simulator.config import DEFAULT_CONTEXT_LEN as SIM_CONTEXT_LEN

DEFAULT_N = 1_000_000
DEFAULT_RENDER_N = 100_000
DEFAULT_CONCURRENCY = 32
DEFAULT_SAMPLE_INTERVAL_S = 0.05
NAMESPACE = "ingestload"
P99_TARGET_S = 0.100
# Prompts/s one GPU consumes (an 8B target on an H200, issue 41), and the fleet projected.
FLEET_GPUS = 256
PROMPTS_PER_GPU_S = {"chat": 65.0, "reasoning": 10.5}
STARTUP_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0
HTTP_TIMEOUT_S = 30.0
UPLOAD_TIMEOUT_S = 3600.0
DRAIN_TICK_S = 0.05
_TOPICS = ("sorting", "recursion", "photosynthesis", "inflation", "entropy", "plate tectonics", "jazz")


def rows(n: int) -> Iterator[dict[str, Any]]:
    """The rows of ``_common.short_rows``, generated one at a time (a million dicts would not fit)."""
    for i in range(n):
        topic = _TOPICS[i % len(_TOPICS)]
        yield {
            "id": f"p{i}",
            "messages": [{"role": "user", "content": f"Question {i}: explain {topic} briefly."}],
        }


# The input forms the bench writes (`datagen.prompts.inputs`), each told by its file name's suffix.
FORMATS = ("jsonl", "jsonl.gz", "jsonl.zst", "parquet")
# Rows a Parquet row group holds: the rows the writer keeps in memory at once (ingestion reads a
# Parquet file in batches of its own size, whatever its row groups).
PARQUET_ROW_GROUP = 100_000
_MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
_PARQUET_SCHEMA = pa.schema([("id", pa.string()), ("messages", _MESSAGES)])


def jsonl_lines(n: int) -> Iterator[bytes]:
    return (json.dumps(row).encode() + b"\n" for row in rows(n))


def write_jsonl(path: Path, n: int) -> None:
    with open(path, "wb") as fh:
        fh.writelines(jsonl_lines(n))


def write_dataset(path: Path, n: int, fmt: str) -> int:
    """The ``n`` rows in ``fmt`` at ``path`` (a JSONL line per row; Parquet's ``messages`` a list
    of structs, as Hugging Face datasets store it); the file's size."""
    if fmt == "parquet":
        with pq.ParquetWriter(path, _PARQUET_SCHEMA) as writer:
            batch: list[dict[str, Any]] = []
            for row in rows(n):
                batch.append(row)
                if len(batch) == PARQUET_ROW_GROUP:
                    writer.write_table(pa.Table.from_pylist(batch, schema=_PARQUET_SCHEMA))
                    batch = []
            if batch:
                writer.write_table(pa.Table.from_pylist(batch, schema=_PARQUET_SCHEMA))
    elif fmt == "jsonl":
        write_jsonl(path, n)
    else:
        lines = jsonl_lines(n)
        if fmt == "jsonl.gz":
            with gzip.open(path, "wb", compresslevel=6) as fh:
                fh.writelines(lines)
        else:
            with open(path, "wb") as raw, zstandard.ZstdCompressor().stream_writer(raw) as fh:
                for line in lines:  # zstandard's writer has no writelines
                    fh.write(line)
    return path.stat().st_size


def _raw_prompts(path: Path, n: int) -> tuple[PromptRenderer, list[Prompt]]:
    """The bench job's renderer (the tokenizer loaded) and the first ``n`` rows of the file."""
    offline_hub()  # again: this runs in processes of its own too
    spec = job_spec()
    renderer = renderer_for(spec)  # loads the tokenizer once, outside the timing
    prompts: list[Prompt] = []
    with open(path, "rb") as stream:
        for item in iter_prompts(stream, multi_turn=spec.multi_turn):
            if len(prompts) >= n:
                break
            assert isinstance(item, Prompt), item
            prompts.append(item)
    return renderer, prompts


def raw_render_rate(path: Path, n: int, barrier: Any = None) -> tuple[float, int]:
    """Prompts per second of ``PromptRenderer.render`` alone, on the first ``n`` rows of the file
    (``barrier``: waited on once loaded, so that renderers in several processes start together)."""
    renderer, prompts = _raw_prompts(path, n)
    if barrier is not None:
        barrier.wait()
    started = time.perf_counter()
    tokens = sum(len(renderer.render(p.messages, p.tools)) for p in prompts)
    return len(prompts) / (time.perf_counter() - started), tokens // max(1, len(prompts))


def plain_render_rate(path: Path, n: int) -> float:
    """Prompts per second of transformers' own ``apply_chat_template(tokenize=True)`` with the job's
    template on the same rows: what a hand-written script pays a row. ``PromptRenderer.render``
    gives the same ids (checked here) for less: it renders once, within the budget, and hands the
    text to the tokenizers library itself."""
    renderer, prompts = _raw_prompts(path, n)
    started = time.perf_counter()
    ids = [transformers_ids(renderer, p) for p in prompts]
    rate = len(prompts) / (time.perf_counter() - started)
    for prompt, plain in zip(prompts[:100], ids, strict=False):
        assert plain == renderer.render(prompt.messages, prompt.tools), "PromptRenderer.render differs"
    return rate


def parallel_render_rate(path: Path, n: int, processes: int = 2) -> float:
    """Prompts per second of ``processes`` raw renderers at once, in processes of their own, all
    added: what this machine's cores give together this run (a shared VM's cores can give well
    under their number once all are busy), the ceiling of an ingestion that keeps them all busy."""
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager, context.Pool(processes) as pool:
        barrier = manager.Barrier(processes)
        rates = pool.starmap(raw_render_rate, [(path, n, barrier)] * processes)
    return sum(rate for rate, _ in rates)


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (``/proc/<pid>/stat``); 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (its rendering processes and their helpers), from ``/proc``."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        children = [child for child, of in parents.items() if of == parent]
        found += children
        frontier += children
    return found


@dataclass
class CpuSeconds:
    coordinator: float
    rendering: dict[int, float]
    redis: float

    @classmethod
    def read(cls, coordinator_pid: int, client: redis.Redis) -> CpuSeconds:
        info = client.info("cpu")
        return cls(
            cpu_s(coordinator_pid),
            {pid: cpu_s(pid) for pid in descendants(coordinator_pid)},
            float(info["used_cpu_user"]) + float(info["used_cpu_sys"]),
        )

    def since(self, before: CpuSeconds) -> CpuSeconds:
        return CpuSeconds(
            self.coordinator - before.coordinator,
            {pid: s - before.rendering.get(pid, 0.0) for pid, s in self.rendering.items()},
            self.redis - before.redis,
        )


RENDERED_ROWS = "datagen_ingest_rendered_rows_total"
RENDER_CPU = "datagen_ingest_render_cpu_seconds_total"


def rendered_rows(coordinator_url: str) -> dict[str, float]:
    """The coordinator's rendering metrics: ``<metric>/<where>`` (thread, process) -> value."""
    text = httpx.get(f"{coordinator_url}/metrics", timeout=HTTP_TIMEOUT_S).text
    found: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0]
        if name in (RENDERED_ROWS, RENDER_CPU):
            where = line.split('where="', 1)[1].split('"', 1)[0]
            found[f"{name}/{where}"] = float(line.rsplit(" ", 1)[1])
    return found


def peak_rss_bytes(pid: int) -> int:
    """The kernel's high-water mark of the process's resident set (``VmHWM``); Linux only."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise SystemExit("no VmHWM in /proc/<pid>/status: this benchmark needs Linux")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(len(ordered) * q / 100 + 0.5) - 1))] if ordered else 0.0


def wait_http(children: ChildProcesses, url: str) -> None:
    """Until ``url`` answers; exits with the log tail of a child that failed."""
    try:
        children.wait_http(url, STARTUP_TIMEOUT_S)
    except ConfigError as exc:
        tails = "".join(
            f"\n== {name}\n{children.log_path(name).read_text(errors='replace')[-2000:]}"
            for name, proc in children.procs.items()
            if proc.poll() is not None
        )
        raise SystemExit(f"{exc}{tails}") from exc


@dataclass
class Observations:
    """What the sampler thread saw while the job was ingesting."""

    latencies_s: list[float] = field(default_factory=list)
    redis_ping_s: list[float] = field(default_factory=list)
    errors: int = 0
    queue_peak: int = 0
    last: dict[str, Any] = field(default_factory=dict)
    # When the job first showed a prompt enqueued (``perf_counter``), and how far it had read its
    # input then (``input`` of ``GET /jobs/{id}``).
    first_prompt_at: float | None = None
    first_input: dict[str, Any] | None = None
    # The last ``input`` seen while ingesting.
    last_input: dict[str, Any] | None = None


def observe(
    coordinator_url: str,
    job_id: str,
    client: redis.Redis,
    interval_s: float,
    stop: threading.Event,
    until_first_prompt: bool = False,
) -> Observations:
    """Sample ``GET /jobs/{id}`` latency and the queue length until the job leaves ``ingesting``
    (``until_first_prompt``: until its first prompt is enqueued)."""
    seen = Observations()
    waiting = Dispatch(client, Keys(NAMESPACE))
    with httpx.Client(base_url=coordinator_url, timeout=HTTP_TIMEOUT_S) as http:
        while not stop.is_set():
            started = time.perf_counter()
            try:
                response = http.get(f"/jobs/{job_id}")
            except httpx.HTTPError:
                seen.errors += 1
                stop.wait(interval_s)
                continue
            seen.latencies_s.append(time.perf_counter() - started)
            if response.status_code != 200:
                seen.errors += 1
            else:
                seen.last = response.json()
                if seen.first_prompt_at is None and seen.last.get("total"):
                    seen.first_prompt_at, seen.first_input = time.perf_counter(), seen.last.get("input")
                    if until_first_prompt:
                        break
                if seen.last["state"] != "ingesting":
                    break
                seen.last_input = seen.last.get("input") or seen.last_input
            seen.queue_peak = max(seen.queue_peak, waiting.depth(PromptClass.SHORT))
            pinged = time.perf_counter()
            client.ping()
            seen.redis_ping_s.append(time.perf_counter() - pinged)
            stop.wait(interval_s)
    return seen


def drain(client: redis.Redis, per_s: float, stop: threading.Event) -> None:
    """Pop ``per_s`` prompts a second off the job's short backlog and delete their RQ job hashes."""
    keys = Keys(NAMESPACE)
    started, popped = time.monotonic(), 0
    while not stop.wait(DRAIN_TICK_S):
        jobs = client.zrange(keys.dispatch_jobs(PromptClass.SHORT, Priority.NORMAL), 0, 0)
        if not jobs:
            continue
        due = int((time.monotonic() - started) * per_s) - popped
        ids = client.lpop(keys.job_backlog(jobs[0].decode(), PromptClass.SHORT), due) if due > 0 else None
        if ids:
            client.delete(*[b"rq:job:" + i for i in ids])
            popped += len(ids)


def submit(coordinator_url: str, dataset: Path, by_reference: bool) -> str:
    """Submit ``dataset``: uploaded, or named by ``dataset_url`` (the coordinator reads the file)."""
    # The simulator's context length, so that the pre-flight checks need not wait for the worker.
    spec = job_spec(short_max_new_tokens=64, long_threshold_tokens=100_000, context_len=SIM_CONTEXT_LEN)
    form = {"spec": spec.model_dump_json()}
    if by_reference:
        response = httpx.post(
            f"{coordinator_url}/jobs", data={**form, "dataset_url": str(dataset)}, timeout=HTTP_TIMEOUT_S
        )
    else:
        with open(dataset, "rb") as fh:
            response = httpx.post(
                f"{coordinator_url}/jobs",
                data=form,
                files={"dataset": (dataset.name, fh, "application/octet-stream")},
                timeout=UPLOAD_TIMEOUT_S,
            )
    if response.status_code != 202:
        raise SystemExit(f"POST /jobs answered {response.status_code}: {response.text}")
    return str(response.json()["id"])


@dataclass(frozen=True)
class Result:
    n: int
    dataset_bytes: int
    # From sending POST /jobs to the job's first prompt enqueued, as sampled.
    first_prompt_s: float | None
    # The raw rate measured before the stack started and after it stopped.
    render_rates: tuple[float, float]
    # Two raw renderers at once, in processes of their own, added (after the stack stopped).
    parallel_rate: float
    # transformers' own apply_chat_template on the same rows (after the stack stopped).
    plain_rate: float
    mean_tokens: int
    upload_s: float
    ingest_s: float
    seen: Observations
    rss_peak: int
    redis_peak: int
    cpu: CpuSeconds
    # The coordinator's rendering metrics (`rendered_rows`).
    rendered: dict[str, float]

    @property
    def render_rate(self) -> float:
        return sum(self.render_rates) / 2


def run(args: argparse.Namespace, tmp: Path, max_queued: int) -> Result:
    dataset = tmp / f"prompts.{args.format}"
    size = write_dataset(dataset, args.n, args.format)
    # The raw rate's rows, the same in every format, parsed as ingestion parses a JSONL line.
    raw_rows = tmp / "raw-rows.jsonl"
    write_jsonl(raw_rows, min(args.n, args.render_n))
    first_only = args.until_first_prompt
    before_rate, mean_tokens = (0.0, 0) if first_only else raw_render_rate(raw_rows, args.render_n)
    with LocalRedis() as server, simulator_process(time_scale=args.time_scale) as sim_url:
        client = redis.Redis.from_url(server.url)
        port = free_port()
        coordinator_url = f"http://127.0.0.1:{port}"
        env = {
            "DATAGEN_REDIS_URL": server.url,
            "DATAGEN_STORAGE": str(tmp / "data"),
            "DATAGEN_NAMESPACE": NAMESPACE,
            "DATAGEN_ENQUEUE_CHUNK": str(args.chunk),
            "DATAGEN_INGEST_PROCESSES": str(args.workers),
            "DATAGEN_MAX_QUEUED_PER_CLASS": str(max_queued),
            "DATAGEN_METRICS_PORT": "0",
            "DATAGEN_LOG_LEVEL": "WARNING",
            "DATAGEN_DATASET_ALLOWLIST": str(tmp) if args.by_reference else "",
        }
        children = ChildProcesses(tmp, child_env(env), stop_timeout_s=STOP_TIMEOUT_S)
        stop = threading.Event()
        try:
            coordinator = children.spawn("coordinator", "coordinator", "--port", str(port))
            if args.concurrency:
                worker_args = ["--server", f"sim={sim_url}", "--short-concurrency", str(args.concurrency)]
                children.spawn("worker", "worker", *worker_args)
            wait_http(children, f"{coordinator_url}/healthz")
            if args.drain_per_s:
                threading.Thread(target=drain, args=(client, args.drain_per_s, stop), daemon=True).start()
            before = CpuSeconds.read(coordinator.pid, client)
            posted = time.perf_counter()
            job_id = submit(coordinator_url, dataset, args.by_reference)
            accepted_at = time.perf_counter()
            seen = observe(coordinator_url, job_id, client, args.sample_interval_s, stop, first_only)
            ingest_s = time.perf_counter() - accepted_at
            cpu = CpuSeconds.read(coordinator.pid, client).since(before)
            rendered = rendered_rows(coordinator_url)
            stop.set()
            rss_peak = peak_rss_bytes(coordinator.pid)
            redis_peak = int(client.info("memory")["used_memory_peak"])
        finally:
            stop.set()
            children.stop()
            client.close()
    job = seen.last
    if first_only:
        if seen.first_prompt_at is None:
            raise SystemExit(f"the job ended before a prompt was enqueued: {job}")
        after_rate = parallel_rate = plain_rate = 0.0
    else:
        if job.get("state") not in ("running", "completed") or job.get("total") != args.n:
            raise SystemExit(f"ingestion did not accept all {args.n} prompts: {job}")
        after_rate, _ = raw_render_rate(raw_rows, args.render_n)
        parallel_rate = parallel_render_rate(raw_rows, args.render_n)
        plain_rate = plain_render_rate(raw_rows, args.render_n)
    upload_s = accepted_at - posted
    return Result(
        args.n,
        size,
        None if seen.first_prompt_at is None else seen.first_prompt_at - posted,
        (before_rate, after_rate),
        parallel_rate,
        plain_rate,
        mean_tokens,
        upload_s,
        ingest_s,
        seen,
        rss_peak,
        redis_peak,
        cpu,
        rendered,
    )


def _dataset_line(args: argparse.Namespace, r: Result) -> str:
    how = "by reference (dataset_url)" if args.by_reference else "uploaded"
    return f"N={r.n} prompts ({r.dataset_bytes / 2**20:.1f} MiB {args.format}, {how})"


def _first_prompt_line(args: argparse.Namespace, r: Result) -> None:
    if r.first_prompt_s is not None:
        print(
            f"  first prompt enqueued, from sending POST /jobs      {r.first_prompt_s:9.2f} s "
            f"(sampled every {args.sample_interval_s:g} s; input then: {_progress(r.seen.first_input or {})})"
        )


def report_first(args: argparse.Namespace, r: Result) -> None:
    """``--until-first-prompt``: the submit and its first prompt, nothing else measured."""
    print(f"ingest_load --until-first-prompt: {_dataset_line(args, r)}, {args.workers} rendering process(es)")
    print(f"  submit: POST /jobs until 202                       {r.upload_s:9.2f} s")
    _first_prompt_line(args, r)


def report(args: argparse.Namespace, max_queued: int, r: Result) -> None:
    ingest_rate = r.n / r.ingest_s
    lat = r.seen.latencies_s
    p99 = percentile(lat, 99)
    verdict = "meets" if p99 < P99_TARGET_S else "MISSES"
    print(
        f"ingest_load: {_dataset_line(args, r)}, mean {r.mean_tokens} "
        f"prompt tokens, chunk {args.chunk}, max queued {max_queued}, drain {args.drain_per_s or 'off'}, "
        f"worker c={args.concurrency} on a time-scale-{args.time_scale} simulator, "
        f"{args.workers} rendering process(es) (DATAGEN_INGEST_PROCESSES)"
    )
    rendered = min(r.n, args.render_n)
    before, after = r.render_rates
    print(
        f"  raw tokenizer: PromptRenderer.render, {rendered} rows  {r.render_rate:9.0f} prompts/s "
        f"(before {before:.0f}, after {after:.0f})"
    )
    print(
        f"  raw tokenizer in 2 processes at once, added          {r.parallel_rate:9.0f} prompts/s "
        f"({r.parallel_rate / r.render_rate:.2f}x one: what both cores give this run)"
    )
    print(
        f"  transformers' own apply_chat_template, same rows     {r.plain_rate:9.0f} prompts/s "
        "(what a hand-written script pays; the same ids)"
    )
    print(f"  submit: POST /jobs until 202                       {r.upload_s:9.1f} s")
    _first_prompt_line(args, r)
    print(
        f"  ingest: 202 until the job left ingesting           {r.ingest_s:9.1f} s {ingest_rate:7.0f} "
        f"prompts/s ({ingest_rate / r.render_rate:.2f}x the raw tokenizer rate, "
        f"{ingest_rate / r.plain_rate:.2f}x transformers' own)"
    )
    print(f"  input read at the last sample while ingesting: {_progress(r.seen.last_input or {})}")
    print(f"  worker done during ingestion                        {r.seen.last.get('done', 0):9d} prompts")
    print(
        f"  GET /jobs/{{id}} during ingestion: {len(lat)} samples, p50 {percentile(lat, 50) * 1000:.1f} ms, "
        f"p99 {p99 * 1000:.1f} ms, max {max(lat, default=0) * 1000:.1f} ms, {r.seen.errors} errors "
        f"({verdict} the p99 < {P99_TARGET_S * 1000:.0f} ms target)"
    )
    ping = r.seen.redis_ping_s
    print(
        f"  Redis PING from here meanwhile: p50 {percentile(ping, 50) * 1000:.1f} ms, "
        f"p99 {percentile(ping, 99) * 1000:.1f} ms, max {max(ping, default=0) * 1000:.1f} ms "
        "(Redis blocked by an enqueue transaction shows here too)"
    )
    print(
        f"  memory: coordinator peak RSS {r.rss_peak / 2**20:.1f} MiB; Redis used_memory_peak "
        f"{r.redis_peak / 2**20:.1f} MiB ({r.redis_peak / r.n:.0f} B a prompt); "
        f"queue peak {r.seen.queue_peak}"
    )


def _progress(read: dict[str, Any]) -> str:
    """``input`` of ``GET /jobs/{id}``: rows read of the total, or bytes read, as the format knows."""
    if not read:
        return "not shown"
    rows_read = read.get("rows_read") or 0
    if read.get("rows_total") is not None:
        return f"{rows_read:,} of {read['rows_total']:,} rows"
    if read.get("bytes_total"):
        return f"{rows_read:,} rows, {read.get('bytes_read') or 0:,} of {read['bytes_total']:,} bytes"
    return f"{rows_read:,} rows"


def report_cpu(r: Result) -> None:
    """CPU per prompt by process, and what it projects to (the upload's own CPU is included)."""
    per_prompt_us = {
        "coordinator": r.cpu.coordinator / r.n * 1e6,
        "rendering": sum(r.cpu.rendering.values()) / r.n * 1e6,
        "redis": r.cpu.redis / r.n * 1e6,
    }
    total_us = sum(per_prompt_us.values())
    shown = ", ".join(f"{name} {us:.0f}" for name, us in per_prompt_us.items())
    print(f"  CPU per prompt (µs): {shown}; {total_us:.0f} in all ({1e6 / total_us:.0f} prompts/s per core)")
    # What the machine's cores could give at that CPU a prompt, all of them busy: ingestion's ratio
    # to the raw rate is this ceiling's ratio times how busy it kept the cores, so the two apart tell
    # a costlier row from idle cores.
    cores = os.cpu_count() or 1
    ceiling_rate = cores * 1e6 / total_us
    print(
        f"  CPU ceiling: {total_us * r.render_rate / 1e6:.2f} raw renders' CPU a prompt; {cores} cores "
        f"give {ceiling_rate:.0f} prompts/s at that ({ceiling_rate / r.render_rate:.2f}x the raw rate), and "
        f"ingestion reached {r.n / r.ingest_s / ceiling_rate:.0%} of it"
    )
    # The coordinator's own work: its CPU less what its ingestion thread spent rendering.
    rows = {where: r.rendered.get(f"{RENDERED_ROWS}/{where}", 0.0) for where in ("thread", "process")}
    cpu_s = {where: r.rendered.get(f"{RENDER_CPU}/{where}", 0.0) for where in ("thread", "process")}
    own_us = max(1.0, (r.cpu.coordinator - cpu_s["thread"]) / r.n * 1e6)
    # Rendering in its thread alone, the coordinator's CPU bounds it; with processes, its own work.
    ceiling = 1e6 / own_us if rows["process"] else 1e6 / per_prompt_us["coordinator"]
    each = ", ".join(
        f"{rows[w]:.0f} in {'the ingestion thread' if w == 'thread' else 'rendering processes'}"
        + (f" ({cpu_s[w] / rows[w] * 1e6:.0f} µs a row)" if rows[w] else "")
        for w in ("thread", "process")
    )
    print(
        f"  rows rendered: {each}, against {1e6 / r.render_rate:.0f} µs a row of the raw tokenizer; "
        f"the coordinator's own work {own_us:.0f} µs a prompt"
    )
    how = "with enough rendering processes" if rows["process"] else "rendering in its ingestion thread"
    print(
        f"  projection: one coordinator process reaches about {ceiling:.0f} prompts/s {how} "
        "(its ingestion thread holds the GIL)"
    )
    for length, per_gpu in PROMPTS_PER_GPU_S.items():
        rate = FLEET_GPUS * per_gpu
        cores = rate * total_us / 1e6
        processes = math.ceil(rate / ceiling)
        feeders = (
            "one coordinator" if processes == 1 else f"{processes} coordinators (the dataset as as many jobs)"
        )
        print(
            f"  {FLEET_GPUS} GPUs at {length} length: {rate:.0f} prompts/s, {cores:.1f} cores "
            f"(Redis {rate * per_prompt_us['redis'] / 1e6:.2f}), {feeders}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=DEFAULT_N, help="prompts (default %(default)s)")
    parser.add_argument("--chunk", type=int, default=DEFAULT_ENQUEUE_CHUNK, help="DATAGEN_ENQUEUE_CHUNK")
    parser.add_argument("--max-queued", type=int, default=None, help="DATAGEN_MAX_QUEUED_PER_CLASS (N)")
    parser.add_argument("--drain-per-s", type=float, default=0.0, help="pop this many prompts/s (off)")
    parser.add_argument(
        "--workers", type=int, default=1, help="DATAGEN_INGEST_PROCESSES: rendering processes (0: in-thread)"
    )
    parser.add_argument(
        "--format", choices=FORMATS, default="jsonl", help="the input's form, told by its file name"
    )
    parser.add_argument(
        "--by-reference",
        action="store_true",
        help="name the file with dataset_url (the coordinator reads it) instead of uploading it",
    )
    parser.add_argument(
        "--until-first-prompt",
        action="store_true",
        help="stop once the job's first prompt is enqueued; print only the submit and that",
    )
    parser.add_argument("--render-n", type=int, default=DEFAULT_RENDER_N, help="rows for the raw rate")
    parser.add_argument(
        "--concurrency", type=int, default=DEFAULT_CONCURRENCY, help="worker's in flight (0: no worker)"
    )
    parser.add_argument("--time-scale", type=float, default=0.0, help="the simulator's time scale")
    parser.add_argument("--sample-interval-s", type=float, default=DEFAULT_SAMPLE_INTERVAL_S)
    args = parser.parse_args()
    offline_hub()
    max_queued = args.max_queued or args.n
    with tempfile.TemporaryDirectory(prefix="bench-ingest-load-") as tmp:
        result = run(args, Path(tmp), max_queued)
    if args.until_first_prompt:
        report_first(args, result)
        return
    report(args, max_queued, result)
    report_cpu(result)


if __name__ == "__main__":
    main()
