"""The one Typer app every command registers on, the shared console, exit codes and ``main()``."""

from __future__ import annotations

import sys

import typer
from rich.console import Console

from datagen.errors import DatagenError

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="Exact-token EAGLE-3 training data from SGLang."
)
console = Console(stderr=True)

# `submit --wait` exits with datagen.progress's codes (0 all done, 1 some prompts failed, 2 job failed).
EXIT_ERROR = 3
EXIT_CHECK_FAILED = 1  # `datagen report`: a token-structure check failed


def main() -> None:
    try:
        app(standalone_mode=True)
    except DatagenError as exc:
        console.print(f"[red]error:[/red] {exc}")
        sys.exit(EXIT_ERROR)
