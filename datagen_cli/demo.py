"""``datagen demo``: the whole pipeline on this machine."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from datagen_cli._app import app, console, examples


@app.command(
    epilog=examples(
        "datagen demo",
        "datagen demo --data-dir /tmp/demo --dataset examples/prompts.jsonl",
    )
)
def demo(
    data_dir: Annotated[
        Path, typer.Option(help="directory for the records and the processes' logs (logs/)")
    ] = Path("./datagen-demo"),
    dataset: Annotated[
        Path | None,
        typer.Option(help="JSONL dataset (default: the ~300 packaged demo prompts, examples/prompts.jsonl)"),
    ] = None,
) -> None:
    """Run the whole pipeline on this machine, nothing to configure.

    A private Redis, a simulated SGLang server, a coordinator and a worker run as separate
    processes; the demo submits the dataset, shows progress, prints a summary and stops them all.
    """
    from datagen_cli.demo_run import run_demo

    raise typer.Exit(run_demo(data_dir, dataset, console))
