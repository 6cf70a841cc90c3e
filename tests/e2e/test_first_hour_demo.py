"""The first hour of a new user (issue 14, items 1, 6 and 7), over real processes.

``pip install .`` (not editable: what installing the published package does) into a fresh virtual
environment, the source tree then deleted; from another directory, ``datagen demo`` in a terminal 80
columns wide, then ``datagen report`` on the job it made, as the demo's summary suggests.

The venv sees this interpreter's site-packages (``--system-site-packages``), so pip finds every
dependency installed and downloads nothing but the build backend, as ``pip install .`` always does
(from the configured index or a local mirror of it).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from rich.cells import cell_len

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
# Not part of an installable tree: what .gitignore lists, and the repository's own metadata.
NOT_COPIED = shutil.ignore_patterns(
    ".git", "build", "dist", "*.egg-info", "__pycache__", ".venv", ".mypy_cache", ".ruff_cache",
    ".pytest_cache", ".coverage", "datagen-data", "datagen-demo", "train.jsonl", "dump.rdb",
)  # fmt: skip
INSTALL_TIMEOUT_S = 180
DEMO_TIMEOUT_S = 120
COLUMNS = 80
DEMO_PROMPTS = 273


@dataclass
class Installed:
    bin: Path  # the venv's bin/
    site_packages: Path
    workdir: Path  # an empty directory elsewhere, the user's


def _env(columns: int = COLUMNS) -> dict[str, str]:
    """A user's shell: nothing of ours configured, no source tree on the path, a terminal width."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DATAGEN_") and k != "PYTHONPATH"}
    env["COLUMNS"] = str(columns)
    return env


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    root = tmp_path_factory.mktemp("first-hour")
    source, venv, workdir = root / "source", root / "venv", root / "home"
    # A copy, so that building writes nothing into the shared working tree.
    shutil.copytree(REPO, source, symlinks=True, ignore=NOT_COPIED)
    subprocess.run(
        [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True
    )
    python = venv / "bin" / "python"
    result = subprocess.run(
        [str(python), "-m", "pip", "install", "--no-input", "--disable-pip-version-check", str(source)],
        capture_output=True,
        text=True,
        timeout=INSTALL_TIMEOUT_S,
        env=_env(),
        cwd=root,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    shutil.rmtree(source)  # the install must stand on its own
    workdir.mkdir()
    where = subprocess.run(
        [
            str(python),
            "-c",
            "import datagen, sysconfig; print(datagen.__file__, sysconfig.get_path('purelib'))",
        ],
        capture_output=True,
        text=True,
        check=True,
        env=_env(),
        cwd=workdir,
    ).stdout.split()
    site_packages = Path(where[1])
    assert Path(where[0]) == site_packages / "datagen" / "__init__.py"  # not this checkout's
    assert site_packages.is_relative_to(venv)
    yield Installed(venv / "bin", site_packages, workdir)


@pytest.fixture(scope="module")
def demo_output(installed: Installed) -> str:
    result = subprocess.run(
        [str(installed.bin / "datagen"), "demo", "--data-dir", "demo-data"],
        capture_output=True,
        text=True,
        timeout=DEMO_TIMEOUT_S,
        env=_env(),
        cwd=installed.workdir,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    return output


def test_demo_runs_from_a_plain_install_in_another_directory(installed: Installed, demo_output: str) -> None:
    packaged = installed.site_packages / "datagen" / "data" / "prompts.jsonl"
    assert f"submitted {packaged} as job" in demo_output
    assert f"{DEMO_PROMPTS} accepted, {DEMO_PROMPTS} done, 0 failed, 0 rejected rows" in demo_output
    [job_dir] = (installed.workdir / "demo-data" / "jobs").iterdir()
    assert list((job_dir / "records").glob("*.parquet"))


def test_demo_progress_line_fits_80_columns_with_every_number_whole(demo_output: str) -> None:
    [line] = [line for line in demo_output.splitlines() if f"{DEMO_PROMPTS}/{DEMO_PROMPTS}" in line]
    assert cell_len(line) <= COLUMNS, line
    assert "…" not in line
    assert re.search(
        rf"(^|\s){DEMO_PROMPTS}/{DEMO_PROMPTS} completed · failed 0 · rejected 0 · \d+ tok/s \d+:\d\d:\d\d$",
        line,
    ), line


def test_report_on_the_demo_job_names_the_row_folders(installed: Installed, demo_output: str) -> None:
    [job_id] = re.findall(r"datagen report (\w+) --storage", demo_output)
    result = subprocess.run(
        [str(installed.bin / "datagen"), "report", job_id, "--storage", "demo-data", "--out", "report"],
        capture_output=True,
        text=True,
        timeout=DEMO_TIMEOUT_S,
        env=_env(),
        cwd=installed.workdir,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "all checks pass" in output
    assert "jobs/<job>/rejected/)" in output
    assert "jobs/<job>/flagged/)" in output
    assert "rejected.jsonl" not in output
    assert "rejected.jsonl" not in (installed.workdir / "report" / "report.json").read_text("utf-8")
