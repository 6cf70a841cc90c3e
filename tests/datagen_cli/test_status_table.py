"""`datagen status`'s jobs table at the widths users have (issue 39): every job's whole id and its
state are always there, lesser columns drop out whole, nothing is cut; `--wide` keeps every column."""

from __future__ import annotations

from typing import Any

import pytest
from rich.cells import cell_len
from rich.console import Console

from datagen_cli._tables import fitted_table, widen
from datagen_cli.watch import JOB_COLUMNS, _job_row

JOBS: list[dict[str, Any]] = [
    {
        "id": "f26f568ff0e84d5bb736d1c6524160d4",
        "state": "running",
        "paused": True,
        "priority": "high",
        "weight": 2.0,
        "share": {"recent": 0.5, "target": 0.625},
        "total": 27300,
        "done": 12000,
        "failed": 3,
        "rejected": 12,
        "in_flight": 64,
        "tokens_per_s": 123456.7,
        "eta_s": 3600.0,
        "time_to_first_record_s": 0.84,
        "tail_s": None,
    },
    {
        "id": "a-job-id-that-a-user-chose-long-1",
        "state": "completed",
        "total": 273,
        "done": 270,
        "failed": 3,
        "rejected": 0,
        "in_flight": 0,
        "tokens_per_s": 2345.0,
        "eta_s": None,
        "time_to_first_record_s": 0.5,
        "tail_s": 12.25,
    },
]
# The whole row of the first job, every column (`--wide`).
FIRST_ROW = (
    "│ f26f568ff0e84d5bb736d1c6524160d4  │ running (paused) │ high ×2  │ 50% / 62%        │ 27300 │ 12000 "
    "│ 3      │ 12       │ 64        │ 123457 │ 3600  │ 0.8          │        │"
)


def _render(width: int, *, wide: bool = False) -> list[str]:
    console = Console(width=width, record=True, force_terminal=False, color_system=None)
    table = fitted_table(console, "jobs", JOB_COLUMNS, [_job_row(job) for job in JOBS], wide=wide)
    if wide:
        widen(console, [table])
    console.print(table)
    return console.export_text().splitlines()


@pytest.mark.parametrize("width", range(60, 221, 8))
def test_every_whole_id_and_state_at_every_width(width: int) -> None:
    lines = _render(width)
    assert all(cell_len(line) <= width for line in lines), lines
    assert not any("…" in line for line in lines), lines
    [first] = [line for line in lines if JOBS[0]["id"] in line]
    [second] = [line for line in lines if JOBS[1]["id"] in line]
    assert "│ running (paused) │" in first and "│ completed        │" in second, lines


def test_80_columns_keeps_the_counts_first() -> None:
    # A paused job's state takes 16 cells: here the counts of prompts done and in all fit beside it.
    lines = _render(80)
    assert lines[-1].strip() == "9 more columns: --wide"
    header = lines[2]
    assert [cell.strip() for cell in header.strip("┃").split("┃")] == ["job", "state", "total", "done"]


def test_wide_keeps_every_column_at_80_columns() -> None:
    lines = _render(80, wide=True)
    assert FIRST_ROW in lines, "\n".join(lines)
    assert "1st record s" in lines[2] and "tail s" in lines[2]
    assert "--wide" not in "\n".join(lines)
