"""``datagen demo``: the whole pipeline on this machine."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from datagen.cli._app import app, console


@app.command()
def demo(
    data_dir: Annotated[Path, typer.Option(help="where records go")] = Path("./datagen-data"),
    dataset: Annotated[
        Path | None,
        typer.Option(help="JSONL dataset (default: the ~300 packaged demo prompts, examples/prompts.jsonl)"),
    ] = None,
) -> None:
    """Run everything locally: private Redis, simulated SGLang, coordinator and worker."""
    from datagen.cli.demo_run import run_demo

    raise typer.Exit(run_demo(data_dir, dataset, console))
