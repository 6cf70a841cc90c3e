"""The docs site's pictures, written as SVG text into docs/images/.

- ``architecture.svg``: the processes and stores of a fleet and what passes between them
- ``prompt-path.svg``: one prompt's path, from ``POST /jobs`` to an exported line, with the module
  that takes each step (the modules are those of architecture.md's "One prompt" section)
- ``dashboard-<name>.svg``: each Grafana dashboard's panel layout (``gridPos``) and titles, read from
  ``dashboards/<name>.json``, so the map cannot drift from the dashboard

Run ``python docs/_tools/figures.py`` after changing a dashboard or the pictures' code;
``--check`` writes nothing and exits 1 when a committed picture differs from what this renders
(``tests/test_docs_figures.py`` checks the same). Standard library only.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "docs" / "images"
DASHBOARDS = ROOT / "dashboards"

FONT = "-apple-system, BlinkMacSystemFont, 'Segoe UI', Roboto, Helvetica, Arial, sans-serif"
MONO = "SFMono-Regular, Consolas, 'Liberation Mono', Menlo, monospace"
INK = "#1f2933"
MUTED = "#52606d"
LINE = "#3e4c59"
# Fills by kind of thing: processes, Redis, storage, servers, monitoring.
FILL = {
    "process": "#e3f2fd",
    "redis": "#fde8e8",
    "storage": "#e6f4ea",
    "server": "#fff4e0",
    "monitor": "#f0e9fb",
    "plain": "#ffffff",
}
STROKE = {
    "process": "#1e6bb8",
    "redis": "#c0392b",
    "storage": "#2e7d32",
    "server": "#b26a00",
    "monitor": "#6a3fb5",
    "plain": "#9aa5b1",
}
# Average glyph width at 12 px, for wrapping titles in a box (a little generous).
CHAR_W_12PX = 6.6


@dataclass(frozen=True)
class Box:
    x: float
    y: float
    w: float
    h: float

    @property
    def cx(self) -> float:
        return self.x + self.w / 2

    @property
    def bottom(self) -> float:
        return self.y + self.h

    @property
    def right(self) -> float:
        return self.x + self.w


class Svg:
    """An SVG document built element by element; ``text()`` gives the whole file."""

    def __init__(self, width: int, height: int, title: str) -> None:
        self.width = width
        self.height = height
        self.parts = [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" role="img" font-family="{escape(FONT, {chr(39): "&apos;"})}">',
            f"<title>{escape(title)}</title>",
            "<defs>"
            '<marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
            f'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="{LINE}"/></marker>'
            "</defs>",
            f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
        ]

    def rect(self, box: Box, kind: str = "plain", radius: int = 6, dashed: bool = False) -> None:
        dash = ' stroke-dasharray="5 4"' if dashed else ""
        self.parts.append(
            f'<rect x="{box.x:g}" y="{box.y:g}" width="{box.w:g}" height="{box.h:g}" rx="{radius}" '
            f'fill="{FILL[kind]}" stroke="{STROKE[kind]}" stroke-width="1.5"{dash}/>'
        )

    def label(
        self,
        x: float,
        y: float,
        text: str,
        size: int = 12,
        weight: str = "normal",
        anchor: str = "middle",
        color: str = INK,
        mono: bool = False,
        halo: bool = False,
    ) -> None:
        family = f' font-family="{escape(MONO, {chr(39): "&apos;"})}"' if mono else ""
        if halo:
            # A white backdrop keeps text readable where it crosses a line (start-anchored text).
            width = len(text) * (0.6 if mono else CHAR_W_12PX / 12) * size + 4
            self.parts.append(
                f'<rect x="{x - 2:g}" y="{y - size:g}" width="{width:.0f}" height="{size + 4}" '
                'fill="#ffffff"/>'
            )
        self.parts.append(
            f'<text x="{x:g}" y="{y:g}" font-size="{size}" font-weight="{weight}" text-anchor="{anchor}" '
            f'fill="{color}"{family}>{escape(text)}</text>'
        )

    def box(self, box: Box, kind: str, title: str, lines: Sequence[str] = ()) -> None:
        """A titled box, its title and lines centred."""
        self.rect(box, kind)
        top = box.y + (box.h - 16 - 15 * len(lines)) / 2 + 13
        self.label(box.cx, top, title, size=13, weight="bold")
        for n, line in enumerate(lines):
            self.label(box.cx, top + 17 + 15 * n, line, size=11, color=MUTED)

    def arrow(
        self,
        points: Sequence[tuple[float, float]],
        text: str = "",
        at: tuple[float, float] | None = None,
        dashed: bool = False,
        both: bool = False,
        anchor: str = "middle",
    ) -> None:
        path = " ".join(f"{x:g},{y:g}" for x, y in points)
        dash = ' stroke-dasharray="5 4"' if dashed else ""
        start = ' marker-start="url(#arrow)"' if both else ""
        self.parts.append(
            f'<polyline points="{path}" fill="none" stroke="{LINE}" stroke-width="1.4"{dash}{start} '
            'marker-end="url(#arrow)"/>'
        )
        if text and at is not None:
            self.label(at[0], at[1], text, size=11, color=INK, anchor=anchor)

    def text(self) -> str:
        return "\n".join([*self.parts, "</svg>"]) + "\n"


def wrap(text: str, width_px: float, size: int = 12) -> list[str]:
    """Words into lines that fit ``width_px`` at ``size`` px; a word longer than a line stays whole."""
    per_line = max(1, int(width_px / (CHAR_W_12PX * size / 12)))
    lines: list[str] = []
    for word in text.split():
        if lines and len(lines[-1]) + 1 + len(word) <= per_line:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return lines


# --- architecture ---------------------------------------------------------------------------------


def _gpu_node(svg: Svg, node: Box, name: str) -> Box:
    """A GPU node: its worker above its servers, one per GPU. Returns the worker's box."""
    svg.rect(node, "plain", radius=8, dashed=True)
    svg.label(node.x + 10, node.y + 18, name, size=12, weight="bold", anchor="start", color=MUTED)
    worker = Box(node.x + 20, node.y + 30, node.w - 40, 46)
    svg.box(worker, "process", "datagen worker", ["one asyncio process per node"])
    gap = 10
    width = (node.w - 40 - gap) / 2
    for n in range(2):
        server = Box(node.x + 20 + n * (width + gap), node.y + 116, width, 46)
        svg.box(server, "server", f"GPU {n if n == 0 else '…'}", ["SGLang · vLLM"])
        svg.arrow([(server.cx, worker.bottom), (server.cx, server.y)])
    svg.label(node.cx, worker.bottom + 24, "/generate", size=11)
    return worker


def architecture() -> str:
    svg = Svg(980, 560, "eagle3-datagen architecture")
    cli = Box(20, 60, 160, 64)
    coord = Box(240, 50, 210, 84)
    redis = Box(510, 40, 230, 104)
    prom = Box(800, 60, 160, 64)
    grafana = Box(800, 250, 160, 72)
    node1 = Box(240, 210, 230, 180)
    node2 = Box(510, 210, 230, 180)
    storage = Box(240, 450, 230, 84)
    exports = Box(540, 450, 200, 84)

    svg.box(cli, "process", "datagen CLI", ["submit · status · steer", "export · report"])
    svg.box(coord, "process", "Coordinator", ["FastAPI: jobs, queues, servers", "renders + tokenizes rows"])
    svg.box(redis, "redis", "Redis", ["RQ queues {ns}-short / {ns}-long", "backlogs · job hashes", "servers"])
    svg.box(prom, "monitor", "Prometheus", ["scrapes /metrics", "alerts.yml"])
    svg.box(grafana, "monitor", "Grafana", ["Fleet · KV pressure · Job"])
    svg.box(
        storage, "storage", "Storage (local or fsspec)", ["manifests · uploads", "Parquet shards + commits"]
    )
    svg.box(exports, "storage", "Exports", ["SpecForge · speculators · Parquet", "HTML report"])

    worker1 = _gpu_node(svg, node1, "GPU node 1")
    worker2 = _gpu_node(svg, node2, "GPU node N")

    svg.arrow([(cli.right, 92), (coord.x, 92)], "POST /jobs", at=(cli.right + 30, 84))
    svg.arrow([(coord.right, 92), (redis.x, 92)], "enqueue", at=(coord.right + 30, 84))
    svg.arrow([(560, redis.bottom), (worker1.cx, worker1.y)], "claim / ack", at=(430, 182), both=True)
    svg.arrow([(worker2.cx, redis.bottom), (worker2.cx, worker2.y)], "claim / ack", at=(672, 182), both=True)
    svg.arrow(
        [(node1.cx, node1.bottom), (node1.cx, storage.y)], "commit", at=(node1.cx + 8, 426), anchor="start"
    )
    svg.arrow([(node2.cx, node2.bottom), (storage.right - 20, storage.y)], "commit", at=(560, 426))
    svg.arrow(
        [(coord.x, 120), (215, 120), (215, 492), (storage.x, 492)],
        "uploads, manifests",
        at=(210, 300),
        anchor="end",
    )
    svg.arrow([(storage.right, 492), (exports.x, 492)], "export", at=(505, 484))
    svg.arrow([(cli.cx, cli.bottom), (cli.cx, 510), (storage.x, 510)], "datagen export", at=(cli.cx, 528))
    # Prometheus scrapes the coordinator, the workers and the servers.
    svg.arrow([(prom.cx, prom.y), (prom.cx, 22), (coord.cx, 22), (coord.cx, coord.y)], dashed=True)
    svg.arrow([(prom.x, 110), (775, 110), (775, 300), (node2.right, 300)], dashed=True)
    svg.label(612, 16, "scrape /metrics: coordinator, workers, servers", size=11, color=MUTED)
    svg.arrow(
        [(prom.cx + 20, prom.bottom), (prom.cx + 20, grafana.y)],
        "queries",
        at=(prom.cx + 26, 200),
        anchor="start",
    )
    return svg.text()


# --- one prompt's path ----------------------------------------------------------------------------

LANES = ("datagen CLI", "Coordinator", "Redis", "Worker", "SGLang / vLLM", "Storage")
LANE_KIND = ("process", "process", "redis", "process", "server", "storage")


@dataclass(frozen=True)
class Step:
    source: int
    target: int
    text: str
    module: str


# Each step: from lane, to lane (the same lane: work done there), what, and the module that does it.
PROMPT_STEPS = (
    Step(0, 1, "POST /jobs: spec + JSONL upload", "service/app.py"),
    Step(1, 5, "upload stored, manifest written", "service/coordinator.py"),
    Step(1, 1, "render + tokenize the row; hygiene; class", "service/admit.py"),
    Step(1, 2, "enqueue: the chunk lands (backlog, RQ job)", "datagen/control/ingest_chunks.py"),
    Step(3, 2, "claim: priority, then fair share", "workers/claim/admission.py"),
    Step(3, 4, "/generate with the prompt's ids", "workers/engines/sglang.py"),
    Step(4, 3, "output ids, read strictly", "workers/engines/sglang_replies.py"),
    Step(3, 5, "commit: Parquet shard sealed, commit object", "workers/run/writer.py"),
    Step(3, 2, "ack: the prompt counted done", "workers/run/finish.py"),
    Step(0, 5, "datagen export: committed records, deduplicated", "datagen/export/pipeline.py"),
)


def prompt_path() -> str:
    lane_w, left, top, row = 150, 20, 20, 50
    height = top + 60 + row * len(PROMPT_STEPS) + 30
    svg = Svg(left * 2 + lane_w * len(LANES), height, "One prompt's path, from POST /jobs to an export")
    centres = [left + lane_w * n + lane_w / 2 for n in range(len(LANES))]
    bottom = height - 14
    for n, name in enumerate(LANES):
        head = Box(centres[n] - 62, top, 124, 34)
        svg.rect(head, LANE_KIND[n])
        svg.label(centres[n], top + 22, name, size=13, weight="bold")
        svg.parts.append(
            f'<line x1="{centres[n]:g}" y1="{head.bottom:g}" x2="{centres[n]:g}" y2="{bottom:g}" '
            f'stroke="{STROKE[LANE_KIND[n]]}" stroke-width="1" stroke-dasharray="3 4"/>'
        )
    for n, step in enumerate(PROMPT_STEPS):
        y = top + 80 + row * n
        a, b = centres[step.source], centres[step.target]
        number = f"{n + 1}. "
        if step.source == step.target:
            svg.rect(Box(a - 8, y - 14, 16, 24), LANE_KIND[step.source], radius=3)
            text_x, anchor = a + 16, "start"
        else:
            svg.arrow([(a, y), (b, y)])
            text_x, anchor = min(a, b) + 6, "start"
        svg.label(text_x, y - 9, number + step.text, size=12, anchor=anchor, halo=True)
        svg.label(text_x, y + 16, step.module, size=10, anchor=anchor, color=MUTED, mono=True, halo=True)
    return svg.text()


# --- dashboards -----------------------------------------------------------------------------------

GRID_COLUMNS = 24
UNIT_W = 38
UNIT_H = 16
HEADER_H = 40


def _panels(dashboard: dict[str, Any]) -> Iterable[dict[str, Any]]:
    """Every panel, a collapsed row's panels after the row."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


METRIC = re.compile(r"datagen_[a-z0-9_]+|(?:sglang|vllm)(?::|\[:_\])[a-z0-9_]+")


def panel_metrics(panel: dict[str, Any]) -> list[str]:
    """The metric names a panel's queries read, in order, once each; a name matched in either
    form (``sglang[:_]token_usage``) in SGLang's and vLLM's colon form."""
    names: list[str] = []
    for target in panel.get("targets", []):
        for match in METRIC.findall(str(target.get("expr", ""))):
            name = match.replace("[:_]", ":")
            # A histogram's series by the histogram's name (no metric of ours or the engines' ends so).
            for suffix in ("_bucket", "_sum", "_count"):
                name = name.removesuffix(suffix)
            if name not in names:
                names.append(name)
    return names


def dashboard_map(dashboard: dict[str, Any]) -> str:
    panels = list(_panels(dashboard))
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    left = 16
    svg = Svg(
        left * 2 + GRID_COLUMNS * UNIT_W, HEADER_H + rows * UNIT_H + 16, f"{dashboard['title']}: panels"
    )
    svg.label(left, 26, str(dashboard["title"]), size=15, weight="bold", anchor="start")
    for panel in panels:
        grid = panel["gridPos"]
        box = Box(
            left + grid["x"] * UNIT_W + 2,
            HEADER_H + grid["y"] * UNIT_H + 2,
            grid["w"] * UNIT_W - 4,
            grid["h"] * UNIT_H - 4,
        )
        title = str(panel.get("title", ""))
        if panel.get("type") == "row":
            svg.label(
                box.x + 2, box.y + 12, title, size=13, weight="bold", anchor="start", color=STROKE["process"]
            )
            continue
        svg.rect(box, "process" if panel.get("type") == "timeseries" else "plain", radius=4)
        lines = wrap(title, box.w - 16)
        for n, line in enumerate(lines):
            svg.label(box.x + 8, box.y + 17 + 15 * n, line, size=12, weight="bold", anchor="start")
        # The metrics it reads, as many as fit above the panel's type.
        room = int((box.bottom - 22 - (box.y + 17 + 15 * len(lines))) // 13)
        metrics = panel_metrics(panel)
        shown = (
            metrics if len(metrics) <= room else [*metrics[: room - 1], f"and {len(metrics) - room + 1} more"]
        )
        for n, name in enumerate(shown[: max(room, 0)]):
            y = box.y + 17 + 15 * len(lines) + 4 + 13 * n
            svg.label(box.x + 8, y, name, size=10, anchor="start", color=MUTED, mono=True)
        svg.label(box.x + 8, box.bottom - 8, str(panel.get("type", "")), size=10, anchor="start", color=MUTED)
    return svg.text()


def dashboards() -> dict[str, str]:
    return {
        f"dashboard-{path.stem}.svg": dashboard_map(json.loads(path.read_text("utf-8")))
        for path in sorted(DASHBOARDS.glob("*.json"))
    }


def render_all() -> dict[str, str]:
    """Every picture, by file name under docs/images/."""
    return {"architecture.svg": architecture(), "prompt-path.svg": prompt_path(), **dashboards()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a picture differs")
    args = parser.parse_args(argv)
    stale = []
    for name, text in render_all().items():
        path = IMAGES / name
        if path.is_file() and path.read_text("utf-8") == text:
            continue
        stale.append(name)
        if not args.check:
            IMAGES.mkdir(parents=True, exist_ok=True)
            path.write_text(text, "utf-8")
    if args.check and stale:
        print(f"stale pictures in docs/images: {', '.join(stale)}; run python docs/_tools/figures.py")
        return 1
    if not args.check:
        print(f"wrote {len(stale)} picture(s) to docs/images" if stale else "docs/images is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
