"""Commands that read a job's stored records: ``export``, ``report`` and ``verify``.

All three hold every shard to its commit object (size, sha256, row count) before using a row of it.
A shard that differs stops ``export`` and ``report`` with one line naming it (exit 3);
``export --skip-unreadable`` leaves it out instead, names it on stderr and exits 1 (see
`EXIT_SHARDS_SKIPPED`); ``verify`` lists every bad shard (and features file) and exits 1 when there
is one.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from datagen.errors import ConfigError, CorruptShardError
from datagen.settings import DEFAULT_STORAGE, CommonSettings, load
from datagen.states import ExportFormat
from datagen_cli._app import EXIT_CHECK_FAILED, app, console, examples

if TYPE_CHECKING:
    from datagen.records.reader import Verification
    from datagen.records.storage import Storage

# `export --skip-unreadable` that left a shard out: the export is written, but not whole. The same
# code as a failed `report` check or `submit --wait` with failed prompts: done, with something to see.
EXIT_SHARDS_SKIPPED = EXIT_CHECK_FAILED
# `verify` that found a bad shard or features file.
EXIT_BAD_SHARDS = EXIT_CHECK_FAILED
JOB_ID_HELP = "the job's id, as submit printed it"
STORAGE_HELP = f"storage root: a directory or s3:// URL (DATAGEN_STORAGE, default {DEFAULT_STORAGE})"


def _job_storage(job_id: str, storage: str | None) -> Storage:
    from datagen.records.storage import Storage

    settings = load(CommonSettings, storage=storage)
    store = Storage(settings.storage)
    if not store.job_exists(job_id):
        raise ConfigError(f"no job {job_id} under {store.root}; check --storage / DATAGEN_STORAGE")
    return store


def _warn(message: str) -> None:
    """One ``warning:`` line on stderr (never wrapped, never read as markup)."""
    console.print(Text.assemble(("warning:", "yellow"), " ", message), soft_wrap=True, highlight=False)


def _report_skipped(job_id: str, skipped: list[CorruptShardError]) -> None:
    for shard in skipped:
        _warn(f"skipped shard {shard.path} ({shard.records} records): it {shard.problem}")
    records = sum(shard.records for shard in skipped)
    _warn(
        f"skipped {len(skipped)} shard(s) of job {job_id} ({records} records); the rest is exported. "
        f"`datagen verify {job_id}` lists every bad shard"
    )


@app.command(
    epilog=examples(
        "datagen export JOB_ID --out train.jsonl",
        "datagen export JOB_ID --format parquet --out train/ --shuffle-seed 0",
        "datagen export JOB_ID --format conversations --out chats.jsonl",
        "datagen export JOB_ID --out train.jsonl --arms-file",
        "datagen export JOB_ID --format speculators-offline --out train/",
    )
)
def export(
    job_id: Annotated[str, typer.Argument(help=JOB_ID_HELP)],
    out: Annotated[
        Path,
        typer.Option(help="output file; a directory for parquet, speculators-offline and with --shard-size"),
    ],
    format: Annotated[
        ExportFormat, typer.Option("--format", help="the training-file format")
    ] = ExportFormat.SPECFORGE,
    storage: Annotated[str | None, typer.Option(help=STORAGE_HELP)] = None,
    drop_truncated: Annotated[
        bool | None,
        typer.Option(
            "--drop-truncated/--keep-truncated",
            help="drop length-truncated rows (default: keep in token formats, drop in conversations)",
        ),
    ] = None,
    min_supervised_tokens: Annotated[
        int,
        typer.Option(help="drop rows with fewer supervised (loss-mask 1) tokens, counted after --max-length"),
    ] = 1,
    max_length: Annotated[
        int | None, typer.Option(help="clip input_ids and loss_mask to this many tokens (default: no clip)")
    ] = None,
    shuffle_seed: Annotated[
        int | None,
        typer.Option(
            help="shuffle rows with this seed (bounded memory, temporary files; default: no shuffle)"
        ),
    ] = None,
    shard_size: Annotated[
        int | None,
        typer.Option(
            help="rows per output file (parquet default 50000; JSONL default: one file); JSONL --out "
            "becomes a directory"
        ),
    ] = None,
    partition: Annotated[
        list[str] | None,
        typer.Option(
            metavar="<partition>", help="keep only rows of this partition; repeatable (default: all)"
        ),
    ] = None,
    tokenizer: Annotated[
        str | None,
        typer.Option(
            help="the job's tokenizer files at another path than the spec's (speculators, conversations)"
        ),
    ] = None,
    skip_unreadable: Annotated[
        bool,
        typer.Option(
            "--skip-unreadable",
            help="leave out shards that differ from their commit objects or cannot be read (exit 1)",
        ),
    ] = False,
    arms_file: Annotated[
        bool | None,
        typer.Option(
            "--arms-file/--no-arms-file",
            help="specforge: also write each row's arm, chat_template_kwargs and sampling_params beside "
            "the export (train.jsonl -> train.arms.jsonl; a --shard-size directory train -> "
            "train.arms.jsonl), one line a row in the rows' order, with index, id, sample_id, turn, gen "
            "(default: written when a row has a recipe arm; otherwise an earlier one there is removed). "
            "The other formats carry these in their rows",
        ),
    ] = None,
) -> None:
    """Export a job's records as training files.

    The records are read from storage and deduplicated on sample, turn and gen. Prints a one-line
    JSON summary on stdout: rows written, duplicates, rows dropped by reason, shards skipped, the
    arms file (specforge).
    Exit 0; 1 when --skip-unreadable left a shard out; 3 on an error.
    """
    from datagen.export import ExportOptions, check_exportable, export_job, total_records

    fmt = format
    options = ExportOptions(
        drop_truncated=drop_truncated,
        min_supervised_tokens=min_supervised_tokens,
        max_length=max_length,
        shuffle_seed=shuffle_seed,
        shard_size=shard_size,
        partitions=frozenset(partition) if partition else None,
        tokenizer=tokenizer,
        skip_unreadable=skip_unreadable,
        arms_file=arms_file,
    )
    store = _job_storage(job_id, storage)
    check_exportable(store, job_id, fmt, options)  # a refusal comes at once, before any bar is drawn
    started = time.monotonic()
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as bar:
        tasks = {
            "read": bar.add_task("read", total=total_records(store, job_id)),
            "written": bar.add_task("written", total=None),
        }
        stats = export_job(
            store,
            job_id,
            fmt,
            out,
            options,
            on_progress=lambda event, n: bar.update(tasks[event], completed=n),
        )
    summary = {"job": job_id, "format": fmt.value, "out": str(out), **stats.summary()}
    summary["elapsed_s"] = round(time.monotonic() - started, 3)
    typer.echo(json.dumps(summary))
    if stats.skipped:
        _report_skipped(job_id, stats.skipped)
        raise typer.Exit(EXIT_SHARDS_SKIPPED)


@app.command(epilog=examples("datagen report JOB_ID", "datagen report JOB_ID --out report/"))
def report(
    job_id: Annotated[str, typer.Argument(help=JOB_ID_HELP)],
    storage: Annotated[str | None, typer.Option(help=STORAGE_HELP)] = None,
    out: Annotated[
        Path | None, typer.Option(help="write report.html, report.json and PNG histograms to this directory")
    ] = None,
    tokenizer: Annotated[
        str | None, typer.Option(help="the job's tokenizer files at another path than the spec's")
    ] = None,
) -> None:
    """Check a job's records: counts, histograms, token structure.

    Counts, length histograms and token-structure checks of the records in storage. Exit 0 when
    every check passes (warnings allowed), 1 when one fails, 3 on an error (such as a shard that
    differs from its commit object).
    """
    from datagen.export import total_records
    from datagen.report import build_report, print_report, write_report

    store = _job_storage(job_id, storage)
    columns = (TextColumn("reading records"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("read", total=total_records(store, job_id))
        result = build_report(
            store, job_id, tokenizer=tokenizer, on_read=lambda n: bar.update(task, completed=n)
        )
    print_report(result, Console())
    if out is not None:
        for path in write_report(result, out):
            console.print(f"wrote {path}", soft_wrap=True)
    raise typer.Exit(EXIT_CHECK_FAILED if result.failed else 0)


@app.command(epilog=examples("datagen verify JOB_ID", "datagen verify JOB_ID --storage s3://bucket/datagen"))
def verify(
    job_id: Annotated[str, typer.Argument(help=JOB_ID_HELP)],
    storage: Annotated[str | None, typer.Option(help=STORAGE_HELP)] = None,
) -> None:
    """Verify a job's stored shards against their commit objects.

    Each committed shard must be there, of the size, sha256 and row count its commit object says,
    and readable Parquet; in a job with features, each features file a record names must be there,
    of the size and sha256 the record says. Needs only the storage (no Redis, no coordinator).

    Prints one line per bad shard (and bad features file) and a summary. Exit 0 when everything is
    good, 1 when something is not.
    """
    from datagen.records.reader import verify_job

    store = _job_storage(job_id, storage)
    columns = (TextColumn("verifying shards"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("verify", total=None)
        result = verify_job(store, job_id, lambda done, total: bar.update(task, completed=done, total=total))
    for shard in result.bad:
        typer.echo(f"bad shard {shard.path} ({shard.records} records): it {shard.problem}")
    unsealed = (
        f"; {result.unsealed} of them not verifiable (written before checksums): their row counts "
        "match and they decode"
        if result.unsealed
        else ""
    )
    typer.echo(
        f"job {job_id}: {result.shards - len(result.bad)} shards, {result.records} rows verified; "
        f"{len(result.bad)} bad{unsealed}"
    )
    _print_features(job_id, result)
    raise typer.Exit(0 if result.ok else EXIT_BAD_SHARDS)


def _print_features(job_id: str, result: Verification) -> None:
    """`verify`'s lines on features files: each bad one (the first few), then a summary."""
    if not result.features and not result.features_none:
        return
    for problem in result.feature_problems:
        typer.echo(f"bad features file: {problem}")
    problems = result.features_missing + result.features_bad
    if problems > len(result.feature_problems):
        typer.echo(f"… and {problems - len(result.feature_problems)} more bad features files")
    good = result.features - problems
    typer.echo(
        f"job {job_id}: {good} features files verified; {result.features_missing} missing, "
        f"{result.features_bad} bad; {result.features_none} records without features"
    )
