"""Enqueue throughput: N short prompts from a JSONL file into RQ jobs, in prompts per second.

Every variant runs against one private Redis (``LocalRedis`` on a free loopback port), is
repeated ``--repeat`` times with a FLUSHALL before each try; the best (shortest) try is
reported, with the worst in brackets.
After each try the short-prompt queue must hold exactly N jobs, or the script stops.

Lines printed:

``baseline``
    RQ's plain ``Queue.enqueue(...)`` called once per prompt in a loop: the same function name,
    payload dict, job id, TTLs, timeout, description and ``JSONSerializer`` as ours. The prompts
    are rendered beforehand, so only enqueueing is timed (two MULTI/EXEC round trips per job).
``ours``
    ``service.ingest.Ingestor.run`` on the JSONL file, end to end: parse rows, render and
    tokenize each with the bundled DeepSeek tokenizer and the shipped R1 template, check the
    job's rows guard, then land each chunk of ``--chunk`` prompts (RQ hashes, backlog, the job's
    counters and checkpoint) in one script (``ingest_land.lua``).
``rendering alone``
    ``PromptRenderer.render`` on the same prompts, nothing else: the part of ours the baseline
    does not do.
``ours minus rendering``
    ours' time minus the rendering time: the like-for-like comparison with the baseline (it
    still includes parsing the file and the duplicate guard, which the baseline skips).

The ratio column is baseline time / variant time, so above 1x means faster than the baseline.
Rates are lower bounds on a 2-core machine that also runs Redis; compare ratios, not rates.

Run: ``python bench/bench_ingest.py [--n 5000] [--repeat 3] [--chunk 1000]``.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import redis
from _common import BENCH_JOB_ID, BENCH_NAMESPACE, job_spec, offline_hub, short_rows, write_jsonl
from rq import Queue
from rq.serializers import JSONSerializer

from datagen.control.dispatch import Dispatch
from datagen.control.enqueue import JOB_TIMEOUT_S, RQ_JOB_FUNC, EnqueueOptions
from datagen.control.jobs import JobStore
from datagen.control.keys import Keys
from datagen.control.payload import PromptPayload
from datagen.prompts.dataset import Prompt, iter_prompts
from datagen.prompts.tokenization import PromptRenderer, renderer_for
from datagen.records.storage import Storage
from datagen.settings import DEFAULT_ENQUEUE_CHUNK, DEFAULT_FAILURE_TTL_S, DEFAULT_RESULT_TTL_S
from datagen.spec import JobSpec
from datagen.states import JobState, PromptClass
from datagen_cli.local.redis_server import LocalRedis
from service.ingest import IngestOptions, Ingestor

DEFAULT_N = 5000
DEFAULT_REPEAT = 3
CLS = PromptClass.SHORT


@dataclass(frozen=True)
class Setup:
    redis: redis.Redis
    keys: Keys
    spec: JobSpec
    storage: Storage
    options: IngestOptions
    input_path: Path
    n: int

    def queue(self) -> Queue:
        return Queue(self.keys.queue_name(CLS), connection=self.redis, serializer=JSONSerializer)

    def check_queued(self, variant: str) -> None:
        queued = {cls: self._count(cls) for cls in PromptClass}
        if queued[CLS] != self.n or sum(queued.values()) != self.n:
            raise SystemExit(f"{variant}: expected {self.n} queued jobs, found {queued}")

    def _count(self, cls: PromptClass) -> int:
        # The baseline pushes onto RQ's queue; ours leaves prompts in the job's backlog until a
        # worker's claim dispatches them (datagen/control/dispatch.py).
        queue = Queue(self.keys.queue_name(cls), connection=self.redis, serializer=JSONSerializer)
        return queue.count + Dispatch(self.redis, self.keys).depth(cls)


def timed_tries(repeat: int, setup: Setup, variant: str, run: Callable[[], float]) -> list[float]:
    """Times of ``repeat`` tries, each on a flushed Redis and checked afterwards."""
    times = []
    for _ in range(repeat):
        setup.redis.flushall()
        times.append(run())
        setup.check_queued(variant)
    return times


def read_prompts(path: Path, spec: JobSpec) -> list[Prompt]:
    with open(path, "rb") as stream:
        items = list(iter_prompts(stream, multi_turn=spec.multi_turn))
    prompts = [item for item in items if isinstance(item, Prompt)]
    if len(prompts) != len(items):
        raise SystemExit(f"{len(items) - len(prompts)} rows of the generated dataset were rejected")
    return prompts


def render_all(renderer: PromptRenderer, prompts: list[Prompt]) -> tuple[float, list[list[int]]]:
    started = time.perf_counter()
    ids = [renderer.render(p.messages, p.tools) for p in prompts]
    return time.perf_counter() - started, ids


def baseline_enqueue(setup: Setup, payloads: list[PromptPayload]) -> float:
    """Queue.enqueue once per prompt, with the job data datagen.control.enqueue builds."""
    queue = setup.queue()
    options = setup.options.enqueue
    started = time.perf_counter()
    for p in payloads:
        queue.enqueue(
            RQ_JOB_FUNC,
            p.to_json(),
            job_id=setup.keys.rq_job_id(p.job, p.sample_id, p.turn, p.gen),
            job_timeout=JOB_TIMEOUT_S[p.cls],
            result_ttl=options.result_ttl_s,
            failure_ttl=options.failure_ttl_s,
            description=f"{p.job} {p.sample_id} t{p.turn} g{p.gen}",
        )
    return time.perf_counter() - started


def ours_ingest(setup: Setup) -> float:
    jobs = JobStore(setup.redis, setup.keys)
    jobs.create(BENCH_JOB_ID, setup.spec)
    ingestor = Ingestor(setup.redis, setup.keys, jobs, setup.storage, setup.options)
    started = time.perf_counter()
    ingestor.run(BENCH_JOB_ID, setup.input_path, threading.Event())
    elapsed = time.perf_counter() - started
    progress = jobs.progress(BENCH_JOB_ID)
    if progress.state is JobState.FAILED or progress.accepted != setup.n:
        raise SystemExit(f"ingestion did not accept all prompts: {progress}")
    return elapsed


def line(label: str, times: list[float], n: int, baseline_s: float | None = None) -> str:
    """The best time, its rate, the slowest try, and the ratio against the baseline's best time."""
    seconds = min(times)
    ratio = "" if baseline_s is None else f"  {baseline_s / seconds:5.2f}x baseline"
    return f"  {label:<52} {seconds:6.3f} s {n / seconds:7.0f} prompts/s  (worst {max(times):6.3f} s){ratio}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=DEFAULT_N, help="prompts (default %(default)s)")
    parser.add_argument("--repeat", type=int, default=DEFAULT_REPEAT, help="tries per variant, best kept")
    parser.add_argument("--chunk", type=int, default=DEFAULT_ENQUEUE_CHUNK, help="Ingestor chunk size")
    args = parser.parse_args()
    offline_hub()

    spec = job_spec()
    renderer = renderer_for(spec)  # loads the tokenizer once (over a second), outside every timing
    options = IngestOptions(
        chunk=args.chunk,
        enqueue=EnqueueOptions(
            result_ttl_s=DEFAULT_RESULT_TTL_S, failure_ttl_s=DEFAULT_FAILURE_TTL_S, max_worker_losses=3
        ),
    )
    with tempfile.TemporaryDirectory(prefix="bench-ingest-") as tmp, LocalRedis() as server:
        input_path = Path(tmp) / "prompts.jsonl"
        write_jsonl(input_path, short_rows(args.n))
        client = redis.Redis.from_url(server.url)
        try:
            setup = Setup(client, Keys(BENCH_NAMESPACE), spec, Storage(tmp), options, input_path, args.n)
            prompts = read_prompts(input_path, spec)
            render_times = [render_all(renderer, prompts)[0] for _ in range(args.repeat)]
            _, ids = render_all(renderer, prompts)
            payloads = [
                PromptPayload(
                    job=BENCH_JOB_ID,
                    sample_id=p.sample_id,
                    turn=p.turn,
                    gen=0,
                    cls=spec.classify(len(i), p.cls),
                    prompt_ids=i,
                    max_new_tokens=spec.max_new_tokens(CLS),
                    partition=p.partition,
                )
                for p, i in zip(prompts, ids, strict=True)
            ]
            base = timed_tries(args.repeat, setup, "baseline", lambda: baseline_enqueue(setup, payloads))
            ours = timed_tries(args.repeat, setup, "ours", lambda: ours_ingest(setup))
            client.flushall()
        finally:
            client.close()

    mean_tokens = sum(len(i) for i in ids) / len(ids)
    print(
        f"bench_ingest: N={args.n} prompts (mean {mean_tokens:.1f} prompt tokens), "
        f"best of {args.repeat}, chunk {args.chunk}, private Redis on loopback"
    )
    base_s, ours_s, render_s = min(base), min(ours), min(render_times)
    print(line("baseline: Queue.enqueue() per prompt (pre-rendered)", base, args.n))
    print(line("ours: Ingestor.run (parse+render+guard+landing)", ours, args.n, base_s))
    print(line("rendering alone: PromptRenderer.render", render_times, args.n))
    if ours_s > render_s:
        minus = [t - render_s for t in ours]
        print(line("ours minus rendering (best rendering time)", minus, args.n, base_s))
    print(f"  ratio ours/baseline (prompts/s, best tries): {base_s / ours_s:.2f}x")


if __name__ == "__main__":
    main()
