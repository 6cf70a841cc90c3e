"""`export_job`: the stages of an export (see :mod:`datagen.export`) wired together."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Generator, Iterable, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from datagen.errors import ConfigError, StorageError
from datagen.export.conversations import ConversationFormatter, InputIndex
from datagen.export.features_offline import (
    OFFLINE_COLUMNS,
    FeaturesExportStats,
    OfflineSink,
    check_features_job,
)
from datagen.export.formats import (
    PARQUET_SCHEMA,
    ArmsSink,
    JsonlSink,
    ParquetSink,
    SpeculatorsFormatter,
    parquet_table,
    specforge_lines,
)
from datagen.export.rows import ROW_COLUMNS, ExportStats, RowFilter, RowFilterOptions, filtered_batches
from datagen.export.shuffle import bucket_count, shuffled_batches
from datagen.export.tokens import load_job_tokens
from datagen.records.storage import Storage
from datagen.spec import canonical_kwargs_json
from datagen.states import ExportFormat, MultiTurnMode

__all__ = [
    "DEFAULT_MIN_SUPERVISED_TOKENS",
    "ExportFormat",
    "ExportOptions",
    "check_exportable",
    "export_job",
]

DEFAULT_MIN_SUPERVISED_TOKENS = 1


@dataclass(frozen=True)
class ExportOptions:
    drop_truncated: bool | None = None  # None: the format's default
    min_supervised_tokens: int = DEFAULT_MIN_SUPERVISED_TOKENS
    max_length: int | None = None
    shuffle_seed: int | None = None
    shard_size: int | None = None  # rows per output file; JSONL output becomes a directory
    partitions: frozenset[str] | None = None
    tokenizer: str | None = None  # the job's tokenizer files at another path
    # Leave out shards that differ from their commit objects (ExportStats.skipped) instead of stopping.
    skip_unreadable: bool = False
    # specforge: the arms side file beside the export (`datagen.export.formats.ArmsSink`). None:
    # written when an exported row has an arm (a job with a recipe); True: always; False: never.
    arms_file: bool | None = None

    def __post_init__(self) -> None:
        if self.min_supervised_tokens < 0:
            raise ConfigError("--min-supervised-tokens must be 0 or more")
        if self.max_length is not None and self.max_length < 1:
            raise ConfigError("--max-length must be at least 1")
        if self.shard_size is not None and self.shard_size < 1:
            raise ConfigError("--shard-size must be at least 1")

    def filter_options(self, fmt: ExportFormat) -> RowFilterOptions:
        drop = fmt.drops_truncated_by_default if self.drop_truncated is None else self.drop_truncated
        return RowFilterOptions(
            partitions=self.partitions,
            drop_truncated=drop,
            min_supervised_tokens=self.min_supervised_tokens,
            max_length=self.max_length,
            clipped_is_truncated=fmt is ExportFormat.CONVERSATIONS,
        )


# Progress events: ("read", records read so far) and ("written", rows written so far).
ProgressCallback = Callable[[str, int], None]


def _ordered(
    batches: Iterable[pa.RecordBatch], storage: Storage, job_id: str, options: ExportOptions, out: Path
) -> Generator[pa.RecordBatch, None, None]:
    if options.shuffle_seed is None:
        yield from batches
        return
    out.parent.mkdir(parents=True, exist_ok=True)  # temporary buckets go on the output's disk
    with tempfile.TemporaryDirectory(prefix=".datagen-shuffle-", dir=out.parent) as tmp:
        buckets = bucket_count(storage, job_id)
        yield from shuffled_batches(batches, seed=options.shuffle_seed, buckets=buckets, tmp_dir=Path(tmp))


def _multi_turn_mode(storage: Storage, job_id: str) -> MultiTurnMode:
    manifest = storage.read_manifest(job_id) or {}
    return MultiTurnMode(manifest.get("spec", {}).get("multi_turn", MultiTurnMode.LAST.value))


def _job_template_kwargs(storage: Storage, job_id: str) -> str | None:
    """The job's template variables as canonical JSON: what the prompts of a shard from before they
    were recorded (schema version 4) were rendered with. None without a manifest to read them from."""
    spec = (storage.read_manifest(job_id) or {}).get("spec")
    if not isinstance(spec, dict):
        return None
    return canonical_kwargs_json(spec.get("chat_template_kwargs"))


def check_exportable(
    storage: Storage, job_id: str, fmt: ExportFormat, options: ExportOptions | None = None
) -> None:
    """Refuse, from the job's manifest alone, an export that could not be written (before any read).

    Raises `ConfigError` (one line) for a ``conversations`` export of a multi-turn ``all`` job, a
    ``speculators-offline`` export of a job without features (or without the datasets package), and
    an arms file asked of a format other than ``specforge``.
    """
    if options is not None and options.arms_file and fmt is not ExportFormat.SPECFORGE:
        raise ConfigError(
            f"--arms-file is for the specforge format only, not {fmt.value} (parquet, speculators and "
            "conversations rows carry their arm themselves); drop --arms-file"
        )
    if fmt is ExportFormat.SPECULATORS_OFFLINE:
        check_features_job(storage, job_id)
        return
    if fmt is not ExportFormat.CONVERSATIONS:
        return
    mode = _multi_turn_mode(storage, job_id)
    if mode is not MultiTurnMode.LAST:
        # Turn k+1 was rendered from the model's own turn k; the input holds the dataset's turn k.
        raise ConfigError(
            f"job {job_id} ran in multi-turn mode {mode.value!r}: its later turns follow the regenerated "
            "earlier turns, which the conversations export does not rebuild yet; export a token format "
            "(specforge, speculators, parquet), which is exact for every turn"
        )


def _line_writer(
    fmt: ExportFormat, storage: Storage, job_id: str, options: ExportOptions, stats: ExportStats
) -> tuple[Callable[[pa.RecordBatch], Iterable[bytes]], Callable[[], None]]:
    """The batch → JSON lines function of a JSONL format, and what to close after."""
    if fmt is ExportFormat.SPECFORGE:
        return specforge_lines, lambda: None
    tokens = load_job_tokens(storage, job_id, options.tokenizer)
    if fmt is ExportFormat.SPECULATORS:
        return SpeculatorsFormatter(tokens).lines, lambda: None
    index = InputIndex(storage, job_id, _multi_turn_mode(storage, job_id))
    return ConversationFormatter(tokens, index, stats).lines, index.close


def _count_tokens(batch: pa.RecordBatch) -> int:
    return int(pc.sum(pc.list_value_length(batch.column("input_ids"))).as_py() or 0)


def _write_parquet(
    batches: Iterable[pa.RecordBatch],
    out: Path,
    options: ExportOptions,
    stats: ExportStats,
    progress: ProgressCallback,
) -> list[Path]:
    sink = ParquetSink(out, PARQUET_SCHEMA, options.shard_size)
    with _aborting(out, sink):
        for batch in batches:
            sink.write(parquet_table(batch))
            stats.written += batch.num_rows
            stats.tokens += _count_tokens(batch)
            progress("written", stats.written)
        return sink.finish()


def _write_jsonl(
    batches: Iterable[pa.RecordBatch],
    lines: Callable[[pa.RecordBatch], Iterable[bytes]],
    out: Path,
    options: ExportOptions,
    stats: ExportStats,
    progress: ProgressCallback,
    *,
    arms_file: bool | None = False,
) -> list[Path]:
    """The rows as JSON lines; ``arms_file`` (`ExportOptions.arms_file`) the arms side file."""
    sink = JsonlSink(out, options.shard_size)
    arms: ArmsSink | None = None
    if arms_file is not False:
        try:
            arms = ArmsSink(out, always=bool(arms_file))
        except BaseException:
            sink.abort()
            raise
    with _aborting(out, sink, *([arms] if arms is not None else [])):
        for batch in batches:
            for line in lines(batch):
                sink.write(line)
                stats.written += 1
            if arms is not None:
                arms.write(batch)
            stats.tokens += _count_tokens(batch)
            progress("written", stats.written)
        files = sink.finish()
        if arms is not None:
            written = arms.finish()
            stats.arms_file = None if written is None else str(written)
        return files


def _write_offline(
    batches: Iterable[pa.RecordBatch],
    storage: Storage,
    job_id: str,
    out: Path,
    options: ExportOptions,
    stats: ExportStats,
    progress: ProgressCallback,
) -> list[Path]:
    # Whole sequences: a clipped row would no longer match the hidden states stored for it.
    if options.max_length is not None:
        raise ConfigError(
            "--max-length cannot clip a speculators-offline export: its hidden states are stored "
            "for whole sequences (speculators' trainer cuts to --total-seq-len itself)"
        )
    if options.shard_size is not None:
        raise ConfigError("--shard-size does not apply to speculators-offline: datasets shards its own files")
    sink = OfflineSink(storage, job_id, out, stats)
    with _aborting(out, sink):
        for batch in batches:
            sink.write(batch, lambda n: progress("written", n))
        return sink.finish()


@contextmanager
def _aborting(out: Path, *sinks: ParquetSink | JsonlSink | OfflineSink | ArmsSink) -> Iterator[None]:
    """Remove a half-written export on any error; a failed write says where it failed."""
    try:
        yield
    except OSError as exc:
        for sink in sinks:
            sink.abort()
        raise StorageError(f"cannot write the export to {out}: {exc}") from exc
    except BaseException:
        for sink in sinks:
            sink.abort()
        raise


def _no_progress(event: str, count: int) -> None:
    pass


def export_job(
    storage: Storage,
    job_id: str,
    fmt: ExportFormat,
    out: Path,
    options: ExportOptions | None = None,
    *,
    on_progress: ProgressCallback | None = None,
) -> ExportStats:
    """Export one job; ``out`` is a file (JSONL) or a directory (sharded JSONL, Parquet,
    speculators-offline).

    ``on_progress`` is called with ("read", records read) and ("written", rows written).
    """
    options = options or ExportOptions()
    check_exportable(storage, job_id, fmt, options)
    progress = on_progress or _no_progress
    offline = fmt is ExportFormat.SPECULATORS_OFFLINE
    stats = FeaturesExportStats() if offline else ExportStats()
    row_filter = RowFilter(options.filter_options(fmt), stats)
    filtered = filtered_batches(
        storage,
        job_id,
        row_filter,
        lambda n: progress("read", n),
        skip_unreadable=options.skip_unreadable,
        columns=OFFLINE_COLUMNS if offline else ROW_COLUMNS,
        template_kwargs=_job_template_kwargs(storage, job_id),
    )
    # closing(): a failed export removes the shuffle's temporary files at once, not at garbage collection.
    with closing(_ordered(filtered, storage, job_id, options, out)) as batches:
        if fmt is ExportFormat.PARQUET:
            files = _write_parquet(batches, out, options, stats, progress)
        elif offline:
            files = _write_offline(batches, storage, job_id, out, options, stats, progress)
        else:
            lines, close = _line_writer(fmt, storage, job_id, options, stats)
            # SpecForge's reader fixes its rows: the arms go beside them.
            arms_file = options.arms_file if fmt is ExportFormat.SPECFORGE else False
            try:
                files = _write_jsonl(batches, lines, out, options, stats, progress, arms_file=arms_file)
            finally:
                close()
    stats.files = [str(p) for p in files]
    return stats
