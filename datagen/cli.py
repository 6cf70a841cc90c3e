"""The ``datagen`` command line. Commands import the service, worker and simulator packages
lazily, so ``datagen`` (the core) depends on none of them."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from datagen.errors import ConfigError, DatagenError
from datagen.settings import ClientSettings, CommonSettings, CoordinatorSettings, WorkerSettings, load

__all__ = ["app", "main"]

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="Exact-token EAGLE-3 training data from SGLang."
)
console = Console(stderr=True)

EXIT_ALL_DONE = 0
EXIT_SOME_FAILED = 1
EXIT_JOB_FAILED = 2
EXIT_ERROR = 3
EXIT_CHECK_FAILED = 1  # `datagen report`: a token-structure check failed
WAIT_POLL_S = 1.0


# Libraries that log every request at INFO; our own one-line-per-prompt log is enough.
_QUIET_LOGGERS = ("httpx", "rq.worker", "rq.queue")


def _logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in _QUIET_LOGGERS:
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger().level))


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@app.command()
def coordinator(
    host: Annotated[str | None, typer.Option(help="bind address (DATAGEN_HOST)")] = None,
    port: Annotated[int | None, typer.Option(help="port (DATAGEN_PORT, default 8000)")] = None,
    redis_url: Annotated[str | None, typer.Option(help="DATAGEN_REDIS_URL")] = None,
    storage: Annotated[str | None, typer.Option(help="DATAGEN_STORAGE")] = None,
) -> None:
    """Run the coordinator HTTP API."""
    import uvicorn

    from service.app import create_app

    settings = load(CoordinatorSettings, host=host, port=port, redis_url=redis_url, storage=storage)
    settings.require_redis_url()
    if not _loopback(settings.host) and not settings.api_token and not settings.allow_insecure_bind:
        raise ConfigError(
            f"refusing to listen on {settings.host} without DATAGEN_API_TOKEN; set a token, "
            "or DATAGEN_ALLOW_INSECURE_BIND=1 if a proxy in front does authentication"
        )
    _logging(settings.log_level)
    uvicorn.run(
        create_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level.lower()
    )


@app.command()
def worker(
    server: Annotated[
        list[str] | None, typer.Option(help="SGLang server, NAME=URL or URL; repeatable")
    ] = None,
    short_concurrency: Annotated[int | None, typer.Option(help="in-flight short prompts per server")] = None,
    long_concurrency: Annotated[int | None, typer.Option(help="in-flight long prompts per server")] = None,
    metrics_port: Annotated[int | None, typer.Option(help="Prometheus port, 0 = off (default 9400)")] = None,
    burst: Annotated[bool, typer.Option(help="exit when the queues are empty")] = False,
    redis_url: Annotated[str | None, typer.Option(help="DATAGEN_REDIS_URL")] = None,
    storage: Annotated[str | None, typer.Option(help="DATAGEN_STORAGE")] = None,
) -> None:
    """Run a worker that sends queued prompts to SGLang servers and stores the records."""
    from workers.fleet import ServerSpec, with_api_keys
    from workers.worker import Worker

    settings = load(
        WorkerSettings,
        short_concurrency=short_concurrency,
        long_concurrency=long_concurrency,
        metrics_port=metrics_port,
        redis_url=redis_url,
        storage=storage,
    )
    settings.require_redis_url()
    values = list(server or []) or [settings.servers]
    try:
        specs = ServerSpec.parse_many([v for v in values if v])
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if not specs:
        raise ConfigError("no SGLang server given: use --server NAME=URL (repeatable) or DATAGEN_SERVERS")
    specs = with_api_keys(specs, settings.server_keys())
    _logging(settings.log_level)
    asyncio.run(Worker(settings, specs, burst=burst).main())


@app.command()
def sim(
    port: Annotated[int, typer.Option(help="port (SGLang's default is 30000)")] = 30000,
    host: Annotated[str, typer.Option()] = "127.0.0.1",
    tokenizer: Annotated[str | None, typer.Option(help="tokenizer path for special ids and text")] = None,
    context_len: Annotated[int | None, typer.Option(help="model context length in tokens")] = None,
    kv_tokens: Annotated[int | None, typer.Option(help="KV-cache capacity (max_total_num_tokens)")] = None,
    time_scale: Annotated[
        float | None, typer.Option(help="multiplies simulated durations; 0 = instant")
    ] = None,
    reserve_fraction: Annotated[
        float | None, typer.Option(help="admission reserve of max_new_tokens")
    ] = None,
    mean_reasoning_tokens: Annotated[float | None, typer.Option()] = None,
    mean_answer_tokens: Annotated[float | None, typer.Option()] = None,
    fail_503_rate: Annotated[float | None, typer.Option(help="fraction of /generate answered 503")] = None,
    fail_500_rate: Annotated[float | None, typer.Option(help="fraction of /generate answered 500")] = None,
    abort_rate: Annotated[float | None, typer.Option(help="fraction of /generate aborted")] = None,
    starting_s: Annotated[float | None, typer.Option(help="seconds /health answers 503 after start")] = None,
    api_key: Annotated[
        str | None, typer.Option(help="like SGLang's --api-key: a bearer token for all but /health, /metrics")
    ] = None,
) -> None:
    """Run a simulated SGLang server (the real /generate contract, a simulated GPU)."""
    from simulator.config import SimConfig
    from simulator.server import run

    given: dict[str, Any] = {
        "port": port,
        "host": host,
        "tokenizer_path": tokenizer,
        "context_len": context_len,
        "max_total_num_tokens": kv_tokens,
        "time_scale": time_scale,
        "reserve_fraction": reserve_fraction,
        "mean_reasoning_tokens": mean_reasoning_tokens,
        "mean_answer_tokens": mean_answer_tokens,
        "fail_503_rate": fail_503_rate,
        "fail_500_rate": fail_500_rate,
        "abort_rate": abort_rate,
        "starting_s": starting_s,
        "api_key": api_key,
    }
    try:
        config = SimConfig(**{k: v for k, v in given.items() if v is not None})
    except ValidationError as exc:
        raise ConfigError(f"invalid simulator options: {exc}") from exc
    run(config)


def _spec_from_options(
    spec_file: Path | None,
    tokenizer: str | None,
    chat_template: Path | None,
    trust_remote_code: bool | None,
    limits: dict[str, Any],
    sampling: dict[str, float | int | None],
) -> dict[str, Any]:
    """The job spec: the spec file (if any) with the flags that were given on top."""
    from datagen.specfile import load_spec_file, merge_spec

    flags: dict[str, Any] = {k: v for k, v in limits.items() if v is not None}
    if tokenizer is not None:
        flags["tokenizer"] = tokenizer
    if chat_template is not None:
        flags["chat_template"] = str(chat_template.resolve())
    if trust_remote_code is not None:
        flags["trust_remote_code"] = trust_remote_code
    flags["sampling"] = {k: v for k, v in sampling.items() if v is not None}
    base = load_spec_file(spec_file) if spec_file is not None else {}
    if "tokenizer" not in base and "tokenizer" not in flags:
        raise ConfigError("name a tokenizer: --tokenizer PATH_OR_ID, or `tokenizer:` in a --spec file")
    return merge_spec(base, flags)


@app.command()
def spec(example: Annotated[bool, typer.Option(help="print a commented example job spec")] = True) -> None:
    """Print a commented example job spec (YAML) for `datagen submit --spec`."""
    from datagen.specfile import EXAMPLE_SPEC

    typer.echo(EXAMPLE_SPEC, nl=False)


@app.command()
def submit(
    dataset: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="JSONL dataset")],
    tokenizer: Annotated[
        str | None, typer.Option(help="tokenizer path or hub id, as the coordinator sees it")
    ] = None,
    spec_file: Annotated[
        Path | None, typer.Option("--spec", exists=True, dir_okay=False, help="job spec file (YAML or JSON)")
    ] = None,
    coordinator: Annotated[str | None, typer.Option(help="coordinator URL (DATAGEN_COORDINATOR_URL)")] = None,
    chat_template: Annotated[
        Path | None, typer.Option(help="chat template file overriding the tokenizer's")
    ] = None,
    trust_remote_code: Annotated[bool | None, typer.Option()] = None,
    short_max_new_tokens: Annotated[int | None, typer.Option()] = None,
    long_max_new_tokens: Annotated[int | None, typer.Option()] = None,
    long_threshold_tokens: Annotated[
        int | None, typer.Option(help="prompts this long or longer are long")
    ] = None,
    context_len: Annotated[
        int | None, typer.Option(help="the model's context length (default: what the workers report)")
    ] = None,
    temperature: Annotated[float | None, typer.Option()] = None,
    top_p: Annotated[float | None, typer.Option()] = None,
    seed: Annotated[int | None, typer.Option(help="sampling_seed sent to SGLang")] = None,
    priority: Annotated[
        str | None, typer.Option(help="high, normal or low: higher work is always dispatched first")
    ] = None,
    weight: Annotated[
        float | None, typer.Option(help="share of the fleet among jobs of the same priority (default 1)")
    ] = None,
    job_id: Annotated[str | None, typer.Option(help="reuse an id to append to or resume a job")] = None,
    wait: Annotated[bool, typer.Option(help="show progress and wait until the job ends")] = False,
    dry_run: Annotated[
        bool, typer.Option(help="render a sample of rows and show them; enqueue nothing")
    ] = False,
) -> None:
    """Submit a dataset and print the job id.

    With --wait: exit 0 when all prompts are done, 1 if some failed, 2 if the job failed.
    """
    from datagen.client import CoordinatorClient

    settings = load(ClientSettings, coordinator_url=coordinator)
    spec = _spec_from_options(
        spec_file,
        tokenizer,
        chat_template,
        trust_remote_code,
        {
            "short_max_new_tokens": short_max_new_tokens,
            "long_max_new_tokens": long_max_new_tokens,
            "long_threshold_tokens": long_threshold_tokens,
            "context_len": context_len,
            "priority": priority,
            "weight": weight,
        },
        {"temperature": temperature, "top_p": top_p, "sampling_seed": seed},
    )
    with CoordinatorClient(settings.coordinator_url, api_token=settings.api_token) as client:
        if dry_run:
            _print_dry_run(client.dry_run(dataset, spec))
            return
        job = client.submit(dataset, spec, job_id)
        typer.echo(job["id"])
        if wait:
            raise typer.Exit(wait_for_job(client, job["id"]))


def _print_dry_run(preview: dict[str, Any]) -> None:
    out = Console()
    for example in preview["examples"]:
        out.rule(
            f"line {example['line']} · {example['sample_id']} · turn {example['turn']} · "
            f"{example['class']} · {example['prompt_tokens']} tokens"
        )
        out.print(example["prompt"], markup=False, highlight=False)
    out.rule("summary")
    classes = preview["classes"]
    out.print(
        f"sampled {preview['rows_sampled']} rows "
        f"({preview['bytes_sampled']} of {preview['bytes_total']} bytes): "
        f"{preview['prompts']} prompts, {classes['short']} short / {classes['long']} long, "
        f"{len(preview['rejected'])} rejected, {preview['prompt_tokens_sampled']} prompt tokens",
        markup=False,
    )
    out.print(
        f"estimated for the whole file: {preview['estimated_rows']} rows, "
        f"{preview['estimated_prompts']} prompts, "
        f"{preview['estimated_prompt_tokens']} prompt tokens",
        markup=False,
    )
    for row in preview["rejected"]:
        out.print(f"rejected line {row['line']}: {row['reason']}", markup=False)
    checks = preview.get("preflight") or {}
    if checks.get("refused"):
        out.print(f"pre-flight: submit would be refused: {checks['refused']}", markup=False)
    elif checks:
        out.print(
            f"pre-flight: passed; context length {checks['context_len']}, stop ids {checks['stop_ids']}, "
            f"model vocabulary {checks['vocab_size'] or 'unknown'}",
            markup=False,
        )
        for warning in checks.get("warnings", []):
            out.print(f"pre-flight warning: {warning}", markup=False)


def wait_for_job(client: Any, job_id: str) -> int:
    """Show a progress bar until the job ends; return the exit code of ``submit --wait``."""
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[detail]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task(f"job {job_id[:12]}", total=None, detail="")
        while True:
            job = client.job(job_id)
            total = job["total"] if job["state"] != "ingesting" else None
            detail = (
                f"{job['state']} · failed {job['failed']} · rejected {job['rejected']} · "
                f"{job['tokens_per_s']:.0f} tok/s"
                + (f" · ETA {job['eta_s']:.0f}s" if job.get("eta_s") else "")
            )
            finished = job["done"] + job["failed"] + job.get("cancelled", 0)
            progress.update(task, completed=finished, total=total, detail=detail)
            if job["state"] in ("completed", "failed", "cancelled"):
                break
            time.sleep(WAIT_POLL_S)
    if job["state"] != "completed":
        console.print(f"[red]job {job_id} {job['state']}: {job.get('error') or ''}")
        return EXIT_JOB_FAILED
    if job["failed"]:
        console.print(f"[yellow]{job['failed']} prompts failed; see GET /jobs/{job_id}/errors?kind=failed")
        return EXIT_SOME_FAILED
    return EXIT_ALL_DONE


def _client() -> Any:
    from datagen.client import CoordinatorClient

    settings = load(ClientSettings)
    return CoordinatorClient(settings.coordinator_url, api_token=settings.api_token)


@app.command()
def status(
    coordinator: Annotated[str | None, typer.Option(help="coordinator URL (DATAGEN_COORDINATOR_URL)")] = None,
) -> None:
    """Show jobs, queues and servers."""
    from datagen.client import CoordinatorClient

    settings = load(ClientSettings, coordinator_url=coordinator)
    with CoordinatorClient(settings.coordinator_url, api_token=settings.api_token) as client:
        jobs, queues, servers = client.jobs(), client.queues(), client.servers()
    out = Console()
    jobs_table = Table(
        "job",
        "state",
        "priority",
        "share now/target",
        "total",
        "done",
        "failed",
        "rejected",
        "in flight",
        "tok/s",
        "ETA s",
        title="jobs",
    )
    for job in jobs:
        eta = "" if job["eta_s"] is None else f"{job['eta_s']:.0f}"
        cells = [job[k] for k in ("total", "done", "failed", "rejected", "in_flight")]
        state = job["state"] + (" (paused)" if job.get("paused") else "")
        jobs_table.add_row(
            job["id"], state, _priority(job), _share(job), *map(str, cells), f"{job['tokens_per_s']:.0f}", eta
        )
    queues_table = Table("queue", "paused", "queued", "started", "failed", title="queues")
    for queue in queues:
        queues_table.add_row(
            queue["name"],
            "yes" if queue["paused"] else "",
            *(str(queue[k]) for k in ("queued", "started", "failed")),
        )
    servers_table = Table(
        "server", "state", "in flight s/l", "limits s/l", "target", "KV usage", "waiting", title="servers"
    )
    for server in servers:
        kv = server.get("kv") or {}
        usage = kv.get("token_usage")
        servers_table.add_row(
            server["name"],
            server["state"],
            "{short}/{long}".format(**server["in_flight"]),
            "{short}/{long}".format(**server["limits"]),
            "" if server["target"] is None else str(server["target"]),
            "" if usage is None else f"{usage:.0%}",
            "" if not kv else f"{kv.get('num_queue_reqs', 0):.0f}",
        )
    for table in (jobs_table, queues_table, servers_table):
        out.print(table)


QUEUE_NAMES = ("short", "long")


def _priority(job: dict[str, Any]) -> str:
    weight = job.get("weight", 1.0)
    return f"{job.get('priority', 'normal')}" + ("" if weight == 1.0 else f" ×{weight:g}")


def _share(job: dict[str, Any]) -> str:
    share = job.get("share")
    return "" if not share else f"{share['recent']:.0%} / {share['target']:.0%}"


def _pause(paused: bool, target: str | None, server: str | None, job: str | None) -> None:
    if target is not None and target not in QUEUE_NAMES:
        target, job = None, job or target  # anything but a queue name is a job id
    if sum(x is not None for x in (target, server, job)) != 1:
        raise ConfigError("name one queue (short or long), one job (JOB or --job JOB) or one --server NAME")
    with _client() as client:
        if target is not None:
            state = client.set_queue_paused(target, paused)
            word = "paused" if state["paused"] else "running"
            console.print(f"queue {state['name']}: {word}, {state['queued']} queued")
        elif server is not None:
            state = client.set_server_paused(server, paused)
            console.print(f"server {state['name']}: {state.get('state', 'resumed')}")
        else:
            state = client.set_job_paused(str(job), paused)
            word = "paused" if state["paused"] else state["state"]
            console.print(
                f"job {state['id']}: {word}, {state['queued']} queued, {state['in_flight']} in flight"
            )


@app.command()
def pause(
    target: Annotated[str | None, typer.Argument(help="short, long, or a job id")] = None,
    server: Annotated[str | None, typer.Option(help="pause a server instead")] = None,
    job: Annotated[str | None, typer.Option(help="pause this job (its prompts wait; others go on)")] = None,
) -> None:
    """Stop dispatching from a queue or a job, or to a server, within 2 s; in-flight requests finish."""
    _pause(True, target, server, job)


@app.command()
def resume(
    target: Annotated[str | None, typer.Argument(help="short, long, or a job id")] = None,
    server: Annotated[str | None, typer.Option(help="resume a server instead")] = None,
    job: Annotated[str | None, typer.Option(help="resume this job")] = None,
) -> None:
    """Undo a pause."""
    _pause(False, target, server, job)


@app.command()
def cancel(
    job_id: Annotated[str, typer.Argument(help="job id")],
    abort_in_flight: Annotated[
        bool, typer.Option(help="abort prompts in flight too, instead of letting them finish")
    ] = False,
) -> None:
    """Cancel a job: its queued prompts are dropped; committed records are kept."""
    with _client() as client:
        state = client.cancel(job_id, abort_in_flight=abort_in_flight)
    fate = "being aborted" if abort_in_flight else "left to finish"
    console.print(
        f"job {job_id}: cancelled; {state['dropped']} queued prompts dropped, "
        f"{state['in_flight']} in flight {fate}; {state['done']} done are kept"
    )


@app.command()
def retry(
    job_id: Annotated[str, typer.Argument(help="job id")],
    reason: Annotated[
        str | None,
        typer.Option(help="only prompts failed with this reason (see GET /jobs/ID/errors?kind=failed)"),
    ] = None,
) -> None:
    """Re-enqueue a job's failed prompts with fresh attempts."""
    with _client() as client:
        state = client.retry(job_id, reason=reason)
    reasons = ", ".join(f"{k} {v}" for k, v in state["failed_by_reason"].items()) or "none"
    console.print(
        f"job {job_id}: {state['retried_now']} failed prompts re-enqueued (failed by reason: {reasons})"
    )
    if state["not_retryable"]:
        console.print(
            f"[yellow]{state['not_retryable']} failures are no longer in RQ's failed registry "
            "(older than DATAGEN_FAILURE_TTL_S) and cannot be retried"
        )


@app.command()
def delete(
    job_id: Annotated[str, typer.Argument(help="job id")],
    files: Annotated[bool, typer.Option(help="also delete the job's stored inputs and records")] = False,
) -> None:
    """Delete a finished or cancelled job's state in Redis (and with --files its stored data)."""
    with _client() as client:
        result = client.delete(job_id, files=files)
    kept = "" if result["files_deleted"] else f"; its files are kept at {result['files']}"
    console.print(f"job {job_id}: deleted ({result['rq_jobs']} RQ jobs removed){kept}")


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


@app.command()
def demo(
    data_dir: Annotated[Path, typer.Option(help="where records go")] = Path("./datagen-data"),
    dataset: Annotated[
        Path | None, typer.Option(help="JSONL dataset (default: examples/prompts.jsonl)")
    ] = None,
) -> None:
    """Run everything locally: private Redis, simulated SGLang, coordinator and worker."""
    from datagen.demo import run_demo

    raise typer.Exit(run_demo(data_dir, dataset, console))


def main() -> None:
    try:
        app(standalone_mode=True)
    except DatagenError as exc:
        console.print(f"[red]error:[/red] {exc}")
        sys.exit(EXIT_ERROR)
