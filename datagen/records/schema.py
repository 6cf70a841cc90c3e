"""The record format: one row per generated sample, stored in Parquet shards.

A record holds the exact sequence the model saw and produced, ``input_ids = prompt_ids +
output_ids``; the loss mask is derived (0 over the first ``prompt_len`` ids, 1 after), so it is
not stored twice. ``schema_version`` changes whenever a column changes meaning or is added.

Versions: 1, the first; 2 adds ``next_turn`` (multi-turn ``all`` mode: what follows the turn,
written with its commit, `datagen.control.turns`); 3 adds the ``features_*`` columns (a job with
hidden-state features: the stored file of this record's features, its size and sha256, or why it
has none); 4 adds ``arm`` and ``chat_template_kwargs`` (the recipe's arm that made the record, and
the template variables its prompt was rendered with). Readers select the columns they use, so
shards of every version read alike; a version-1 shard has no ``next_turn`` (`has_next_turn`), one
before version 4 no ``arm`` (`has_arms`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import pyarrow as pa

__all__ = [
    "ARM",
    "FEATURES_FILE",
    "FEATURE_COLUMNS",
    "GIVEN_FINISH",
    "NEXT_TURN",
    "RECORD_SCHEMA",
    "SCHEMA_VERSION",
    "TEMPLATE_KWARGS",
    "Record",
    "has_arms",
    "has_features",
    "has_next_turn",
    "loss_mask",
    "loss_mask_values",
    "records_to_table",
]

SCHEMA_VERSION = 4
# The column a version-2 record adds.
NEXT_TURN = "next_turn"
# The ``finish_type`` of a capture-only job's record: its sequence came with its row, nothing was
# generated (an engine's finish types are `datagen.states.FinishType`).
GIVEN_FINISH = "given"
# The columns a version-3 record adds (all null in a job without features).
FEATURES_FILE = "features_file"
FEATURE_COLUMNS = (FEATURES_FILE, "features_bytes", "features_sha256", "features_error")
# The columns a version-4 record adds: the arm's name (null in a job without a recipe) and the
# template variables as canonical JSON (`datagen.spec.canonical_kwargs_json`).
ARM = "arm"
TEMPLATE_KWARGS = "chat_template_kwargs"

RECORD_SCHEMA = pa.schema(
    [
        pa.field("schema_version", pa.int16(), nullable=False),
        pa.field("job_id", pa.string(), nullable=False),
        pa.field("sample_id", pa.string(), nullable=False),
        pa.field("turn", pa.int32(), nullable=False),
        pa.field("gen", pa.int32(), nullable=False),
        pa.field("partition", pa.string(), nullable=False),
        pa.field("class", pa.string(), nullable=False),
        pa.field("input_ids", pa.list_(pa.uint32()), nullable=False),
        pa.field("prompt_len", pa.int32(), nullable=False),
        pa.field("output_len", pa.int32(), nullable=False),
        pa.field("finish_type", pa.string(), nullable=False),
        pa.field("finish_matched", pa.string()),
        pa.field("finish_length", pa.int32()),
        pa.field("max_new_tokens", pa.int32(), nullable=False),
        pa.field("server", pa.string(), nullable=False),
        pa.field("tokenizer", pa.string(), nullable=False),
        pa.field("sampling_params", pa.string(), nullable=False),
        pa.field("rid", pa.string(), nullable=False),
        pa.field("worker", pa.string(), nullable=False),
        pa.field("attempts", pa.int16(), nullable=False),
        pa.field("cached_tokens", pa.int32(), nullable=False),
        pa.field("num_retractions", pa.int32(), nullable=False),
        pa.field("e2e_latency_s", pa.float64()),
        pa.field("enqueued_at_ms", pa.int64()),
        pa.field("started_at_ms", pa.int64(), nullable=False),
        pa.field("finished_at_ms", pa.int64(), nullable=False),
        pa.field(NEXT_TURN, pa.string()),
        # The record's features: the file's name in the job's features folder (`datagen.records.
        # features`), its size and sha256 as stored; or, where capture gave up on this record, why.
        pa.field(FEATURES_FILE, pa.string()),
        pa.field("features_bytes", pa.int64()),
        pa.field("features_sha256", pa.string()),
        pa.field("features_error", pa.string()),
        # The recipe's arm that made the record, and the template variables its prompt ids were
        # rendered with (the arm's over the job's); its sampling is ``sampling_params``.
        pa.field(ARM, pa.string()),
        pa.field(TEMPLATE_KWARGS, pa.string()),
    ]
)


@dataclass(frozen=True)
class Record:
    job_id: str
    sample_id: str
    turn: int
    gen: int
    partition: str
    cls: str
    input_ids: list[int]
    prompt_len: int
    finish_type: str
    finish_matched: str | None
    finish_length: int | None
    max_new_tokens: int
    server: str
    tokenizer: str
    sampling_params: str
    rid: str
    worker: str
    attempts: int
    cached_tokens: int
    num_retractions: int
    e2e_latency_s: float | None
    enqueued_at_ms: int | None
    started_at_ms: int
    finished_at_ms: int
    # Multi-turn ``all`` mode: what follows this turn, as JSON (`datagen.control.turns`); None after
    # a conversation's last turn and in every other mode.
    next_turn: str | None = None
    # A job with features: the stored file of this record's hidden states (`FEATURE_COLUMNS`), or
    # ``features_error`` where it has none (too long for every capture server, every try failed).
    features_file: str | None = None
    features_bytes: int | None = None
    features_sha256: str | None = None
    features_error: str | None = None
    # A job with a recipe: the arm's name. Every generated record: its template variables as JSON.
    arm: str | None = None
    chat_template_kwargs: str | None = None

    @property
    def output_len(self) -> int:
        return len(self.input_ids) - self.prompt_len

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.sample_id, self.turn, self.gen)


_FIELDS = tuple(f.name for f in fields(Record))


def has_features(schema: pa.Schema) -> bool:
    """Whether a shard of this schema can name feature files (version 3 on)."""
    return FEATURES_FILE in schema.names


def has_arms(schema: pa.Schema) -> bool:
    """Whether a shard of this schema records each record's arm and template variables (version 4 on)."""
    return ARM in schema.names


def has_next_turn(schema: pa.Schema) -> bool:
    """Whether a shard of this schema records what follows each turn (version 2 on)."""
    return NEXT_TURN in schema.names


def loss_mask_values(offsets: np.ndarray, prompt_lens: np.ndarray) -> np.ndarray:
    """The loss masks of a batch of rows, flat and aligned with their flat input ids: row ``i`` holds
    ids ``offsets[i]:offsets[i + 1]``, and its mask is 0 over its first ``prompt_lens[i]`` ids (all of
    them when a clipped row is shorter) and 1 after."""
    lengths = np.diff(offsets)
    position = np.arange(offsets[-1] - offsets[0]) - np.repeat(offsets[:-1] - offsets[0], lengths)
    return (position >= np.repeat(prompt_lens, lengths)).astype(np.int8)


def loss_mask(total_len: int, prompt_len: int) -> list[int]:
    """The loss mask of one row of ``total_len`` ids (`loss_mask_values` for a single row)."""
    return loss_mask_values(np.array([0, total_len]), np.array([prompt_len])).tolist()


def records_to_table(records: Sequence[Record]) -> pa.Table:
    """Column by column: ``dataclasses.asdict`` would deep-copy every token id list."""
    columns: dict[str, list[Any]] = {name: [] for name in RECORD_SCHEMA.names}
    for rec in records:
        for f in _FIELDS:
            columns["class" if f == "cls" else f].append(getattr(rec, f))
        columns["schema_version"].append(SCHEMA_VERSION)
        columns["output_len"].append(rec.output_len)
    return pa.Table.from_pydict(columns, schema=RECORD_SCHEMA)
