"""Fixed-bin length histograms: memory does not grow with the number of records."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["BINS_PER_OCTAVE", "LENGTH_EDGES", "LengthHistogram"]

BINS_PER_OCTAVE = 4
_MAX_OCTAVE = 21  # the last bin starts near 2**21 tokens and is open-ended
# Lower edges of the bins: 0, then 2**(k/4) rounded down, without repeats. Bin i is
# [LENGTH_EDGES[i], LENGTH_EDGES[i + 1]); the last one has no upper edge.
LENGTH_EDGES: tuple[int, ...] = tuple(
    sorted({0, *(int(2 ** (k / BINS_PER_OCTAVE)) for k in range(BINS_PER_OCTAVE * _MAX_OCTAVE))})
)
_EDGES = np.array(LENGTH_EDGES, dtype=np.int64)


@dataclass
class LengthHistogram:
    counts: np.ndarray = field(default_factory=lambda: np.zeros(len(LENGTH_EDGES), dtype=np.int64))
    count: int = 0
    total: int = 0
    minimum: int | None = None
    maximum: int | None = None

    def add(self, lengths: np.ndarray) -> None:
        if not lengths.size:
            return
        lengths = lengths.astype(np.int64, copy=False)
        bins = np.searchsorted(_EDGES, lengths, side="right") - 1
        self.counts += np.bincount(bins, minlength=len(LENGTH_EDGES))
        self.count += int(lengths.size)
        self.total += int(lengths.sum())
        low, high = int(lengths.min()), int(lengths.max())
        self.minimum = low if self.minimum is None else min(self.minimum, low)
        self.maximum = high if self.maximum is None else max(self.maximum, high)

    def merge(self, other: LengthHistogram) -> None:
        """Count ``other``'s lengths here too."""
        if not other.count or other.minimum is None or other.maximum is None:
            return
        self.counts += other.counts
        self.count += other.count
        self.total += other.total
        self.minimum = other.minimum if self.minimum is None else min(self.minimum, other.minimum)
        self.maximum = other.maximum if self.maximum is None else max(self.maximum, other.maximum)

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None

    def quantile(self, q: float) -> int | None:
        """An upper bound: the top of the bin where the cumulative count reaches ``q`` (capped at max)."""
        if not self.count or self.maximum is None:
            return None
        index = int(np.searchsorted(np.cumsum(self.counts), q * self.count, side="left"))
        upper = LENGTH_EDGES[index + 1] - 1 if index + 1 < len(LENGTH_EDGES) else self.maximum
        return min(upper, self.maximum)

    def octaves(self) -> list[tuple[int, int, int]]:
        """(low, high, count) per power-of-two range [2**k, 2**(k+1)), plus [0, 1); empty ends trimmed."""
        rows: dict[tuple[int, int], int] = {}
        for edge, count in zip(LENGTH_EDGES, self.counts.tolist(), strict=True):
            low = 0 if edge == 0 else 1 << (edge.bit_length() - 1)
            high = 0 if edge == 0 else 2 * low - 1
            rows[(low, high)] = rows.get((low, high), 0) + count
        out = [(low, high, count) for (low, high), count in sorted(rows.items())]
        nonzero = [i for i, row in enumerate(out) if row[2]]
        return out[nonzero[0] : nonzero[-1] + 1] if nonzero else []

    def to_json(self) -> dict[str, Any]:
        nonzero = np.flatnonzero(self.counts)
        return {
            "count": self.count,
            "total_tokens": self.total,
            "min": self.minimum,
            "max": self.maximum,
            "mean": None if self.mean is None else round(self.mean, 1),
            "p50_at_most": self.quantile(0.5),
            "p90_at_most": self.quantile(0.9),
            "p99_at_most": self.quantile(0.99),
            "bins": [{"from": LENGTH_EDGES[i], "count": int(self.counts[i])} for i in nonzero],
        }
