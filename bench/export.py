"""Export throughput and peak memory on a synthetic job, against reading the shards alone.

A job of N records is synthesized in a temporary storage directory the way workers leave one
(``Storage.commit_shard`` of ``records_to_table`` shards of 1,000 records, a manifest naming the
bundled DeepSeek tokenizer and the R1 template, an uploaded input file): prompts of about 500 tokens
(normal, sd 150, ending with the generation prompt), outputs lognormal with a median of 700 tokens
and a mean of about 1,000 (reasoning, ``</think>``, answer, EOS), cut at 8,192 tokens with finish
``length`` (about 1 %). Token ids are random, so decoded text is gibberish of a realistic size.

Each line runs in its own child process, so its peak RSS (``ru_maxrss``) is its own:

``baseline``
    ``pyarrow.parquet.ParquetFile.iter_batches`` over every committed shard, reading the columns
    the exports read: decoding the Parquet is the floor for any export.
``specforge`` / ``speculators`` / ``conversations`` / ``parquet``
    ``datagen.export.export_job`` with default options, output on the same disk.
``… --shuffle-seed``
    the same with the bucket shuffle (``--shuffle``).
``report``
    ``datagen.report.build_report`` (``--report``): the scan and checks, no files; the synthetic job
    must pass every check.

Columns: wall time, records/s, output MB/s, time ratio to the baseline (how many baselines an
export costs), peak RSS, and peak RSS above the baseline's. It also measures the bytes per key of
the dedupe set and per prompt of the conversations input index with tracemalloc.

Run: ``python bench/export.py [--n 100000] [--formats specforge,parquet] [--shuffle] [--report]``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np

from datagen.prompts.tokenization import bundled_tokenizer_path, default_chat_template_path, get_renderer
from datagen.records.schema import Record, records_to_table
from datagen.records.storage import Storage
from datagen.spec import JobSpec

DEFAULT_N = 100_000
SHARD_RECORDS = 1000
JOB_ID = "bench"
SEED = 1
PROMPT_MEAN, PROMPT_SD, PROMPT_MIN = 500, 150, 16
OUTPUT_MEDIAN, OUTPUT_SIGMA, MAX_NEW_TOKENS = 700, 0.85, 8192
ANSWER_FRACTION = 0.2
VOCAB_LOW, VOCAB_HIGH = 100, 100_000
EOS, THINK_END = 1, 128822
GENERATION_PROMPT = [128804, 128821, 201]
FORMATS = ("specforge", "speculators", "conversations", "parquet")
MB = 1_000_000


def _record(i: int, prompt: np.ndarray, output: np.ndarray, finish: str) -> Record:
    return Record(
        job_id=JOB_ID,
        sample_id=f"s{i}",
        turn=0,
        gen=0,
        partition=("math", "code", "chat")[i % 3],
        cls="short",
        input_ids=np.concatenate([prompt, output]).tolist(),
        prompt_len=len(prompt),
        finish_type=finish,
        finish_matched=str(EOS) if finish == "stop" else None,
        finish_length=MAX_NEW_TOKENS if finish == "length" else None,
        max_new_tokens=MAX_NEW_TOKENS,
        server="sim",
        tokenizer="bench",
        sampling_params=json.dumps({"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0.6}, sort_keys=True),
        rid=f"r{i}",
        worker="w",
        attempts=1,
        cached_tokens=0,
        num_retractions=0,
        e2e_latency_s=1.0,
        enqueued_at_ms=0,
        started_at_ms=0,
        finished_at_ms=0,
    )


def _sample(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, str]:
    prompt_len = max(PROMPT_MIN, int(rng.normal(PROMPT_MEAN, PROMPT_SD)))
    prompt = np.concatenate([rng.integers(VOCAB_LOW, VOCAB_HIGH, prompt_len - 3), GENERATION_PROMPT])
    wanted = max(4, int(rng.lognormal(np.log(OUTPUT_MEDIAN), OUTPUT_SIGMA)))
    answer = max(1, int(wanted * ANSWER_FRACTION))
    reasoning = wanted - answer - 2
    output = np.concatenate(
        [
            rng.integers(VOCAB_LOW, VOCAB_HIGH, reasoning),
            [THINK_END],
            rng.integers(VOCAB_LOW, VOCAB_HIGH, answer),
            [EOS],
        ]
    )
    if len(output) > MAX_NEW_TOKENS:
        return prompt, output[:MAX_NEW_TOKENS], "length"
    return prompt, output, "stop"


def synthesize(root: Path, n: int) -> dict[str, Any]:
    storage = Storage(root)
    spec = JobSpec(tokenizer=bundled_tokenizer_path(), chat_template=str(default_chat_template_path()))
    identity = get_renderer(spec.tokenizer, spec.chat_template, False, "{}").identity()
    manifest = {
        "job_id": JOB_ID,
        "spec": json.loads(spec.model_dump_json()),
        "tokenizer": identity,
        "servers": {},
    }
    storage.write_manifest(JOB_ID, manifest)
    rows = (
        json.dumps({"id": f"s{i}", "messages": [{"role": "user", "content": f"Question {i}?"}]}) + "\n"
        for i in range(n)
    )
    storage.write_input(JOB_ID, (row.encode("utf-8") for row in rows))
    rng = np.random.default_rng(SEED)
    tokens = truncated = 0
    for start in range(0, n, SHARD_RECORDS):
        records = []
        for i in range(start, min(n, start + SHARD_RECORDS)):
            prompt, output, finish = _sample(rng)
            records.append(_record(i, prompt, output, finish))
            tokens += len(prompt) + len(output)
            truncated += finish == "length"
        storage.commit_shard(
            JOB_ID, f"w-{start // SHARD_RECORDS:08d}", records_to_table(records), {"worker": "w"}
        )
    shard_bytes = sum(p.stat().st_size for p in Path(storage.url(JOB_ID, "records")).glob("*.parquet"))
    return {"records": n, "tokens": tokens, "truncated": truncated, "shard_mb": shard_bytes / MB}


# -- child processes ----------------------------------------------------------------------------------


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def child(name: str, root: Path, out: Path, shuffle_seed: int | None) -> None:
    from datagen.export import ExportFormat, ExportOptions, export_job

    storage = Storage(root)
    started = time.perf_counter()
    if name == "baseline":
        from datagen.export.rows import ROW_COLUMNS
        from datagen.records.reader import iter_committed_batches

        nbytes = sum(b.nbytes for b in iter_committed_batches(storage, JOB_ID, ROW_COLUMNS))
        written, out_bytes = 0, 0
        assert nbytes
    elif name == "report":
        from datagen.report import build_report

        report = build_report(storage, JOB_ID)
        assert not report.failed, [c.to_json() for c in report.checks.values()]
        written, out_bytes = report.unique, 0
    else:
        options = ExportOptions(shuffle_seed=shuffle_seed)
        stats = export_job(storage, JOB_ID, ExportFormat(name), out, options)
        written, out_bytes = stats.written, _size(out)
    wall_s = time.perf_counter() - started
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MB  # Linux: KiB
    print(json.dumps({"wall_s": wall_s, "written": written, "out_bytes": out_bytes, "peak_rss_mb": peak_mb}))


def run_child(name: str, root: Path, out: Path, shuffle_seed: int | None) -> dict[str, Any]:
    args = [sys.executable, __file__, "--child", name, "--root", str(root), "--out", str(out)]
    if shuffle_seed is not None:
        args += ["--shuffle-seed", str(shuffle_seed)]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    done = subprocess.run(args, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


# -- per-record memory of the two growing structures ----------------------------------------------------


def memory_per_entry(root: Path) -> dict[str, float]:
    from datagen.export.conversations import InputIndex
    from datagen.records.reader import SeenKeys
    from datagen.states import MultiTurnMode

    storage = Storage(root)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    seen = SeenKeys()
    for i in range(100_000):
        seen.first(f"s{i}", 0, 0)
    dedupe = (tracemalloc.get_traced_memory()[0] - before) / len(seen)
    del seen
    before = tracemalloc.get_traced_memory()[0]
    index = InputIndex(storage, JOB_ID, MultiTurnMode.LAST)
    per_prompt = (tracemalloc.get_traced_memory()[0] - before) / max(1, len(index))
    index.close()
    tracemalloc.stop()
    return {"dedupe_bytes_per_key": dedupe, "input_index_bytes_per_prompt": per_prompt}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=DEFAULT_N)
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--shuffle", action="store_true", help="also time each format with --shuffle-seed")
    parser.add_argument("--report", action="store_true", help="also time `datagen report` (no files)")
    parser.add_argument("--child")
    parser.add_argument("--root", type=Path)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--shuffle-seed", type=int)
    args = parser.parse_args()
    os.environ["HF_HUB_OFFLINE"] = "1"
    if args.child:
        child(args.child, args.root, args.out, args.shuffle_seed)
        return
    with tempfile.TemporaryDirectory(prefix="bench-export-") as tmp:
        root = Path(tmp) / "storage"
        started = time.perf_counter()
        job = synthesize(root, args.n)
        print(
            f"synthetic job: {job['records']:,} records, {job['tokens'] / 1e6:.1f} M tokens, "
            f"{job['truncated']:,} truncated, shards {job['shard_mb']:.0f} MB "
            f"(built in {time.perf_counter() - started:.0f} s)"
        )
        runs = [("baseline", None)] + [(f, None) for f in args.formats.split(",")]
        if args.shuffle:
            runs += [(f, SEED) for f in args.formats.split(",")]
        if args.report:
            runs.append(("report", None))
        results = {}
        print(
            f"{'line':<28}{'wall s':>8}{'records/s':>11}{'out MB/s':>10}{'vs base':>9}"
            f"{'peak MB':>9}{'+base MB':>9}"
        )
        for name, seed in runs:
            out = Path(tmp) / f"out-{name}-{seed}" / "export"
            result = run_child(name, root, out, seed)
            results[(name, seed)] = result
            base = results[("baseline", None)]
            label = name + (" --shuffle-seed" if seed is not None else "")
            records_s = args.n / result["wall_s"]
            mb_s = result["out_bytes"] / MB / result["wall_s"]
            print(
                f"{label:<28}{result['wall_s']:>8.2f}{records_s:>11,.0f}{mb_s:>10,.0f}"
                f"{result['wall_s'] / base['wall_s']:>8.1f}x{result['peak_rss_mb']:>9,.0f}"
                f"{result['peak_rss_mb'] - base['peak_rss_mb']:>9,.0f}"
            )
            shutil.rmtree(out.parent, ignore_errors=True)
        per_entry = memory_per_entry(root)
        print(
            f"dedupe set: {per_entry['dedupe_bytes_per_key']:.0f} bytes a key; "
            f"conversations input index: {per_entry['input_index_bytes_per_prompt']:.0f} bytes a prompt"
        )


if __name__ == "__main__":
    main()
