"""Commands that read a job's stored records: ``export`` and ``report``."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from datagen.cli._app import EXIT_CHECK_FAILED, app, console
from datagen.errors import ConfigError
from datagen.settings import CommonSettings, load


@app.command()
def export(
    job_id: Annotated[str, typer.Argument(help="job id")],
    out: Annotated[Path, typer.Option(help="output file; a directory for parquet and with --shard-size")],
    format: Annotated[
        str, typer.Option("--format", help="specforge, speculators, conversations or parquet")
    ] = "specforge",
    storage: Annotated[str | None, typer.Option(help="DATAGEN_STORAGE")] = None,
    drop_truncated: Annotated[
        bool | None,
        typer.Option(
            "--drop-truncated/--keep-truncated",
            help="drop length-truncated rows (default: keep in token formats, drop in conversations)",
        ),
    ] = None,
    min_supervised_tokens: Annotated[
        int, typer.Option(help="drop rows with fewer loss-mask 1s (counted after --max-length)")
    ] = 1,
    max_length: Annotated[int | None, typer.Option(help="clip input_ids and loss_mask to N tokens")] = None,
    shuffle_seed: Annotated[
        int | None, typer.Option(help="shuffle rows with this seed (bounded memory, temporary files)")
    ] = None,
    shard_size: Annotated[
        int | None,
        typer.Option(help="rows per output file (parquet default 50000); JSONL --out becomes a directory"),
    ] = None,
    partition: Annotated[list[str] | None, typer.Option(help="keep only this partition; repeatable")] = None,
    tokenizer: Annotated[
        str | None,
        typer.Option(help="the job's tokenizer files at another path (speculators, conversations)"),
    ] = None,
) -> None:
    """Export a job's records from storage (deduplicated on sample, turn and gen).

    Prints a one-line JSON summary on stdout: rows written, duplicates, rows dropped by reason.
    """
    from datagen.export import ExportFormat, ExportOptions, export_job, total_records
    from datagen.storage import Storage

    try:
        fmt = ExportFormat(format)
    except ValueError as exc:
        choices = ", ".join(f.value for f in ExportFormat)
        raise ConfigError(f"unknown export format {format!r}; available: {choices}") from exc
    options = ExportOptions(
        drop_truncated=drop_truncated,
        min_supervised_tokens=min_supervised_tokens,
        max_length=max_length,
        shuffle_seed=shuffle_seed,
        shard_size=shard_size,
        partitions=frozenset(partition) if partition else None,
        tokenizer=tokenizer,
    )
    settings = load(CommonSettings, storage=storage)
    store = Storage(settings.storage)
    if not store.job_exists(job_id):
        raise ConfigError(f"no job {job_id} under {store.root}; check --storage / DATAGEN_STORAGE")
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


@app.command()
def report(
    job_id: Annotated[str, typer.Argument(help="job id")],
    storage: Annotated[str | None, typer.Option(help="DATAGEN_STORAGE")] = None,
    out: Annotated[
        Path | None, typer.Option(help="write report.html, report.json and PNG histograms to this directory")
    ] = None,
    tokenizer: Annotated[str | None, typer.Option(help="the job's tokenizer files at another path")] = None,
) -> None:
    """Counts, length histograms and token-structure checks of a job's records.

    Exit 0 when every check passes (warnings allowed), 1 when one fails.
    """
    from datagen.export import total_records
    from datagen.report import build_report, print_report, write_report
    from datagen.storage import Storage

    settings = load(CommonSettings, storage=storage)
    store = Storage(settings.storage)
    if not store.job_exists(job_id):
        raise ConfigError(f"no job {job_id} under {store.root}; check --storage / DATAGEN_STORAGE")
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
