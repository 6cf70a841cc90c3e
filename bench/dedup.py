"""Ingest rate with evaluation hygiene on (``dedup: near`` plus 10,000 benchmark prompts to keep
out) against both off, in the same run; and the memory the seen rows cost per million rows.

Both variants run ``Ingestor.run`` end to end on the same N distinct prompts of 8-16 random words, each
``--repeat`` times on a flushed private Redis; the best try counts. ``off`` is ``dedup: off`` with no
decontamination; ``on`` is ``dedup: near`` (default threshold) with a JSONL file of 10,000 synthetic
benchmark prompts of 20-60 words (loading that index is timed too). The ratio is on / off rate.

Memory: a ``SeenIndex`` of 1M synthetic kept rows, its array bytes and the process's peak (tracemalloc),
and the Redis bytes of their packed records, for ``exact`` and for ``near``.

Run: ``python bench/dedup.py [--n 5000] [--repeat 3] [--benchmark-prompts 10000]``.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import tracemalloc
from pathlib import Path

import redis
from _common import job_spec, offline_hub, write_jsonl
from _load import ingest

from datagen.control.keys import SEEN_SEGMENTS
from datagen.hygiene.dedup import SeenIndex, near_params, pack_records
from datagen.records.storage import Storage
from datagen.spec import DEFAULT_NEAR_THRESHOLD
from datagen_cli.local.redis_server import LocalRedis

DEFAULT_N = 5000
DEFAULT_REPEAT = 3
DEFAULT_BENCHMARK_PROMPTS = 10_000
MEMORY_ROWS = 1_000_000


def distinct_rows(n: int) -> list[dict[str, object]]:
    """``n`` one-turn rows of 8-16 random words each: no two are near-duplicates (the templated
    rows of bench/_common.py are, so ``near`` would drop most of them)."""
    rng = random.Random(5)
    vocabulary = [f"v{i}" for i in range(20_000)]
    return [
        {
            "id": f"p{i}",
            "messages": [
                {"role": "user", "content": " ".join(rng.choices(vocabulary, k=rng.randint(8, 16)))}
            ],
        }
        for i in range(n)
    ]


def write_benchmark(path: Path, n: int) -> None:
    rng = random.Random(7)
    vocabulary = [f"w{i}" for i in range(20_000)]
    with path.open("w", encoding="utf-8") as fh:
        for i in range(n):
            text = " ".join(rng.choices(vocabulary, k=rng.randint(20, 60)))
            fh.write(json.dumps({"id": f"b{i}", "prompt": text}) + "\n")


def memory(bands: int) -> tuple[int, int, int]:
    """Index array bytes, peak traced bytes while building it, Redis record bytes: for 1M rows."""
    rng = random.Random(3)
    rows = [
        (rng.getrandbits(64) | 1, line, [rng.getrandbits(64) | 1 for _ in range(bands)] if bands else None)
        for line in range(1, 10_001)
    ]
    tracemalloc.start()
    index = SeenIndex(bands)
    redis_bytes = 0
    for chunk in range(MEMORY_ROWS // len(rows)):
        shifted = (
            [(d ^ chunk, line, k) for d, line, k in rows]
            if not bands
            else [(d ^ chunk, line, [x ^ chunk for x in k or ()]) for d, line, k in rows]
        )
        index.add(1, shifted)
        redis_bytes += len(pack_records(1, shifted, bands))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return index.nbytes(), peak, redis_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=DEFAULT_N)
    parser.add_argument("--repeat", type=int, default=DEFAULT_REPEAT)
    parser.add_argument("--benchmark-prompts", type=int, default=DEFAULT_BENCHMARK_PROMPTS)
    parser.add_argument("--skip-memory", action="store_true")
    args = parser.parse_args()
    offline_hub()
    with tempfile.TemporaryDirectory(prefix="bench-dedup-") as tmp, LocalRedis() as server:
        source, benchmark = Path(tmp) / "prompts.jsonl", Path(tmp) / "benchmark.jsonl"
        write_jsonl(source, distinct_rows(args.n))
        write_benchmark(benchmark, args.benchmark_prompts)
        off = job_spec(dedup="off")
        on = job_spec(dedup="near", decontaminate=[str(benchmark)])
        client = redis.Redis.from_url(server.url)
        storage = Storage(tmp)
        try:
            ingest(client, storage, off, source, args.n)  # loads the tokenizer once, untimed
            times: dict[str, list[float]] = {"off": [], "on": []}
            for _ in range(args.repeat):  # interleaved, so both see the same machine
                times["off"].append(ingest(client, storage, off, source, args.n))
                times["on"].append(ingest(client, storage, on, source, args.n))
        finally:
            client.close()
    best = {k: min(v) for k, v in times.items()}
    print(
        f"bench/dedup: N={args.n} prompts, {args.benchmark_prompts} benchmark prompts, best of {args.repeat}"
    )
    for name, label in (("off", "dedup off, no decontamination"), ("on", "dedup near + decontamination")):
        print(
            f"  {label:<34} {best[name]:6.3f} s {args.n / best[name]:7.0f} rows/s "
            f"(worst {max(times[name]):.3f} s)"
        )
    print(f"  on / off rate: {best['off'] / best['on']:.2f}x (target >= 0.70x)")
    if args.skip_memory:
        return
    bands = near_params(DEFAULT_NEAR_THRESHOLD).bands
    for mode, b in (("exact", 0), (f"near ({bands} bands)", bands)):
        arrays, peak, redis_bytes = memory(b)
        print(
            f"  per 1M rows, {mode:<16} index arrays {arrays / 1e6:6.1f} MB, "
            f"traced peak {peak / 1e6:6.1f} MB, Redis records {redis_bytes / 1e6:6.1f} MB "
            f"(over {SEEN_SEGMENTS} keys)"
        )


if __name__ == "__main__":
    main()
