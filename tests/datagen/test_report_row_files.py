"""`datagen report` names where rejected and flagged rows are (issue 14, item 7): the ``rejected/`` and
``flagged/`` folders of the job, not the ``rejected.jsonl`` of the old layout."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from datagen.records.storage import Storage
from datagen.report import build_report
from datagen_cli import app
from tests.support.export_jobs import JOB, REASONED, Sample, build_job

HI_MESSAGES = [{"role": "user", "content": "Hi"}]


def test_report_names_the_rejected_and_flagged_folders(storage: Storage, tmp_path: Path) -> None:
    build_job(storage, [Sample("hi", REASONED, messages=HI_MESSAGES)])
    storage.write_rejected(JOB, "upload.jsonl", [{"line": 4, "reason": "invalid JSON: Expecting value"}])
    storage.write_flagged(JOB, "upload.jsonl", [{"line": 2, "sample_id": "s2", "tokens": ["<｜User｜>"]}])
    assert Path(storage.url(JOB, "rejected")).is_dir() and Path(storage.url(JOB, "flagged")).is_dir()

    report = build_report(storage, JOB)
    rejected, flagged = report.checks["rejected_rows"], report.checks["flagged_rows"]
    assert (rejected.found, flagged.found) == (1, 1)
    assert rejected.description.endswith("(stored under jobs/<job>/rejected/)")
    assert flagged.description.endswith("stored under jobs/<job>/flagged/)")

    # As a user reads it, in a terminal 80 columns wide: the folders are named whole.
    out = tmp_path / "report"
    result = CliRunner(env={"COLUMNS": "80"}).invoke(
        app, ["report", JOB, "--storage", str(storage.root), "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert "jobs/<job>/rejected/)" in result.stdout
    assert "jobs/<job>/flagged/)" in result.stdout
    written = (out / "report.json").read_text("utf-8") + (out / "report.html").read_text("utf-8")
    assert "rejected.jsonl" not in result.output + written
    checks = {c["name"]: c for c in json.loads((out / "report.json").read_text("utf-8"))["checks"]}
    assert checks["rejected_rows"]["description"] == rejected.description
    assert checks["flagged_rows"]["description"] == flagged.description
