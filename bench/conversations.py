"""Multi-turn ``all`` with tools, from a cold worker, several times: does every conversation come out
whole, token-exact and on-policy? (issue 21's acceptance run)

Each run ingests N tool-calling conversations (system prompts, a ``tools`` schema, tool results
between assistant turns, trailing assistant turns, rows without tools) as the coordinator does,
then starts a **new** ``datagen worker --burst`` process at concurrency N against a simulator
process that writes DeepSeek-V3 tool calls, and checks the job against an independent oracle
(`tests.support.conversations`: transformers' own rendering, the simulator's pure model and
parser): the same (sample, turn) set, each once, the same prompt and output ids, the same stops.

Not a speed benchmark: it prints wall time per run beside the counts, and the run's baseline is
the same job with ``tool_call_parser`` unset, the dataset's calls kept (the rule before issue 21).

    python bench/conversations.py [--n 48] [--runs 5] [--time-scale 0.02]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for tests.*

from _common import job_spec, offline_hub, simulator_process
from transformers import AutoTokenizer

from datagen.control.enqueue import EnqueueOptions
from datagen.control.jobs import JobStore
from datagen.control.keys import Keys
from datagen.prompts.tokenization import bundled_tokenizer_path, default_chat_template_path
from datagen.records.storage import Storage
from datagen.settings import ENV_PREFIX
from datagen_cli.local.redis_server import LocalRedis
from service.ingest import IngestOptions, Ingestor
from tests.support.conversations import expected_conversation, tool_rows

NAMESPACE = "convbench"
SEED = 21
MAX_NEW_TOKENS = 4000
WORKER_TIMEOUT_S = 900


def _ingest(
    redis_url: str, storage: Storage, job_id: str, rows: list[dict[str, Any]], parser: str | None
) -> None:
    import json

    import redis

    spec = job_spec(
        multi_turn="all",
        tool_call_parser=parser,
        short_max_new_tokens=MAX_NEW_TOKENS,
        long_threshold_tokens=100_000,
        sampling={"sampling_seed": SEED},
    )
    client = redis.Redis.from_url(redis_url)
    try:
        jobs = JobStore(client, Keys(NAMESPACE))
        jobs.create(job_id, spec)
        name = storage.write_input(job_id, ["".join(json.dumps(r) + "\n" for r in rows).encode()])
        options = IngestOptions(
            chunk=64, enqueue=EnqueueOptions(result_ttl_s=600, failure_ttl_s=600, max_worker_losses=3)
        )
        Ingestor(client, Keys(NAMESPACE), jobs, storage, options).run(job_id, name, threading.Event())
    finally:
        client.close()


def _worker(redis_url: str, storage: Storage, sim_url: str, n: int) -> tuple[float, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    env.update(
        DATAGEN_REDIS_URL=redis_url,
        DATAGEN_STORAGE=str(storage.root),
        DATAGEN_NAMESPACE=NAMESPACE,
        DATAGEN_METRICS_PORT="0",
        HF_HUB_OFFLINE="1",
    )
    command = [sys.executable, "-m", "datagen_cli", "worker", "--burst", "--server", f"s0={sim_url}"]
    command += ["--short-concurrency", str(n)]
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S)
    if done.returncode != 0:
        raise SystemExit(f"worker exited {done.returncode}:\n{done.stderr[-3000:]}")
    return time.perf_counter() - started, done.stdout + done.stderr


def _check(redis_url: str, storage: Storage, job_id: str, expected: dict[str, Any]) -> dict[str, Any]:
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        progress = JobStore(client, Keys(NAMESPACE)).progress(job_id)
    finally:
        client.close()
    keys = Counter(
        (r["sample_id"], r["turn"]) for b in storage.iter_record_batches(job_id) for r in b.to_pylist()
    )
    records = {
        (r["sample_id"], r["turn"]): r for b in storage.iter_record_batches(job_id) for r in b.to_pylist()
    }
    want = {(sid, k): t for sid, conv in expected.items() for k, t in enumerate(conv.turns)}
    wrong = [
        key
        for key, turn in want.items()
        if key not in records
        or records[key]["input_ids"] != turn.prompt_ids + turn.output_ids
        or records[key]["prompt_len"] != len(turn.prompt_ids)
    ]
    stops = {s["sample_id"]: s["reason"] for s in storage.iter_stopped(job_id)}
    return {
        "failed": progress.failed,
        "done": progress.done,
        "records": sum(keys.values()),
        "expected_turns": len(want),
        "repeated": sum(1 for c in keys.values() if c > 1),
        "missing_or_wrong": len(wrong) + len(set(records) - set(want)),
        "stops_agree": stops == {sid: c.stop for sid, c in expected.items() if c.stop},
        "stops": dict(Counter(stops.values())),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=48, help="conversations per run (and worker concurrency)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--time-scale", type=float, default=0.02)
    args = parser.parse_args()
    offline_hub()
    rows = tool_rows(args.n)
    tokenizer = AutoTokenizer.from_pretrained(bundled_tokenizer_path())
    template = default_chat_template_path().read_text()

    def oracle(parse_calls: bool) -> dict[str, Any]:
        return {
            r["id"]: expected_conversation(
                r,
                tokenizer,
                template,
                seed=SEED,
                max_new_tokens=MAX_NEW_TOKENS,
                tool_call_format="deepseekv3",
                parse_calls=parse_calls,
            )
            for r in rows
        }

    with (
        tempfile.TemporaryDirectory() as tmp,
        LocalRedis() as server,
        simulator_process(time_scale=args.time_scale, tool_call_format="deepseekv3") as sim_url,
    ):
        storage = Storage(Path(tmp) / "data")
        storage.claim_namespace(NAMESPACE)
        expected = oracle(True)
        print(f"{args.n} conversations, {sum(len(c.turns) for c in expected.values())} expected turns")
        failures = 0
        for run in range(args.runs):
            job_id = f"run{run}"
            _ingest(server.url, storage, job_id, rows, "deepseekv3")
            wall_s, log = _worker(server.url, storage, sim_url, args.n)
            result = _check(server.url, storage, job_id, expected)
            retried = log.count("building turn")
            ok = (
                result["failed"] == 0
                and result["repeated"] == 0
                and result["missing_or_wrong"] == 0
                and result["stops_agree"]
                and result["done"] == result["records"]
            )
            failures += not ok
            verdict = "ok " if ok else "BAD"
            print(f"run {run + 1}: {verdict} cold worker {wall_s:.1f} s, {result}, retried {retried}")
        # Baseline: the rule without a parser (the dataset's calls kept beside the model's text).
        _ingest(server.url, storage, "baseline", rows, None)
        wall_s, _ = _worker(server.url, storage, sim_url, args.n)
        baseline = _check(server.url, storage, "baseline", oracle(False))
        later = {(sid, k): t for sid, c in expected.items() for k, t in enumerate(c.turns) if k}
        off_policy = sum(
            1
            for sid, c in oracle(False).items()
            for k, t in enumerate(c.turns)
            if k and ((sid, k) not in later or later[(sid, k)].prompt_ids != t.prompt_ids)
        )
        later_turns = sum(len(c.turns) - 1 for c in oracle(False).values())
        print(f"baseline (no tool_call_parser): cold worker {wall_s:.1f} s, {baseline}")
        print(
            f"baseline: {off_policy} of {later_turns} later turns have another history than the on-policy one"
        )
    print(f"{args.runs - failures} of {args.runs} runs whole, token-exact and on-policy")
    raise SystemExit(1 if failures else 0)


if __name__ == "__main__":
    main()
