"""Commands that make a job: ``spec`` (an example job spec) and ``submit``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

from datagen.errors import ConfigError
from datagen.settings import (
    DEFAULT_LONG_MAX_NEW_TOKENS,
    DEFAULT_LONG_THRESHOLD_TOKENS,
    DEFAULT_SHORT_MAX_NEW_TOKENS,
    DEFAULT_WAIT_FOR_SERVERS_S,
    ClientSettings,
    load,
)
from datagen.spec import FeatureDtype
from datagen.states import Priority
from datagen_cli._app import app, console, examples
from datagen_cli._options import CoordinatorOption, ProgressEverySOption
from datagen_cli.waiting import wait_for_job_exit

if TYPE_CHECKING:
    from datagen_cli.client import DatasetSource


def _spec_from_options(
    spec_file: Path | None,
    tokenizer: str | None,
    chat_template: Path | None,
    trust_remote_code: bool | None,
    limits: dict[str, Any],
    sampling: dict[str, float | int | None],
) -> dict[str, Any]:
    """The job spec: the spec file (if any) with the flags that were given on top."""
    from datagen_cli.specfile import load_spec_file, merge_spec

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


@app.command(
    epilog=examples("datagen spec --example > job.yaml", "datagen submit prompts.jsonl --spec job.yaml")
)
def spec(
    example: Annotated[
        bool, typer.Option(help="print the commented example job spec (what `datagen spec` always prints)")
    ] = True,
) -> None:
    """Print a commented example job spec (YAML).

    Save it, edit it and pass it to `datagen submit --spec FILE`; flags given to submit override
    its fields.
    """
    from datagen_cli.specfile import EXAMPLE_SPEC

    typer.echo(EXAMPLE_SPEC, nl=False)


@app.command(
    epilog=examples(
        "datagen submit prompts.jsonl --tokenizer /models/DeepSeek-R1 --wait",
        "datagen submit prompts.jsonl --spec job.yaml --priority high",
        "datagen submit prompts.jsonl --spec job.yaml --dry-run",
    )
)
def submit(
    dataset: Annotated[
        Path | None,
        typer.Argument(
            exists=True,
            dir_okay=False,
            help="dataset file uploaded to the coordinator: JSONL (.jsonl, .jsonl.gz, .jsonl.zst) or Parquet "
            "(.parquet); or give --dataset-url",
        ),
    ] = None,
    dataset_url: Annotated[
        str | None,
        typer.Option(
            help="instead of a file: a URL (s3://..., any fsspec one) or absolute path the coordinator reads "
            "itself (a file, a directory of *.parquet, or a `datasets` save_to_disk directory); it must "
            "start with a prefix of the coordinator's DATAGEN_DATASET_ALLOWLIST"
        ),
    ] = None,
    dataset_format: Annotated[
        str | None,
        typer.Option(
            "--format",
            help="jsonl, jsonl.gz, jsonl.zst, parquet, parquet-dir or hf-dataset (default: told by the name)",
        ),
    ] = None,
    messages_column: Annotated[
        str | None, typer.Option(help="Parquet/Arrow column holding the conversation (default: messages)")
    ] = None,
    id_column: Annotated[
        str | None, typer.Option(help="Parquet/Arrow column holding the row's id (default: id)")
    ] = None,
    tokenizer: Annotated[
        str | None,
        typer.Option(help="tokenizer path or hub id, as the coordinator sees it (or `tokenizer:` in --spec)"),
    ] = None,
    spec_file: Annotated[
        Path | None,
        typer.Option(
            "--spec",
            exists=True,
            dir_okay=False,
            help="job spec file (YAML or JSON; `datagen spec` prints one); flags override its fields",
        ),
    ] = None,
    coordinator: CoordinatorOption = None,
    chat_template: Annotated[
        Path | None, typer.Option(help="chat template file (Jinja) replacing the tokenizer's own")
    ] = None,
    trust_remote_code: Annotated[
        bool | None,
        typer.Option(
            help="run the tokenizer repository's code on the coordinator (it needs "
            "DATAGEN_ALLOW_TRUST_REMOTE_CODE=1; default: no)"
        ),
    ] = None,
    short_max_new_tokens: Annotated[
        int | None,
        typer.Option(
            help=f"tokens to generate at most for a short prompt (default {DEFAULT_SHORT_MAX_NEW_TOKENS})"
        ),
    ] = None,
    long_max_new_tokens: Annotated[
        int | None,
        typer.Option(
            help=f"tokens to generate at most for a long prompt (default {DEFAULT_LONG_MAX_NEW_TOKENS})"
        ),
    ] = None,
    long_threshold_tokens: Annotated[
        int | None,
        typer.Option(
            help=f"prompts of at least this many tokens are long (default {DEFAULT_LONG_THRESHOLD_TOKENS})"
        ),
    ] = None,
    context_len: Annotated[
        int | None,
        typer.Option(help="the model's context length in tokens (default: what the workers report)"),
    ] = None,
    temperature: Annotated[
        float | None,
        typer.Option(help="sampling temperature sent to the server, SGLang or vLLM (default 0.6)"),
    ] = None,
    top_p: Annotated[
        float | None,
        typer.Option(
            help="nucleus sampling top_p sent to the server, SGLang or vLLM, in (0, 1] (default 0.95)"
        ),
    ] = None,
    seed: Annotated[
        int | None,
        typer.Option(
            help="sampling seed sent to the server, SGLang or vLLM: reproducible outputs (default: none)"
        ),
    ] = None,
    priority: Annotated[
        Priority | None, typer.Option(help="higher work is always dispatched first (default normal)")
    ] = None,
    weight: Annotated[
        float | None, typer.Option(help="share of the fleet among jobs of the same priority (default 1)")
    ] = None,
    job_id: Annotated[
        str | None, typer.Option(help="reuse an id to append to or resume a job (default: a new id)")
    ] = None,
    wait: Annotated[
        bool,
        typer.Option(
            show_default=False, help="show progress and wait until the job ends; the exit code says how"
        ),
    ] = False,
    progress_every_s: ProgressEverySOption = None,
    dry_run: Annotated[
        bool,
        typer.Option(show_default=False, help="render a sample of rows and show them; enqueue nothing"),
    ] = False,
    features_layers: Annotated[
        str | None,
        typer.Option(
            metavar="<ids>",
            help="capture the target's hidden states at these vLLM layer ids for every record, e.g. "
            "2,16,29,32 (`features.layers` in --spec); needs capture servers (docs/user/features.md)",
        ),
    ] = None,
    features_dtype: Annotated[
        FeatureDtype | None,
        typer.Option(help="how features are stored: bf16 as captured, or fp8 (default bf16)"),
    ] = None,
    wait_for_servers_s: Annotated[
        float | None,
        typer.Option(
            help="seconds to wait for the coordinator and, without --context-len, for a worker to "
            f"report a server (DATAGEN_WAIT_FOR_SERVERS_S, default {DEFAULT_WAIT_FOR_SERVERS_S:g}; "
            "0 = no wait)"
        ),
    ] = None,
) -> None:
    """Submit a dataset and print the job id.

    A fleet that is still starting is waited for (--wait-for-servers-s). With --wait: exit 0 when
    all prompts are done, 1 if some failed, 2 if the job failed; `datagen wait JOB` watches it
    again later.
    """
    from datagen_cli._fleet_wait import submit_when_ready
    from datagen_cli.client import CoordinatorClient

    settings = load(
        ClientSettings,
        coordinator_url=coordinator,
        wait_for_servers_s=wait_for_servers_s,
        progress_interval_s=progress_every_s,
    )
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
    if features_layers is not None or features_dtype is not None:
        spec["features"] = _features(spec.get("features"), features_layers, features_dtype)
    source = _dataset_source(dataset, dataset_url, dataset_format, messages_column, id_column)
    with CoordinatorClient(settings.coordinator_url, api_token=settings.api_token) as client:
        if dry_run:
            _print_dry_run(client.dry_run(source, spec))
            return
        job = submit_when_ready(
            client,
            settings.coordinator_url,
            source,
            spec,
            job_id,
            wait_s=settings.wait_for_servers_s,
            console=console,
        )
        typer.echo(job["id"])
        if wait:
            raise typer.Exit(
                wait_for_job_exit(
                    client,
                    job["id"],
                    console,
                    coordinator_url=settings.coordinator_url,
                    progress_every_s=settings.progress_interval_s,
                )
            )


def _dataset_source(
    dataset: Path | None,
    url: str | None,
    fmt: str | None,
    messages_column: str | None,
    id_column: str | None,
) -> DatasetSource:
    """What to submit (or dry-run): the file or the reference, with its format and columns."""
    from datagen_cli.client import DatasetSource

    if (dataset is None) == (url is None):
        raise ConfigError("give a dataset file or --dataset-url URL (one of the two)")
    return DatasetSource(
        path=dataset, url=url, format=fmt, messages_column=messages_column, id_column=id_column
    )


def _features(base: object, layers: str | None, dtype: FeatureDtype | None) -> dict[str, Any]:
    """The spec's ``features`` with the flags on top (the spec validates them at submit)."""
    features: dict[str, Any] = dict(base) if isinstance(base, dict) else {}
    if layers is not None:
        try:
            features["layers"] = [int(part) for part in layers.split(",") if part.strip()]
        except ValueError as exc:
            raise ConfigError(
                f"--features-layers {layers!r}: give comma-separated layer ids, e.g. 2,16,29,32"
            ) from exc
    if dtype is not None:
        features["dtype"] = dtype.value
    if "layers" not in features:
        raise ConfigError(
            "--features-dtype needs layers: --features-layers IDS, or `features.layers` in --spec"
        )
    return features


def _print_dry_run(preview: dict[str, Any]) -> None:
    out = Console()
    for example in preview["examples"]:
        arm = f" · arm {example['arm']}" if example.get("arm") else ""
        out.rule(
            f"line {example['line']} · {example['sample_id']} · turn {example['turn']} · "
            f"{example['class']} · {example['prompt_tokens']} tokens{arm}"
        )
        out.print(example["prompt"], markup=False, highlight=False)
    # A recipe: one row rendered under every arm, so each arm's template variables show.
    for arm in preview.get("arms") or []:
        shown = f" · line {arm['line']} · {arm['prompt_tokens']} tokens" if arm["prompt"] else ""
        out.rule(
            f"arm {arm['name']} · share {arm['share']:.0%}{shown} · "
            f"kwargs {json.dumps(arm['chat_template_kwargs'])}"
        )
        if arm.get("refused"):
            out.print(f"refused under this arm: {arm['refused']}", markup=False)
        elif arm["prompt"] is not None:
            out.print(arm["prompt"], markup=False, highlight=False)
        out.print(f"sampling: {json.dumps(arm['sampling'])}", markup=False)
    out.rule("summary")
    out.print(_sample_line(preview), markup=False)
    out.print(_input_line(preview), markup=False)
    out.print(_estimate_line(preview), markup=False)
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


def _sample_line(preview: dict[str, Any]) -> str:
    classes = preview["classes"]
    return (
        f"sampled {preview['rows_sampled']} rows: "
        f"{preview['prompts']} prompts, {classes['short']} short / {classes['long']} long, "
        f"{len(preview['rejected'])} rejected, {preview['prompt_tokens_sampled']} prompt tokens"
    )


def _input_line(preview: dict[str, Any]) -> str:
    """What the input holds: its rows where its format knows them, and bytes for plain JSONL."""
    total = preview.get("rows_total")
    rows = f"{total} rows" if total is not None else "rows unknown without reading it all"
    held = f"{preview.get('format')} input, {rows}"
    if preview.get("bytes_total") is not None:
        held += f"; {preview['bytes_sampled']} of {preview['bytes_total']} bytes sampled"
    return held


def _estimate_line(preview: dict[str, Any]) -> str:
    if preview.get("estimated_prompts") is None:
        return "estimated for the whole input: unknown"
    return (
        f"estimated for the whole input: {preview['estimated_rows']} rows, "
        f"{preview['estimated_prompts']} prompts, "
        f"{preview['estimated_prompt_tokens']} prompt tokens"
    )
