"""What fair-share dispatch costs per claim, against RQ's own dequeue, in the same run.

One private Redis (``LocalRedis`` on a free loopback port). N prompt ids are spread over K jobs of
alternating weights 3 and 1 (all ``normal`` priority, plus one ``high`` job with a tenth of the
prompts), then claimed one at a time until none is left:

``baseline``
    RQ's claim: ``LMOVE`` of the next id from one queue list into its intermediate list (what
    ``Queue.dequeue_any`` does for a single queue), one round trip per claim.
``ours``
    ``Dispatch.claim_many(cls, 1, ...)``: one script per claim that checks RQ's queue, skips paused
    jobs, picks the highest priority with work, then the job with the lowest virtual time, starts
    the prompt as RQ's worker would (its RQ job hash, the started registry, the job's running set)
    and counts the dispatch: more work per claim than the baseline's ``LMOVE``.
``ours, 16 per claim``
    The same, claiming up to 16 prompts per script call, as a worker with free slots does.

Printed: prompts claimed per second of each (best of ``--repeat``), the ratios, and the share the
weight-3 jobs got of the normal-priority claims while every job still had work (3/4 by design, one
at a time), plus where the high job's claims fell (all of them first by design). Job hashes are
created as the coordinator does (weight, priority), and a small RQ job hash per prompt (not timed).

Run: ``python bench/dispatch.py [--n 20000] [--jobs 1 10 100] [--repeat 3]``.
"""

from __future__ import annotations

import argparse
import json
import time

import redis

from datagen.control.dispatch import Claimant, Dispatch
from datagen.control.jobs import JobStore
from datagen.control.keys import Keys
from datagen.control.rq_format import QueuedJobs
from datagen.prompts.tokenization import bundled_tokenizer_path
from datagen.spec import JobSpec
from datagen.states import Priority, PromptClass
from datagen_cli.local.redis_server import LocalRedis

NS = "bench"
CLS = PromptClass.SHORT
QUEUE, INTERMEDIATE = "rq:queue:bench-short", "rq:queue:bench-short:intermediate"
CLAIMANT = Claimant(QUEUE, "rq:wip:bench-short", "bench-worker", "bench", ttl_s=60)
FILL_SLICE = 5000
BATCH = 16


def _fill_baseline(client: redis.Redis, n: int) -> None:
    for start in range(0, n, FILL_SLICE):
        client.rpush(QUEUE, *[f"p{i}" for i in range(start, min(n, start + FILL_SLICE))])


def _fill_ours(client: redis.Redis, n: int, jobs: int) -> dict[str, float]:
    keys = Keys(NS)
    store, dispatch = JobStore(client, keys), Dispatch(client, keys)
    weights: dict[str, float] = {}
    high = max(1, n // 10)
    plan = [("urgent", high, Priority.HIGH, 1.0)]
    per_job = (n - high) // jobs
    plan += [(f"j{k}", per_job, Priority.NORMAL, 3.0 if k % 2 == 0 else 1.0) for k in range(jobs)]
    for name, count, priority, weight in plan:
        spec = JobSpec(tokenizer=bundled_tokenizer_path(), priority=priority, weight=weight)
        store.create(name, spec)
        weights[name] = weight
        for start in range(0, count, FILL_SLICE):
            with client.pipeline() as pipe:
                ids = [f"{name}-{i}" for i in range(start, min(count, start + FILL_SLICE))]
                jobs = QueuedJobs(json.dumps(["status", "queued"]), tuple((i, name, b"x" * 200) for i in ids))
                dispatch.add(pipe, name, CLS, priority, jobs)
                pipe.execute()
    return weights


def _baseline(client: redis.Redis, n: int) -> float:
    started = time.perf_counter()
    while client.lmove(QUEUE, INTERMEDIATE, "LEFT", "RIGHT") is not None:
        pass
    return n / (time.perf_counter() - started)


def _ours(client: redis.Redis, batch: int) -> tuple[float, list[str]]:
    dispatch = Dispatch(client, Keys(NS))
    order: list[str] = []
    started = time.perf_counter()
    while claimed := dispatch.claim_many(CLS, batch, CLAIMANT):
        order += [c.rq_id.split("-", 1)[0] for c in claimed]
    return len(order) / (time.perf_counter() - started), order


def _shares(order: list[str], weights: dict[str, float]) -> tuple[float, int]:
    """Weight-3 jobs' part of the normal claims while every normal job had work; the index of
    the high job's last claim."""
    last_urgent = max(i for i, job in enumerate(order) if job == "urgent")
    normal = [job for job in order if job != "urgent"]
    remaining = {job: normal.count(job) for job in weights if job != "urgent"}
    both: list[str] = []
    for job in normal:  # until the first job runs dry
        both.append(job)
        remaining[job] -= 1
        if remaining[job] == 0:
            break
    heavy = sum(1 for job in both if weights[job] == 3.0)
    return heavy / max(1, len(both)), last_urgent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20_000)
    parser.add_argument("--jobs", type=int, nargs="+", default=[1, 10, 100])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with LocalRedis() as server:
        client = redis.Redis.from_url(server.url)
        print(f"dispatch: N={args.n} claims, best of {args.repeat}, private Redis on loopback")
        for jobs in args.jobs:
            base, ours, many, share, last_urgent = 0.0, 0.0, 0.0, 0.0, 0
            for _ in range(args.repeat):
                client.flushall()
                _fill_baseline(client, args.n)
                base = max(base, _baseline(client, args.n))
                client.flushall()
                weights = _fill_ours(client, args.n, jobs)
                rate, order = _ours(client, 1)
                if rate > ours:
                    ours = rate
                    share, last_urgent = _shares(order, weights)
                    high = sum(1 for job in order if job == "urgent")
                client.flushall()
                _fill_ours(client, args.n, jobs)
                many = max(many, _ours(client, BATCH)[0])
            fair = (
                f"weight-3 jobs got {share:.3f} of normal claims (target 0.75)"
                if jobs > 1
                else "one normal job"
            )
            print(
                f"  {jobs:>3} jobs + 1 high: baseline LMOVE {base:8.0f} claims/s, ours {ours:8.0f} prompts/s "
                f"= {ours / base:4.2f}x, {BATCH} per claim {many:8.0f} prompts/s = {many / base:4.2f}x; "
                f"{fair}; the high job's {high} claims came first: {last_urgent + 1 == high}"
            )
        client.close()


if __name__ == "__main__":
    main()
