"""What a recipe costs ingestion: prompts/s of `service.ingest.Ingestor.run` with arms, against the
same job without a recipe, measured in the same run on one private Redis.

Lines printed (best of ``--repeat`` tries, each on a flushed Redis; the worst in brackets):

``baseline, samples 1`` / ``weighted 3 arms, samples 1``
    each row renders once: under the job's kwargs, or under the one arm its sample draws. The
    ratio is the cost of drawing the arm and of three renderers instead of one (their caches
    warm per arm).
``baseline, samples 3`` / ``cycle 3 arms, samples 3``
    three payloads per row: rendered once without a recipe, once per arm (three times) with one,
    as each sample's prompt differs. This is the recipe's real price where samples meet arms.

The ratio column is the variant's prompts/s over its baseline's, so 1.00x means free. Rates are
lower bounds on a 2-core machine that also runs Redis; compare ratios.

Run: ``python bench/recipes.py [--n 3000] [--repeat 3]``.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import redis
from _common import job_spec, offline_hub, short_rows, write_jsonl
from _load import ingest

from datagen.records.storage import Storage
from datagen.settings import DEFAULT_ENQUEUE_CHUNK
from datagen_cli.local.redis_server import LocalRedis
from service.admit import arm_renderers

DEFAULT_N = 3000
DEFAULT_REPEAT = 3
EFFORT_ARMS: list[dict[str, Any]] = [
    {"name": effort, "chat_template_kwargs": {"reasoning_effort": effort}}
    for effort in ("low", "medium", "high")
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=DEFAULT_N, help="rows (default %(default)s)")
    parser.add_argument("--repeat", type=int, default=DEFAULT_REPEAT, help="tries per variant, best kept")
    args = parser.parse_args()
    offline_hub()
    variants = [
        ("baseline, samples 1", job_spec(), 1, None),
        ("weighted 3 arms, samples 1", job_spec(recipe={"arms": EFFORT_ARMS}), 1, 0),
        ("baseline, samples 3", job_spec(samples=3), 3, None),
        (
            "cycle 3 arms, samples 3",
            job_spec(samples=3, recipe={"assign": "cycle", "arms": EFFORT_ARMS}),
            3,
            2,
        ),
    ]
    for _, spec, _, _ in variants:  # every renderer loaded outside the timings
        renderers = arm_renderers(spec)
        for arm in spec.recipe.arms if spec.recipe else []:
            renderers(arm)
    with tempfile.TemporaryDirectory(prefix="bench-recipes-") as tmp, LocalRedis() as server:
        path = Path(tmp) / "rows.jsonl"
        write_jsonl(path, short_rows(args.n))
        client = redis.Redis.from_url(server.url)
        storage = Storage(tmp)
        try:
            times = {
                label: [ingest(client, storage, spec, path, args.n * samples) for _ in range(args.repeat)]
                for label, spec, samples, _ in variants
            }
        finally:
            client.close()
    print(
        f"bench/recipes: {args.n} rows, best of {args.repeat}, chunk {DEFAULT_ENQUEUE_CHUNK}, private Redis"
    )
    for label, _, samples, baseline in variants:
        best = min(times[label])
        rate = args.n * samples / best
        ratio = ""
        if baseline is not None:
            base_rate = args.n * variants[baseline][2] / min(times[variants[baseline][0]])
            ratio = f"  {rate / base_rate:5.2f}x {variants[baseline][0]}"
        worst = max(times[label])
        print(f"  {label:<30} {best:6.3f} s {rate:7.0f} prompts/s  (worst {worst:6.3f} s){ratio}")


if __name__ == "__main__":
    main()
