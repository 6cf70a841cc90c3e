"""Token-id export formats, built batch by batch from the filtered record columns.

- ``specforge`` (trainer-formats §4.2): ``{"id", "input_ids", "loss_mask"}`` per line.
- ``speculators`` (§4.4): ``{"id", "primary_id", "input_ids", "loss_mask", "text", "metadata"}``.
- ``parquet``: ``id, primary_id, input_ids (list<int64>), loss_mask (list<int8>), finish_reason,
  partition`` (int64 ids are what trainers' embedding lookups take; the 0/1 mask fits a byte).

Ids are the same in every format: ``{sample_id}`` for turn 0 / gen 0, else
``{sample_id}_t{turn}_g{gen}``; ``primary_id`` is the sample id. The loss mask is 0 over the prompt
and 1 over the output, after clipping. Both come from `datagen.records.reader` (`RowViews`), as the
report reads them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import orjson
import pyarrow as pa

from datagen.export.tokens import JobTokens
from datagen.records.reader import RowViews, export_ids, list_parts
from datagen.records.schema import loss_mask_values

__all__ = [
    "PARQUET_SCHEMA",
    "SPECULATORS_ENDPOINT",
    "SpeculatorsFormatter",
    "parquet_table",
    "specforge_lines",
]

SPECULATORS_ENDPOINT = "/generate"
PARQUET_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("primary_id", pa.string(), nullable=False),
        pa.field("input_ids", pa.list_(pa.int64()), nullable=False),
        pa.field("loss_mask", pa.list_(pa.int8()), nullable=False),
        pa.field("finish_reason", pa.string(), nullable=False),
        pa.field("partition", pa.string(), nullable=False),
    ]
)
_JSON_OPTIONS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_APPEND_NEWLINE


def specforge_lines(batch: pa.RecordBatch) -> Iterator[bytes]:
    rows = RowViews(batch)
    for i, row_id in enumerate(rows.ids):
        yield orjson.dumps(
            {"id": row_id, "input_ids": rows.input_ids(i), "loss_mask": rows.loss_mask(i)},
            option=_JSON_OPTIONS,
        )


class SpeculatorsFormatter:
    """speculators' regeneration rows; ``idx`` numbers rows in the order they are written."""

    def __init__(self, tokens: JobTokens) -> None:
        self.tokens = tokens
        self.idx = 0
        self._sampling_cache: dict[str, Any] = {}

    def _sampling(self, text: str) -> Any:
        # Records of one job share a handful of sampling_params strings (they differ by max_new_tokens).
        if text not in self._sampling_cache:
            self._sampling_cache[text] = orjson.loads(text)
        return self._sampling_cache[text]

    def lines(self, batch: pa.RecordBatch) -> Iterator[bytes]:
        rows = RowViews(batch)
        texts = self.tokens.decode_many(
            [rows.input_ids(i) for i in range(len(rows))], skip_special_tokens=False
        )
        sample_ids = batch.column("sample_id").to_pylist()
        finishes = batch.column("finish_type").to_pylist()
        output_lens = batch.column("output_len").to_pylist()
        servers = batch.column("server").to_pylist()
        sampling = batch.column("sampling_params").to_pylist()
        for i, row_id in enumerate(rows.ids):
            metadata = {
                "idx": self.idx,
                "finish_reason": finishes[i],
                "is_tool_call": self.tokens.is_tool_call(rows.output(i)),
                "usage": {"prompt_tokens": int(rows.prompt_lens[i]), "completion_tokens": output_lens[i]},
                "endpoint": SPECULATORS_ENDPOINT,
                "sampling_params": self._sampling(sampling[i]),
                "server": servers[i],
            }
            self.idx += 1
            row = {
                "id": row_id,
                "primary_id": sample_ids[i],
                "input_ids": rows.input_ids(i),
                "loss_mask": rows.loss_mask(i),
                "text": texts[i],
                "metadata": metadata,
            }
            yield orjson.dumps(row, option=_JSON_OPTIONS)


def parquet_table(batch: pa.RecordBatch) -> pa.Table:
    ids = batch.column("input_ids")
    values, offsets = list_parts(ids)
    base = offsets[0]
    rebased = pa.array(offsets - base, pa.int32())
    input_ids = pa.ListArray.from_arrays(rebased, pa.array(values[base : offsets[-1]].astype(np.int64)))
    mask = pa.ListArray.from_arrays(
        rebased, pa.array(loss_mask_values(offsets, batch.column("prompt_len").to_numpy()))
    )
    columns = [
        pa.array(export_ids(batch), pa.string()),
        batch.column("sample_id"),
        input_ids,
        mask,
        batch.column("finish_type"),
        batch.column("partition"),
    ]
    return pa.Table.from_arrays(columns, schema=PARQUET_SCHEMA)
