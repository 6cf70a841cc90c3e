"""Options that several commands share, each defined once."""

from __future__ import annotations

from typing import Annotated

import typer

from datagen.settings import DEFAULT_COORDINATOR_URL, DEFAULT_PROGRESS_INTERVAL_S, MIN_PROGRESS_INTERVAL_S

__all__ = ["CoordinatorOption", "ProgressEverySOption"]

# Every command that talks to a coordinator takes this option.
CoordinatorOption = Annotated[
    str | None,
    typer.Option(
        "--coordinator",
        help=f"coordinator URL (DATAGEN_COORDINATOR_URL, default {DEFAULT_COORDINATOR_URL})",
    ),
]

# `submit --wait` and `wait`; not given (None): ClientSettings.progress_interval_s.
ProgressEverySOption = Annotated[
    float | None,
    typer.Option(
        min=MIN_PROGRESS_INTERVAL_S,
        help="when stderr is not a terminal (a log, nohup, CI): the progress line every this many seconds "
        f"(DATAGEN_PROGRESS_INTERVAL_S, default {DEFAULT_PROGRESS_INTERVAL_S:g})",
    ),
]
