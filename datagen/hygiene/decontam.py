"""Benchmark decontamination: reject rows whose user turns share a long n-gram with a benchmark prompt.

As in the GPT-3 and Llama 2 reports: texts are normalized to words
(:func:`datagen.hygiene.dedup.normalize_words`: NFKC, case-folded, punctuation and symbols removed) and
a row is contaminated when any user turn holds any ``n``-word sequence (default 13) of any benchmark
prompt. A benchmark prompt shorter than ``n`` words matches when the whole of it appears in a user turn;
one shorter than ``MIN_ITEM_WORDS`` is left out (it would match ordinary phrases).

The sets are checked and read by `datagen.hygiene.benchmark_sets`. :func:`index_of` parses checked
sets once per content and process (:data:`INDEX_CACHE`), for the submit that checks them, the
ingestion and every dry run.

Word hashes come from Python's ``hash`` (one process builds the index and checks the rows); n-gram
hashes are a polynomial over them, computed with numpy for a whole turn at once.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from datagen.hygiene.benchmark_sets import MIB, BenchmarkSet, set_prompts
from datagen.hygiene.dedup import normalize_words
from datagen.spec import DEFAULT_NGRAM, MIN_ITEM_WORDS

__all__ = [
    "INDEX_CACHE",
    "BenchmarkIndex",
    "Contamination",
    "index_of",
]

# Benchmark text kept per item for examples in the dry run.
EXAMPLE_CHARS = 200
# Parsed indexes kept per process (`_IndexCache`), and the bytes of their arrays (see bench/README.md
# for what a set's prompts take as an index); the newest stays whatever its size.
INDEX_CACHE_SIZE = 4
INDEX_CACHE_BYTES = 1024 * MIB
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


class _IndexCache:
    """Indexes of checked sets, by ``n`` and each set's location and sha256: at most ``size`` and
    ``max_bytes`` of arrays, least recently used out first, shared by every ingestion and dry run
    of the process.

    Each key is parsed once while its other callers wait; parses run one at a time, which also
    bounds the memory they take together. Failures are not cached. ``builds`` counts parses.
    """

    def __init__(self, size: int, max_bytes: int) -> None:
        self._size = size
        self._max_bytes = max_bytes
        self._entries: OrderedDict[_IndexKey, BenchmarkIndex] = OrderedDict()
        self._entries_lock = threading.Lock()
        self._build_lock = threading.Lock()
        self.builds = 0

    def _hit(self, key: _IndexKey) -> BenchmarkIndex | None:
        with self._entries_lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
            return found

    def get(self, sets: list[BenchmarkSet], n: int) -> BenchmarkIndex:
        key = (n, tuple((s.where.location, s.sha256) for s in sets))
        found = self._hit(key)
        if found is not None:
            return found
        with self._build_lock:
            found = self._hit(key)  # parsed while this caller waited
            if found is not None:
                return found
            index = BenchmarkIndex(n=n).build(set_prompts(sets))
            self.builds += 1
            with self._entries_lock:
                self._entries[key] = index
                while len(self._entries) > 1 and (
                    len(self._entries) > self._size
                    or sum(i.nbytes() for i in self._entries.values()) > self._max_bytes
                ):
                    self._entries.popitem(last=False)
            return index


_IndexKey = tuple[int, tuple[tuple[str, str], ...]]
INDEX_CACHE = _IndexCache(INDEX_CACHE_SIZE, INDEX_CACHE_BYTES)


def index_of(sets: list[BenchmarkSet], n: int = DEFAULT_NGRAM) -> BenchmarkIndex:
    """The index of checked sets, parsed once per content (`_IndexCache`); do not change it."""
    return INDEX_CACHE.get(sets, n)
