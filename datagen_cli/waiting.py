"""``submit --wait``, ``wait`` (and the demo): a progress line until a job ends, and the exit code it
ends with.

On a terminal the line is redrawn in place; elsewhere (a log, nohup, CI) it is printed at the first
answer, every ``progress_every_s`` and at the end, as tqdm does in a log.

The line fits the console: where the fields do not fit, whole fields drop out, least useful first
(the time to the first record and the tail time, the job id, then the elapsed time, the bar, tokens
per second, the ETA, the rejected count); the numbers left are never cut. Progress counts and the
state always stay.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderResult
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from datagen.settings import DEFAULT_PROGRESS_INTERVAL_S
from datagen.states import JobState

if TYPE_CHECKING:
    from datagen_cli.client import CoordinatorClient

__all__ = [
    "EXIT_ALL_DONE",
    "EXIT_JOB_FAILED",
    "EXIT_SOME_FAILED",
    "JobLine",
    "wait_for_job",
    "wait_for_job_exit",
]

EXIT_ALL_DONE = 0
EXIT_SOME_FAILED = 1
EXIT_JOB_FAILED = 2
WAIT_POLL_S = 1.0
MIN_POLL_S = 0.05
REFRESH_PER_S = 4
BAR_MIN_WIDTH = 10
BAR_MAX_WIDTH = 40
JOB_ID_SHOWN = 12
# Seconds between the plain progress lines when the console is not a terminal.
_ENDED = (JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED)


@dataclass(frozen=True)
class _Field:
    keep: int  # fields with the lowest value drop out first
    text: str = ""
    style: str = ""
    detail: bool = False  # one of the " · "-joined details
    bar: bool = False


@dataclass
class JobLine:
    """One job's progress as one line that fits ``options.max_width`` (a rich renderable).

    ``job`` is the coordinator's ``GET /jobs/{id}`` body (``None`` until the first poll);
    ``started_s`` is a ``time.monotonic()`` reading, the start of the elapsed time shown.
    """

    job_id: str
    job: dict[str, Any] | None = None
    started_s: float = field(default_factory=time.monotonic)
    bar: bool = True  # a log (not a terminal) shows no bar

    def _fields(self) -> list[_Field]:
        """Every field, in display order."""
        job = self.job or {}
        state = str(job.get("state", "waiting"))
        finished = int(job.get("done", 0)) + int(job.get("failed", 0)) + int(job.get("cancelled", 0))
        known_total = bool(job) and state != JobState.INGESTING
        total = f"{job.get('total', 0)}" if known_total else "?"
        fields = [
            _Field(10, f"job {self.job_id[:JOB_ID_SHOWN]}", style="bold"),
            *([_Field(30, bar=True)] if self.bar else []),
            _Field(100, f"{finished}/{total}"),
            _Field(90, state, detail=True),
            _Field(80, f"failed {job.get('failed', 0)}", detail=True),
            _Field(70, f"rejected {job.get('rejected', 0)}", detail=True),
            _Field(40, f"{float(job.get('tokens_per_s') or 0):.0f} tok/s", detail=True),
        ]
        if job.get("eta_s"):
            fields.append(_Field(60, f"ETA {float(job['eta_s']):.0f}s", detail=True))
        if job.get("time_to_first_record_s") is not None:
            fields.append(_Field(5, f"first record {float(job['time_to_first_record_s']):.1f}s", detail=True))
        if job.get("tail_s") is not None:
            fields.append(_Field(8, f"tail {float(job['tail_s']):.1f}s", detail=True))
        elapsed_s = int(time.monotonic() - self.started_s)
        fields.append(_Field(20, str(timedelta(seconds=max(elapsed_s, 0)))))
        return fields

    def _fitting(self, max_width: int) -> tuple[list[_Field], int]:
        """The fields that fit in ``max_width`` cells, and the bar's width (0: no bar)."""
        kept = self._fields()
        while True:
            width = _width(kept)
            if width <= max_width or len(kept) <= 2:
                break
            kept.remove(min(kept, key=lambda f: f.keep))
        has_bar = any(f.bar for f in kept)
        return kept, min(BAR_MAX_WIDTH, BAR_MIN_WIDTH + max_width - width) if has_bar else 0

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        kept, bar_width = self._fitting(options.max_width)
        texts = [Text(" · ".join(f.text for f in group), style=group[0].style) for group in _groups(kept)]
        if not bar_width:
            # Plain text: where even the progress and the state do not fit, it wraps between words.
            yield Text(" ").join(texts)
            return
        grid = Table.grid(padding=(0, 1))
        cells: list[ProgressBar | Text] = []
        for group, text in zip(_groups(kept), texts, strict=True):
            grid.add_column(width=bar_width if group[0].bar else None, no_wrap=True)
            cells.append(self._bar(bar_width) if group[0].bar else text)
        grid.add_row(*cells)
        yield grid

    def _bar(self, width: int) -> ProgressBar:
        job = self.job or {}
        if not job or job.get("state") == JobState.INGESTING:
            return ProgressBar(total=None, width=width)
        finished = int(job.get("done", 0)) + int(job.get("failed", 0)) + int(job.get("cancelled", 0))
        return ProgressBar(total=max(int(job.get("total", 0)), 1), completed=finished, width=width)


def _groups(fields: list[_Field]) -> Iterator[list[_Field]]:
    """Columns: each field alone, except consecutive details, which share one column."""
    group: list[_Field] = []
    for f in fields:
        if f.detail and group and group[-1].detail:
            group.append(f)
            continue
        if group:
            yield group
        group = [f]
    if group:
        yield group


def _width(fields: list[_Field]) -> int:
    """Cells the fields take on one line (the bar at its least), with their separators."""
    groups = list(_groups(fields))
    widths = [
        BAR_MIN_WIDTH if group[0].bar else cell_len(" · ".join(f.text for f in group)) for group in groups
    ]
    return sum(widths) + len(widths) - 1


def _poll_until_ended(
    client: CoordinatorClient,
    job_id: str,
    line: JobLine,
    show: Callable[[], None],
    poll_s: Callable[[], float] = lambda: WAIT_POLL_S,
) -> None:
    """Poll the job into ``line``, calling ``show`` after each answer, until it ends; each poll
    takes ``poll_s()`` unless the job ends first."""
    while True:
        asked_s, wait_s = time.monotonic(), poll_s()
        # A long poll: the coordinator answers as soon as the job ends, so the command exits
        # then, not at the next poll; otherwise after wait_s, to refresh the line.
        line.job = job = client.job(job_id, wait_s=wait_s)
        show()
        if job["state"] in _ENDED:
            return
        # A coordinator of a release without the long poll answers at once.
        time.sleep(max(0.0, wait_s - (time.monotonic() - asked_s)))


def _poll_into_log(
    client: CoordinatorClient, job_id: str, console: Console, line: JobLine, every_s: float
) -> None:
    """The line at the first answer, every ``every_s`` and at the end, for a console that is not a
    terminal (where a live line shows nothing until the end). A poll ends by the next line's time."""
    next_s = time.monotonic()

    def show() -> None:
        nonlocal next_s
        ended = line.job is not None and line.job["state"] in _ENDED
        if ended or time.monotonic() >= next_s:
            console.print(line)
            next_s = time.monotonic() + every_s

    def poll_s() -> float:
        return min(WAIT_POLL_S, max(MIN_POLL_S, next_s - time.monotonic()))

    _poll_until_ended(client, job_id, line, show, poll_s)


def wait_for_job(
    client: CoordinatorClient,
    job_id: str,
    console: Console,
    *,
    progress_every_s: float = DEFAULT_PROGRESS_INTERVAL_S,
) -> int:
    """Show the job's progress until it ends; return the exit code of ``submit --wait``."""
    line = JobLine(job_id, bar=console.is_terminal)
    if console.is_terminal:
        with Live(line, console=console, refresh_per_second=REFRESH_PER_S, transient=False) as live:
            _poll_until_ended(client, job_id, line, live.refresh)
    else:
        _poll_into_log(client, job_id, console, line, progress_every_s)
    job = line.job or {}
    if job["state"] != JobState.COMPLETED:
        console.print(f"[red]job {job_id} {job['state']}: {job.get('error') or ''}")
        return EXIT_JOB_FAILED
    if job["failed"]:
        console.print(f"[yellow]{job['failed']} prompts failed; see GET /jobs/{job_id}/errors?kind=failed")
        return EXIT_SOME_FAILED
    return EXIT_ALL_DONE


def wait_for_job_exit(
    client: CoordinatorClient,
    job_id: str,
    console: Console,
    *,
    coordinator_url: str,
    progress_every_s: float = DEFAULT_PROGRESS_INTERVAL_S,
) -> int:
    """:func:`wait_for_job` for ``submit --wait`` and ``wait``: a job whose every row was rejected
    generated nothing, and that is not success."""
    code = wait_for_job(client, job_id, console, progress_every_s=progress_every_s)
    if code != EXIT_ALL_DONE:
        return code
    job = client.job(job_id)
    if job["total"] or not job["rejected"]:
        return code
    console.print(
        f"no prompt was accepted: all {job['rejected']} rows were rejected; see why with "
        f"curl {coordinator_url.rstrip('/')}/jobs/{job_id}/errors?kind=rejected",
        style="red",
        markup=False,
    )
    return EXIT_SOME_FAILED
