"""Views of a `datagen.report.JobReport`: a compact terminal view (rich), and files: report.json,
PNG histograms (matplotlib's Agg renderer, no display needed) and a self-contained report.html that
embeds them as base64.

This module reads a report through :class:`ReportView`, the part of ``JobReport`` it shows, so the
views never import the scan (:mod:`datagen.report.build`) and can show any object of that shape.
"""

from __future__ import annotations

import base64
import html
import io
import json
from collections import Counter
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from datagen.errors import StorageError
from datagen.report.arms import ArmTally
from datagen.report.stats import LENGTH_EDGES, LengthHistogram

__all__ = ["CheckView", "ConversationsView", "ReportView", "print_report", "write_report"]

TOP_PARTITIONS = 20
BAR_WIDTH = 40
EXAMPLES_SHOWN = 3
PLOT_SIZE_IN = (8.0, 3.6)
PLOT_DPI = 100
_STATUS_STYLE = {
    "ok": "[green]ok[/green]",
    "warn": "[yellow]warn[/yellow]",
    "fail": "[bold red]FAIL[/bold red]",
}


class CheckView(Protocol):
    """What the views show of one ``datagen.report.Check``."""

    @property
    def name(self) -> str: ...
    @property
    def description(self) -> str: ...
    @property
    def status(self) -> StrEnum: ...
    @property
    def found(self) -> int: ...
    @property
    def examples(self) -> list[str]: ...


class ConversationsView(Protocol):
    """What the views show of a ``datagen.report.conversations.ConversationTally``."""

    @property
    def conversations(self) -> int: ...
    @property
    def turns_reached(self) -> Counter[int]: ...
    @property
    def stopped(self) -> Counter[str]: ...
    @property
    def stopped_examples(self) -> Mapping[str, list[str]]: ...
    @property
    def records(self) -> int: ...
    @property
    def regenerated(self) -> int: ...
    @property
    def regenerated_share(self) -> float: ...


class FeaturesView(Protocol):
    """What the views show of a ``datagen.report.features.FeatureTally``."""

    @property
    def reasons(self) -> Counter[str]: ...
    def summary(self) -> str: ...


class ReportView(Protocol):
    """What the views show of a ``datagen.report.JobReport``."""

    @property
    def job_id(self) -> str: ...
    @property
    def records(self) -> int: ...
    @property
    def unique(self) -> int: ...
    @property
    def by_finish(self) -> Counter[str]: ...
    @property
    def by_partition(self) -> Counter[str]: ...
    @property
    def by_partition_finish(self) -> Counter[tuple[str, str]]: ...
    @property
    def by_class(self) -> Counter[str]: ...
    @property
    def prompt_lengths(self) -> LengthHistogram: ...
    @property
    def output_lengths(self) -> Mapping[str, LengthHistogram]: ...
    @property
    def checks(self) -> Mapping[str, CheckView]: ...
    @property
    def conversations(self) -> ConversationsView | None: ...
    @property
    def features(self) -> FeaturesView | None: ...
    @property
    def arms(self) -> ArmTally | None: ...
    @property
    def failed(self) -> bool: ...
    def to_json(self) -> dict[str, Any]: ...


def _partition_rows(report: ReportView) -> list[tuple[str, int, dict[str, int]]]:
    finishes = sorted(report.by_finish)
    ranked = report.by_partition.most_common()
    rows = [
        (p, n, {f: report.by_partition_finish.get((p, f), 0) for f in finishes})
        for p, n in ranked[:TOP_PARTITIONS]
    ]
    rest = ranked[TOP_PARTITIONS:]
    if rest:
        other = {f: sum(report.by_partition_finish.get((p, f), 0) for p, _ in rest) for f in finishes}
        rows.append((f"other ({len(rest)})", sum(n for _, n in rest), other))
    return rows


def _length_rows(report: ReportView) -> list[tuple[str, LengthHistogram]]:
    rows = [("prompt", report.prompt_lengths)]
    rows += [(f"output ({f})", h) for f, h in sorted(report.output_lengths.items())]
    return rows


def _combined_outputs(report: ReportView) -> LengthHistogram:
    combined = LengthHistogram()
    for histogram in report.output_lengths.values():
        combined.counts += histogram.counts
        combined.count += histogram.count
    return combined


def _fmt(value: float | int | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.1f}" if isinstance(value, float) else f"{value:,}"


def _length_cells(h: LengthHistogram) -> list[str]:
    """records, min, mean, p50, p90, p99 and max, as the lengths tables show them."""
    cells = (h.count, h.minimum, h.mean, h.quantile(0.5), h.quantile(0.9), h.quantile(0.99), h.maximum)
    return [_fmt(v) for v in cells]


_LENGTH_HEADER = ["records", "min", "mean", "p50 ≤", "p90 ≤", "p99 ≤", "max"]


def _bars(title: str, histogram: LengthHistogram) -> Table:
    table = Table("tokens", "records", "", title=title, box=None, title_justify="left")
    rows = histogram.octaves()
    peak = max((count for _, _, count in rows), default=0) or 1
    for low, high, count in rows:
        label = f"{low:,}" if low == high else f"{low:,}-{high:,}"
        table.add_row(label, f"{count:,}", "█" * round(BAR_WIDTH * count / peak))
    return table


def _conversation_summary(c: ConversationsView) -> str:
    """One line, the same in every view."""
    reached = ", ".join(f"{n}: {count:,}" for n, count in sorted(c.turns_reached.items()))
    return (
        f"{c.conversations:,} conversations (multi-turn all); turns recorded {reached}; "
        f"regenerated history: {c.regenerated:,} of {c.records:,} records ({c.regenerated_share:.0%}); "
        f"stopped before their last turn: {c.stopped.total():,}"
    )


def _stopped_rows(c: ConversationsView) -> list[tuple[str, int, list[str]]]:
    return [(reason, n, c.stopped_examples.get(reason, [])) for reason, n in c.stopped.most_common()]


def _print_conversations(c: ConversationsView, console: Console) -> None:
    console.print(f"[bold]conversations[/bold]: {_conversation_summary(c)}")
    if c.stopped:
        table = Table("reason", "conversations", "e.g.", title="conversations stopped before their last turn")
        for reason, count, examples in _stopped_rows(c):
            # Messages are the worker's text (tool names, template errors): never rich markup.
            table.add_row(escape(reason), f"{count:,}", escape("\n".join(examples[:EXAMPLES_SHOWN])))
        console.print(table)


def _print_arms(arms: ArmTally, console: Console) -> None:
    header, rows = arms.summary()
    table = Table(*header, title="records by arm")
    for row in rows:
        table.add_row(*row)
    console.print(table)
    lengths = Table("tokens", *_LENGTH_HEADER, title="lengths by arm")
    for name, h in arms.lengths():
        lengths.add_row(name, *_length_cells(h))
    console.print(lengths)
    for name, column, value, distinct in arms.settings():
        others = f" ({distinct} distinct; the most common shown)" if distinct != "1" else ""
        console.print(f"  {name} {column}{others}: {value}", markup=False, highlight=False)


def print_report(report: ReportView, console: Console) -> None:
    console.print(f"[bold]job {report.job_id}[/bold]: {report.records:,} records, {report.unique:,} unique")
    finishes = sorted(report.by_finish)
    partitions = Table("partition", "records", *finishes, title="records by partition and finish")
    for name, total, by_finish in _partition_rows(report):
        partitions.add_row(name, f"{total:,}", *(f"{by_finish[f]:,}" for f in finishes))
    partitions.add_row("[bold]all", f"{report.unique:,}", *(f"{report.by_finish[f]:,}" for f in finishes))
    console.print(partitions)
    console.print("classes: " + ", ".join(f"{c} {n:,}" for c, n in sorted(report.by_class.items())))
    lengths = Table("tokens", *_LENGTH_HEADER, title="lengths")
    for name, h in _length_rows(report):
        lengths.add_row(name, *_length_cells(h))
    console.print(lengths)
    console.print(_bars("prompt lengths", report.prompt_lengths))
    console.print(_bars("output lengths", _combined_outputs(report)))
    if report.arms is not None:
        _print_arms(report.arms, console)
    if report.conversations is not None:
        _print_conversations(report.conversations, console)
    if report.features is not None:
        console.print(f"[bold]features[/bold]: {report.features.summary()}", markup=True, highlight=False)
        for reason, n in report.features.reasons.most_common(EXAMPLES_SHOWN):
            console.print(f"  without features, {n:,}: {reason}", markup=False)
    checks = Table("check", "status", "found", "what", title="checks")
    for check in report.checks.values():
        examples = "; ".join(check.examples[:EXAMPLES_SHOWN])
        what = check.description + (f"\n[dim]e.g. {examples}[/dim]" if examples else "")
        checks.add_row(check.name, _STATUS_STYLE[check.status.value], f"{check.found:,}", what)
    console.print(checks)
    verdict = (
        "[bold red]checks failed[/bold red]" if report.failed else "[bold green]all checks pass[/bold green]"
    )
    console.print(verdict)


# -- files --------------------------------------------------------------------------------------------


def _plot(histograms: list[tuple[str, LengthHistogram]], title: str) -> bytes:
    from matplotlib.figure import Figure  # heavy import, only when plots are written

    figure = Figure(figsize=PLOT_SIZE_IN, dpi=PLOT_DPI, layout="constrained")
    axes = figure.subplots()
    # Bins from 1 token up (a log axis has no 0); the open last bin is drawn one quarter-octave wide.
    edges = [*LENGTH_EDGES[1:], int(LENGTH_EDGES[-1] * 2 ** (1 / 4))]
    for label, histogram in histograms:
        axes.stairs(histogram.counts[1:], edges, label=f"{label} ({histogram.count:,})")
    axes.set_xscale("log", base=2)
    axes.set_xlabel("tokens")
    axes.set_ylabel("records")
    axes.set_title(title)
    populated = [h for _, h in histograms if h.count and h.maximum]
    if populated:
        low = min(max(h.minimum or 1, 1) for h in populated)
        high = max(h.maximum or 1 for h in populated)
        axes.set_xlim(max(1, low // 2), max(2, high * 2))
    if histograms:
        axes.legend(loc="upper right")
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def _html_table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


_CSS = (
    "body{font-family:system-ui,sans-serif;margin:2em;max-width:60em}"
    "table{border-collapse:collapse;margin:1em 0}"
    "td,th{border:1px solid #ccc;padding:.25em .6em;text-align:left}"
    ".ok{color:#176f2c}.warn{color:#a56a00}.fail{color:#b00020;font-weight:bold}img{max-width:100%}"
)


def _html(report: ReportView, plots: dict[str, bytes]) -> str:
    finishes = sorted(report.by_finish)
    partitions = [
        [name, f"{total:,}", *(f"{by[f]:,}" for f in finishes)] for name, total, by in _partition_rows(report)
    ]
    lengths = [
        [name, *(_fmt(v) for v in (h.count, h.minimum, h.mean, h.quantile(0.5), h.quantile(0.9), h.maximum))]
        for name, h in _length_rows(report)
    ]
    checks = "".join(
        f"<tr><td>{html.escape(c.name)}</td><td class='{c.status.value}'>{c.status.value}</td>"
        f"<td>{c.found:,}</td><td>{html.escape(c.description)}<br><small>"
        f"{html.escape('; '.join(c.examples))}</small></td></tr>"
        for c in report.checks.values()
    )
    images = "".join(
        f"<h2>{html.escape(name)}</h2><img alt='{html.escape(name)}' "
        f"src='data:image/png;base64,{base64.b64encode(png).decode('ascii')}'>"
        for name, png in plots.items()
    )
    verdict = "<p class='fail'>checks failed</p>" if report.failed else "<p class='ok'>all checks pass</p>"
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>datagen report {html.escape(report.job_id)}"
        f"</title><style>{_CSS}</style></head><body><h1>Job {html.escape(report.job_id)}</h1>"
        f"<p>{report.records:,} records, {report.unique:,} unique; classes: "
        f"{html.escape(', '.join(f'{c} {n:,}' for c, n in sorted(report.by_class.items())))}</p>{verdict}"
        f"<h2>Checks</h2><table><thead><tr><th>check</th><th>status</th><th>found</th><th>what</th></tr>"
        f"</thead><tbody>{checks}</tbody></table>"
        f"<h2>Records by partition and finish</h2>"
        f"{_html_table(['partition', 'records', *finishes], partitions)}"
        f"<h2>Lengths (tokens)</h2>"
        f"{_html_table(['', 'records', 'min', 'mean', 'p50 ≤', 'p90 ≤', 'max'], lengths)}"
        f"{_html_arms(report)}"
        f"{_html_conversations(report)}"
        f"{_html_features(report)}"
        f"{images}</body></html>"
    )


def _html_arms(report: ReportView) -> str:
    arms = report.arms
    if arms is None:
        return ""
    header, rows = arms.summary()
    lengths = [[name, *_length_cells(h)] for name, h in arms.lengths()]
    return (
        f"<h2>Records by arm</h2>{_html_table(header, rows)}"
        f"<h2>Lengths by arm (tokens)</h2>{_html_table(['', *_LENGTH_HEADER], lengths)}"
        f"<h2>Template variables and sampling by arm</h2>"
        f"{_html_table(['arm', 'column', 'most records carry', 'distinct'], arms.settings())}"
    )


def _html_conversations(report: ReportView) -> str:
    c = report.conversations
    if c is None:
        return ""
    stopped = [[reason, f"{n:,}", "; ".join(examples)] for reason, n, examples in _stopped_rows(c)]
    table = _html_table(["reason", "conversations", "examples"], stopped) if stopped else ""
    return f"<h2>Conversations</h2><p>{html.escape(_conversation_summary(c))}</p>{table}"


def _html_features(report: ReportView) -> str:
    f = report.features
    if f is None:
        return ""
    reasons = [[reason, f"{n:,}"] for reason, n in f.reasons.most_common()]
    table = _html_table(["without features because", "records"], reasons) if reasons else ""
    return f"<h2>Features</h2><p>{html.escape(f.summary())}</p>{table}"


def write_report(report: ReportView, out_dir: Path) -> list[Path]:
    """report.json, prompt_lengths.png, output_lengths.png (and output_lengths_by_arm.png for a job
    with a recipe) and report.html under ``out_dir``."""
    plots = {
        "prompt lengths": _plot([("prompts", report.prompt_lengths)], "prompt lengths"),
        "output lengths": _plot(
            [(f"finish {f}", h) for f, h in sorted(report.output_lengths.items())], "output lengths"
        ),
    }
    files = {
        "report.json": json.dumps(report.to_json(), indent=2).encode("utf-8"),
        "prompt_lengths.png": plots["prompt lengths"],
        "output_lengths.png": plots["output lengths"],
    }
    if report.arms is not None:
        by_arm = [
            (f"arm {name}", stats.all_outputs()) for name, stats, _ in report.arms.rows() if stats.records
        ]
        plots["output lengths by arm"] = files["output_lengths_by_arm.png"] = _plot(
            by_arm, "output lengths by arm"
        )
    files["report.html"] = _html(report, plots).encode("utf-8")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            (out_dir / name).write_bytes(data)
    except OSError as exc:
        raise StorageError(f"cannot write the report to {out_dir}: {exc}") from exc
    return [out_dir / name for name in files]
