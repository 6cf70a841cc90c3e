"""The features section of a job's report (a job with ``features``): how many first records have
their hidden states stored, how many bytes per token they take, and why the others have none."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

__all__ = ["FEATURE_REPORT_COLUMNS", "FeatureTally"]

FEATURE_REPORT_COLUMNS = ["features_file", "features_bytes", "features_error"]
# A reason is grouped by its text before the first ':' (the part naming the kind of failure).
_REASON_CHARS = 120


@dataclass
class FeatureTally:
    layers: list[int]
    dtype: str
    examples_kept: int
    stored: int = 0
    missing: int = 0
    bytes: int = 0
    tokens: int = 0
    reasons: Counter[str] = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)

    @property
    def bytes_per_token(self) -> float | None:
        return self.bytes / self.tokens if self.tokens else None

    def add(self, batch: pa.RecordBatch, new: np.ndarray, lengths: np.ndarray, ids: list[str]) -> None:
        """Count the first records (``new``) of a batch; ``lengths`` are their sequences' lengths."""
        files = batch.column("features_file").to_pylist()
        sizes = batch.column("features_bytes").to_pylist()
        errors = batch.column("features_error").to_pylist()
        for i in np.flatnonzero(new):
            if files[i] is not None:
                self.stored += 1
                self.bytes += int(sizes[i] or 0)
                self.tokens += int(lengths[i])
                continue
            self.missing += 1
            reason = str(errors[i] or "no features recorded")
            self.reasons[reason.split(":")[0][:_REASON_CHARS]] += 1
            if len(self.examples) < self.examples_kept:
                self.examples.append(f"{ids[i]}: {reason[:_REASON_CHARS]}")

    def summary(self) -> str:
        per_token = self.bytes_per_token
        return (
            f"{self.stored:,} records with features ({self.dtype}, layers {self.layers}), "
            f"{self.bytes:,} bytes"
            + (f", {per_token:,.0f} bytes a token" if per_token is not None else "")
            + f"; {self.missing:,} without"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "layers": self.layers,
            "dtype": self.dtype,
            "stored": self.stored,
            "missing": self.missing,
            "bytes": self.bytes,
            "tokens": self.tokens,
            "bytes_per_token": self.bytes_per_token,
            "reasons": dict(self.reasons.most_common()),
            "examples": self.examples,
        }
