"""Exports read committed records straight from storage (no Redis, no coordinator), streaming.

    committed shards ─► dedupe + filters + clip ─► [bucket shuffle] ─► format ─► files (renamed at the end)

Records are deduplicated on (sample id, turn, gen): processing is at-least-once, so a prompt that
ran twice (a worker died after committing but before acknowledging) has two records, and the first
one read wins. Shards are read in commit order (each commit's ``committed_at_ms``, then its shard
name), so of a key committed twice the earlier commit is kept, on every export and report (both
read through :mod:`datagen.records.reader`), each held to its commit object first: a shard that differs
stops the export (`CorruptShardError`), or with ``skip_unreadable`` is left out whole and counted in
`ExportStats.skipped`. Then, in this order, rows are dropped by ``partitions``, by
truncation (``finish_type == "length"``; in ``conversations`` also a row cut by ``max_length``), and
when fewer than ``min_supervised_tokens`` output tokens remain after clipping to ``max_length``.

Truncated rows are kept by default in the token-id formats (``specforge``, ``speculators``,
``parquet``): every token of a truncated record is still an exact sample of the target model, and
dropping them would cut the long tail of generation lengths out of the training data; ``finish_reason``
stays available in ``speculators`` and ``parquet``. They are dropped by default in ``conversations``,
whose text trainers re-render the turn as a finished one.

Every format says how each row was made: its recipe arm, template variables and sampling params
(``parquet`` columns, ``speculators`` metadata, ``conversations`` fields of a recipe job's rows, and
for ``specforge``, whose rows SpecForge's reader fixes, the arms side file beside the export; see
:mod:`datagen.export.formats`). Shards from before records held them read as a null arm and the job's
template variables (`datagen.export.rows.with_arm_columns`).

Memory stays flat for any job size except for the dedupe set (a digest a record) and, for
``conversations``, the input index (a digest and a file offset a prompt); a shuffle holds one bucket
of ``SHUFFLE_BUCKET_BYTES`` (see :mod:`datagen.export.shuffle`). ``bench/export.py`` measures all three
(bench/README.md).

Modules, in pipeline order: ``rows`` (dedupe, filters, clipping), ``shuffle`` (the bucket shuffle),
``formats`` (token-id formats and their output files), ``conversations`` (the text format),
``features_offline`` (``speculators-offline``: a job with features, as speculators' trainer reads
it offline: a dataset and each row's hidden-states file), ``tokens`` (the job's tokenizer),
``pipeline`` (`export_job`, the stages wired together, and `check_exportable`, which refuses from
the manifest alone before anything is read).
"""

from datagen.export.pipeline import (
    DEFAULT_MIN_SUPERVISED_TOKENS,
    ExportFormat,
    ExportOptions,
    check_exportable,
    export_job,
)
from datagen.export.rows import DropReason, ExportStats
from datagen.records.reader import export_id, total_records

__all__ = [
    "DEFAULT_MIN_SUPERVISED_TOKENS",
    "DropReason",
    "ExportFormat",
    "ExportOptions",
    "ExportStats",
    "check_exportable",
    "export_id",
    "export_job",
    "total_records",
]
