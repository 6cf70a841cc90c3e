"""The docs site's pictures are what docs/_tools/figures.py draws, the pages show them, and the
built site opens from its files.

The pictures are committed SVG text (docs/images/), drawn from code and, for the dashboards, from
`dashboards/*.json`: each is held to a fresh rendering here, so a dashboard changed without
running the script fails.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
IMAGES = DOCS / "images"
SVG_NS = "{http://www.w3.org/2000/svg}"
# A Markdown image: ![alt](target), the alt text possibly over several lines.
MARKDOWN_IMAGE = re.compile(r"!\[([^\]]*)\]\(([^)\s]+)\)")
MIN_PICTURES = 3


def _load_figures() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_figures", DOCS / "_tools" / "figures.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Its dataclasses look their module up in sys.modules.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def figures() -> ModuleType:
    return _load_figures()


def _page_images() -> dict[Path, list[tuple[str, Path]]]:
    """Each page's images: (alt text, the file it points at)."""
    found: dict[Path, list[tuple[str, Path]]] = {}
    for page in sorted(DOCS.rglob("*.md")):
        for alt, target in MARKDOWN_IMAGE.findall(page.read_text("utf-8")):
            if "://" not in target:
                found.setdefault(page, []).append((alt, (page.parent / target).resolve()))
    return found


def test_every_committed_picture_is_what_the_script_draws(figures: ModuleType) -> None:
    drawn = figures.render_all()
    committed = {path.name for path in IMAGES.glob("*.svg")}
    assert committed == set(drawn), "docs/images holds other pictures than docs/_tools/figures.py draws"
    for name, text in drawn.items():
        assert (IMAGES / name).read_text("utf-8") == text, (
            f"docs/images/{name} is stale: run python docs/_tools/figures.py"
        )
    assert figures.main(["--check"]) == 0


def test_the_pictures_are_svg_with_a_title() -> None:
    for path in IMAGES.glob("*.svg"):
        root = ET.fromstring(path.read_text("utf-8"))
        assert root.tag == f"{SVG_NS}svg", path.name
        title = root.find(f"{SVG_NS}title")
        assert title is not None and title.text, f"{path.name} has no <title>"


def test_the_pages_show_the_pictures_with_alt_text() -> None:
    shown = _page_images()
    images = [image for page in shown.values() for image in page]
    assert len({path for _, path in images}) >= MIN_PICTURES
    for page, page_images in shown.items():
        for alt, path in page_images:
            assert path.is_file(), f"{page.relative_to(ROOT)} shows {path}, which does not exist"
            assert len(alt.split()) >= 3, f"{page.relative_to(ROOT)}: {path.name} needs alt text"
    unused = {p.resolve() for p in IMAGES.glob("*.svg")} - {path for _, path in images}
    assert not unused, f"pictures no page shows: {sorted(p.name for p in unused)}"


def test_the_prompt_path_names_modules_of_the_measured_path(figures: ModuleType) -> None:
    # architecture.md's "One prompt" section lists the path as tests/e2e/test_prompt_path.py measures it.
    text = (DOCS / "architecture.md").read_text("utf-8")
    section = text.split("## One prompt", 1)[1].split("\n## ", 1)[0]
    for step in figures.PROMPT_STEPS:
        assert (ROOT / step.module).is_file(), step.module
        assert f"`{step.module}`" in section, f"{step.module} is not on the measured path"


@pytest.mark.parametrize("name", ["fleet", "kv", "job"])
def test_every_dashboard_panel_is_on_its_map(figures: ModuleType, name: str) -> None:
    dashboard = json.loads((ROOT / "dashboards" / f"{name}.json").read_text("utf-8"))
    svg = (IMAGES / f"dashboard-{name}.svg").read_text("utf-8")
    words = " ".join(re.sub(r"<[^>]+>", " ", svg).split())
    panels = list(figures._panels(dashboard))
    assert panels
    for panel in panels:
        # Titles are wrapped over lines, so each word of the title is looked for in order.
        title = " ".join(figures.escape(panel["title"]).split())
        assert title in words, f"{name}: panel {panel['title']!r} is not on the map"


def test_a_panel_reads_its_metrics_in_either_name_form(figures: ModuleType) -> None:
    panel = {
        "targets": [
            {"expr": 'max by (server) ({__name__=~"sglang[:_]token_usage|vllm[:_]kv_cache_usage_perc"})'},
            {"expr": "histogram_quantile(0.5, sum by (le) (rate(datagen_worker_x_seconds_bucket[5m])))"},
            {"expr": "sum(rate(datagen_worker_x_seconds_count[5m]))"},
        ]
    }
    assert figures.panel_metrics(panel) == [
        "sglang:token_usage",
        "vllm:kv_cache_usage_perc",
        "datagen_worker_x_seconds",
    ]


def test_the_built_site_opens_from_its_files(tmp_path: Path) -> None:
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "HF_HUB_OFFLINE": "1"}
    build = [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(site)]
    done = subprocess.run(build, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert "end of life" not in done.stderr, "the theme's notice is printed"
    shown: set[Path] = set()
    # 404.html is a server's page (its links are absolute, from the site's root); every other page
    # opens from its file.
    for page in site.rglob("*.html"):
        if page.name == "404.html" and page.parent == site:
            continue
        html = page.read_text("utf-8")
        for target in re.findall(r'(?:href|src)="([^"#?]*)[^"]*"', html):
            if not target or "://" in target or target.startswith(("mailto:", "data:", "javascript:")):
                continue
            path = (page.parent / target).resolve()
            # Every page and asset a link names is a file: no directory URLs, which need a server.
            assert path.is_file(), f"{page.relative_to(site)} links to {target}, not a file of the site"
            if path.suffix == ".svg":
                shown.add(path)
    assert len(shown) >= MIN_PICTURES, f"the site shows {len(shown)} pictures"
    assert (site / "stylesheets" / "extra.css").is_file()
