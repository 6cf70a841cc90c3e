"""What storing one hidden-states capture costs a worker: ``check_and_store`` to bf16 and to FP8,
against what a bare speculators-style client does with the same file, in the same run.

A synthetic capture file like vLLM's (``token_ids`` I64 ``[T]``, then ``hidden_states`` BF16
``[T, L, H]``, normal values) is written once, by default 2,048 tokens x 4 layers x 4096 hidden
(64 MiB), and read once so it sits in the page cache, as a file the server has just written does.
Each line then runs in a fresh child process (so its peak RSS is its own), ``--repeat`` times, the
best try counting; every try writes a new copy next to the source and removes it after.

``baseline``
    ``shutil.copyfile`` then ``hashlib.sha256`` over the same bytes: a client that moves the file
    to another file system and hashes it, checking nothing. No fsync.
``baseline + fsync``
    The same plus ``os.fsync`` of the copy, which ours does: the like-for-like line.
``ours bf16``
    ``check_and_store(dtype="bf16")``: header, ids, row count and finiteness checks, the copy
    written, hashed while written, fsynced.
``ours fp8``
    ``check_and_store(dtype="fp8")``: the same checks, quantised to FP8 with per-token scales.

Columns: best wall seconds; GB/s of source (bf16) bytes; rate against ``baseline``; worker CPU
seconds per GB of source (``time.process_time``) and its inverse, GB/s per busy core; peak RSS
growth over the child's RSS after its imports (the kernel's peak, reset before the line; what
``resource.getrusage`` reports where a reset is not allowed). Then two projections: how many H200
capture servers, each writing about 0.9 GB/s of bf16, one worker process keeps up with storing
one file at a time (the wall rate), and per core busy with stores in threads (the CPU rate).
``--chunk-rows A,B,...`` runs the two ``ours`` lines once per chunk size.

Run: ``python bench/capture_path.py [--tokens 2048] [--layers 4] [--hidden 4096] [--repeat 5]
[--chunk-rows 64] [--dir /tmp]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from datagen.features.capture_file import DEFAULT_CHUNK_ROWS, FeatureDtype, check_and_store
from datagen.features.fp8 import FP8_MAX
from datagen.features.safetensors_file import encode_header

DEFAULT_TOKENS = 2048
DEFAULT_LAYERS = 4
DEFAULT_HIDDEN = 4096
DEFAULT_REPEAT = 5
# What one H200 capture server writes: bf16 hidden states at about this rate (the brief's figure).
SERVER_WRITE_GB_S = 0.9
# The synthetic file is generated this many tokens at a time, so making it stays small too.
MAKE_CHUNK_TOKENS = 256
GB = 1e9
KIB = 1024
COPY_CHUNK_BYTES = 1024 * 1024
LINES = ("baseline", "baseline + fsync", "ours bf16", "ours fp8")


@dataclass(frozen=True)
class Result:
    line: str
    chunk_rows: int
    wall_s: float
    cpu_s: float
    rss_growth_bytes: int


def make_capture(path: Path, tokens: int, layers: int, hidden: int) -> None:
    """A file laid out as vLLM's connector writes it, with normal(0, 4) bf16 values."""
    rng = np.random.default_rng(0)
    header, _ = encode_header(
        [("token_ids", "I64", (tokens,)), ("hidden_states", "BF16", (tokens, layers, hidden))]
    )
    with path.open("wb") as fh:
        fh.write(header)
        fh.write(rng.integers(0, 150_000, tokens, dtype=np.int64).astype("<i8").tobytes())
        for start in range(0, tokens, MAKE_CHUNK_TOKENS):
            n = min(MAKE_CHUNK_TOKENS, tokens - start)
            values = rng.standard_normal((n, layers, hidden), dtype=np.float32) * np.float32(4.0)
            # Round to nearest even into bf16: the top half of each float32 plus the rounding bit.
            bits = values.view(np.uint32)
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            fh.write(rounded.astype("<u2").tobytes())


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak RSS of this process to its RSS now (Linux ``clear_refs`` 5), so the
    peak after a line is the line's, not the imports'. False where that is not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _peak_rss_bytes() -> int:
    # The same figure as getrusage's ru_maxrss (KiB), which a reset does not reach once a thread
    # has exited.
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * KIB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * KIB


def _baseline(src: Path, dest: Path, *, fsync: bool) -> None:
    shutil.copyfile(src, dest)
    if fsync:
        fd = os.open(dest, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    digest = hashlib.sha256()
    with src.open("rb") as fh:
        while block := fh.read(COPY_CHUNK_BYTES):
            digest.update(block)


def run_child(args: argparse.Namespace) -> None:
    """One line, ``--repeat`` tries, in this (fresh) process: prints a JSON ``Result``."""
    src = Path(args.src)
    sent = _sent_ids(src, args.tokens)
    start_rss = _rss_bytes()
    reset = _reset_peak_rss()
    best_wall = best_cpu = float("inf")
    for attempt in range(args.repeat):
        dest = src.with_name(f"copy-{attempt}.safetensors")
        wall0, cpu0 = time.perf_counter(), time.process_time()
        if args.line.startswith("baseline"):
            _baseline(src, dest, fsync=args.line == "baseline + fsync")
        else:
            dtype: FeatureDtype = "bf16" if args.line == "ours bf16" else "fp8"
            check_and_store(
                src, dest, sent_ids=sent, layer_count=args.layers, dtype=dtype, chunk_rows=args.one_chunk_rows
            )
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        dest.unlink()
        if wall < best_wall:
            best_wall, best_cpu = wall, cpu
    peak = _peak_rss_bytes() if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * KIB
    print(
        json.dumps(
            Result(args.line, args.one_chunk_rows, best_wall, best_cpu, max(0, peak - start_rss)).__dict__
        )
    )


def _sent_ids(src: Path, tokens: int) -> list[int]:
    with src.open("rb") as fh:
        header_bytes = int.from_bytes(fh.read(8), "little")
        fh.seek(8 + header_bytes)
        return np.frombuffer(fh.read(8 * tokens), dtype="<i8").tolist()


def measure(args: argparse.Namespace, src: Path, line: str, chunk_rows: int) -> Result:
    command = [
        sys.executable,
        __file__,
        "--child",
        line,
        "--src",
        str(src),
        "--one-chunk-rows",
        str(chunk_rows),
    ]
    command += ["--tokens", str(args.tokens), "--layers", str(args.layers), "--repeat", str(args.repeat)]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return Result(**json.loads(out.strip().splitlines()[-1]))


def report(results: list[Result], source_bytes: int) -> None:
    baseline = next(r for r in results if r.line == "baseline")
    print(
        f"{'line':<18} {'chunk':>5} {'wall s':>7} {'GB/s':>6} {'vs base':>7} {'CPU s/GB':>8}"
        f" {'GB/s/core':>9} {'RSS +MiB':>8} {'servers':>7} {'per core':>8}"
    )
    for r in results:
        rate = source_bytes / r.wall_s / GB
        per_core = source_bytes / r.cpu_s / GB if r.cpu_s > 0 else float("inf")
        chunk = str(r.chunk_rows) if r.line.startswith("ours") else "-"
        print(
            f"{r.line:<18} {chunk:>5} {r.wall_s:7.3f} {rate:6.2f} {baseline.wall_s / r.wall_s:6.2f}x"
            f" {r.cpu_s / (source_bytes / GB):8.3f} {per_core:9.2f} {r.rss_growth_bytes / 2**20:8.1f}"
            f" {rate / SERVER_WRITE_GB_S:7.2f} {per_core / SERVER_WRITE_GB_S:8.2f}"
        )
    print(
        f"servers: H200 capture servers writing {SERVER_WRITE_GB_S} GB/s of bf16 each that one worker"
        " process keeps up with storing one file at a time (wall rate, fsync waits included);"
        " per core: the same for each core busy with stores in threads (CPU rate; numpy, hashlib"
        " and file I/O release the GIL), as long as the disk keeps up"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=DEFAULT_TOKENS, help="T (default %(default)s)")
    parser.add_argument("--layers", type=int, default=DEFAULT_LAYERS, help="L (default %(default)s)")
    parser.add_argument("--hidden", type=int, default=DEFAULT_HIDDEN, help="H (default %(default)s)")
    parser.add_argument(
        "--repeat", type=int, default=DEFAULT_REPEAT, help="tries per line (default %(default)s)"
    )
    parser.add_argument(
        "--chunk-rows", default=str(DEFAULT_CHUNK_ROWS), help="comma-separated (default %(default)s)"
    )
    parser.add_argument(
        "--dir", default=None, help="where the files go (default: a temporary folder in /tmp)"
    )
    parser.add_argument("--child", dest="line", choices=LINES, help=argparse.SUPPRESS)
    parser.add_argument("--src", help=argparse.SUPPRESS)
    parser.add_argument("--one-chunk-rows", type=int, default=DEFAULT_CHUNK_ROWS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.line:
        run_child(args)
        return
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        src = Path(tmp) / "cmpl-bench-0-00000000.safetensors"
        make_capture(src, args.tokens, args.layers, args.hidden)
        source_bytes = src.stat().st_size
        hashlib.sha256(src.read_bytes())  # into the page cache, as a file just written is
        print(
            f"capture file: {args.tokens} tokens x {args.layers} layers x {args.hidden} hidden bf16 ="
            f" {source_bytes / 2**20:.1f} MiB; best of {args.repeat}; {os.cpu_count()} CPUs;"
            f" numpy {np.__version__}; FP8 max {FP8_MAX}"
        )
        results = [measure(args, src, line, DEFAULT_CHUNK_ROWS) for line in LINES[:2]]
        for chunk_rows in (int(c) for c in args.chunk_rows.split(",")):
            results += [measure(args, src, line, chunk_rows) for line in LINES[2:]]
        report(results, source_bytes)


if __name__ == "__main__":
    main()
