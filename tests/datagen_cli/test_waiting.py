"""The ``submit --wait`` progress line at the widths users have: fields drop out whole, numbers never cut."""

from __future__ import annotations

import re
import time
from typing import Any

import pytest
from rich.cells import cell_len
from rich.console import Console

from datagen_cli.waiting import JobLine

JOB_ID = "0123456789abcdef0123"
ELAPSED_S = 3725  # 1:02:05
RUNNING: dict[str, Any] = {
    "state": "running",
    "total": 27300,
    "done": 12000,
    "failed": 3,
    "cancelled": 0,
    "rejected": 12,
    "tokens_per_s": 123456.7,
    "eta_s": 3600.0,
}
# Every whole number the running line may show; a cut one ("2730", "12…") is none of these.
RUNNING_NUMBERS = {"0123456789", "12003", "27300", "3", "12", "123457", "3600", "1", "02", "05"}
# The demo's final line (issue 14, item 6: it came out as "273… completed · … 0:00:…").
DEMO_DONE: dict[str, Any] = {
    "state": "completed",
    "total": 273,
    "done": 273,
    "failed": 0,
    "cancelled": 0,
    "rejected": 0,
    "tokens_per_s": 2345.0,
    "eta_s": None,
}


def _render(job: dict[str, Any] | None, width: int) -> list[str]:
    console = Console(width=width, record=True, force_terminal=False, color_system=None)
    console.print(JobLine(JOB_ID, job, started_s=time.monotonic() - ELAPSED_S))
    return console.export_text().splitlines()


def test_full_line_at_200_columns() -> None:
    [line] = _render(RUNNING, 200)
    assert line.startswith("job 0123456789ab ━")
    assert line.endswith(
        " 12003/27300 running · failed 3 · rejected 12 · 123457 tok/s · ETA 3600s 1:02:05"
    ), line
    assert cell_len(line) <= 200


def test_line_at_80_columns_keeps_every_number_whole() -> None:
    [line] = _render(RUNNING, 80)
    assert cell_len(line) <= 80
    assert "…" not in line
    assert "12003/27300 running · failed 3 · rejected 12 · 123457 tok/s · ETA 3600s" in line
    assert set(re.findall(r"\d+", line)) <= RUNNING_NUMBERS


def test_demo_final_line_at_80_columns() -> None:
    [line] = _render(DEMO_DONE, 80)
    assert cell_len(line) <= 80
    assert "273/273 completed · failed 0 · rejected 0 · 2345 tok/s 1:02:05" in line
    assert "━" in line  # room for the bar too


@pytest.mark.parametrize("width", range(20, 201, 3))
def test_every_width_drops_fields_whole(width: int) -> None:
    [line] = _render(RUNNING, width)
    assert cell_len(line) <= width
    assert "…" not in line
    assert "12003/27300 running" in line  # the progress and the state always stay
    assert set(re.findall(r"\d+", line)) <= RUNNING_NUMBERS
    # A field is there whole or not at all.
    for label, value in (("failed", "3"), ("rejected", "12"), ("ETA", "3600s")):
        assert (label in line) == (f"{label} {value}" in line), line
    assert ("tok/s" in line) == ("123457 tok/s" in line), line


@pytest.mark.parametrize(
    ("job", "expected"),
    [
        (None, "0/? waiting · failed 0 · rejected 0 · 0 tok/s"),
        (dict(RUNNING, state="ingesting", eta_s=None), "12003/? ingesting · failed 3 · rejected 12"),
    ],
)
def test_before_the_total_is_known(job: dict[str, Any] | None, expected: str) -> None:
    [line] = _render(job, 80)
    assert expected in line
    assert cell_len(line) <= 80


TIMED = dict(RUNNING, time_to_first_record_s=0.84, tail_s=12.25)


def test_time_to_first_record_and_tail_show_where_they_fit() -> None:
    [line] = _render(TIMED, 200)
    assert line.endswith(" · ETA 3600s · first record 0.8s · tail 12.2s 1:02:05"), line
    # At 80 columns they are the first to go; everything the plain line shows stays.
    [narrow] = _render(TIMED, 80)
    assert "first record" not in narrow and "tail" not in narrow
    assert narrow == _render(RUNNING, 80)[0]


@pytest.mark.parametrize("width", range(20, 201, 7))
def test_timing_fields_drop_out_whole(width: int) -> None:
    [line] = _render(TIMED, width)
    assert cell_len(line) <= width
    assert "…" not in line
    assert ("first record" in line) == ("first record 0.8s" in line), line
    assert ("tail" in line) == ("tail 12.2s" in line), line
    assert set(re.findall(r"\d+", line)) <= RUNNING_NUMBERS | {"0", "8", "12", "2"}


# In a log (stderr not a terminal: nohup, CI, a pod log), the line comes without the bar (issue 39).
def _log_line(job: dict[str, Any], width: int) -> str:
    console = Console(width=width, record=True, force_terminal=False, color_system=None)
    console.print(JobLine(JOB_ID, job, started_s=time.monotonic() - ELAPSED_S, bar=False))
    [line] = console.export_text().splitlines()
    return line


def test_log_line_has_no_bar_and_keeps_the_job_id_where_it_fits() -> None:
    assert _log_line(DEMO_DONE, 80) == (
        "job 0123456789ab 273/273 completed · failed 0 · rejected 0 · 2345 tok/s 1:02:05"
    )
    assert _log_line(TIMED, 200) == (
        "job 0123456789ab 12003/27300 running · failed 3 · rejected 12 · 123457 tok/s · ETA 3600s · "
        "first record 0.8s · tail 12.2s 1:02:05"
    )
    assert _log_line(RUNNING, 80) == (
        "12003/27300 running · failed 3 · rejected 12 · 123457 tok/s · ETA 3600s 1:02:05"
    )
