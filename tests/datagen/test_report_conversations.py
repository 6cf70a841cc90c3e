"""`datagen report` says how the conversations of a multi-turn ``all`` job went: turns reached, the
conversations that stopped before their last turn (rows of the job's current incarnation only) and the
share of records whose history holds regenerated text."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
from typer.testing import CliRunner

from datagen.records.storage import Storage
from datagen.report import build_report
from datagen_cli import app
from tests.support.export_jobs import CLEAN, JOB, REASONED, Sample, build_job

ALL_TURNS = {"multi_turn": "all"}
INCARNATION = "inc2"
MISMATCH = "the model called get_time, the dataset get_weather"
OLD_ERROR = "rendering failed in the deleted job"


def _turn(sample_id: str, turn: int, gen: int = 0) -> Sample:
    """The record of one turn: its prompt holds ``turn`` earlier assistant turns."""
    messages: list[dict[str, Any]] = []
    for n in range(turn):
        messages += [
            {"role": "user", "content": f"{sample_id} Q{n}"},
            {"role": "assistant", "content": f"A{n}"},
        ]
    messages.append({"role": "user", "content": f"{sample_id} Q{turn}"})
    return Sample(sample_id, REASONED, messages=messages, gen=gen)


def _stopped(sample_id: str, turn: int, turns: int, reason: str, **extra: Any) -> dict[str, Any]:
    row = {"sample_id": sample_id, "gen": 0, "turn": turn, "turns": turns, "reason": reason}
    return {**row, "partition": "default", "message": "", **extra}


def _as_incarnation(storage: Storage, incarnation: str) -> None:
    """The job as a coordinator of that incarnation leaves it: its manifest and commit carry it (the
    commit without one, of the earlier job of this id, then drops out)."""
    table = pa.Table.from_batches(list(storage.iter_record_batches(JOB)))
    storage.write_manifest(JOB, {**(storage.read_manifest(JOB) or {}), "incarnation": incarnation})
    storage.commit_shard(JOB, "w-inc", table, {"worker": "w", "incarnation": incarnation})


def _three_conversations(storage: Storage) -> None:
    """a: 1 turn (truncated), b: 2 turns (then a tool mismatch), c: all 3; b's turn 1 committed twice."""
    samples = [_turn("a", 0), _turn("b", 0), _turn("b", 1), _turn("c", 0), _turn("c", 1), _turn("c", 2)]
    build_job(storage, [*samples, _turn("b", 1)], spec=ALL_TURNS)
    _as_incarnation(storage, INCARNATION)
    storage.write_stopped(JOB, "a", 0, _stopped("a", 1, 3, "truncated", inc=INCARNATION))
    storage.write_stopped(JOB, "b", 0, _stopped("b", 2, 3, "tool_mismatch", message=MISMATCH))
    # Of the earlier job of this id: not this job's.
    storage.write_stopped(JOB, "c", 0, _stopped("c", 1, 3, "error", message=OLD_ERROR, inc="inc1"))


def test_conversations_of_an_all_job_by_hand(storage: Storage) -> None:
    _three_conversations(storage)
    report = build_report(storage, JOB)
    assert (report.records, report.unique) == (7, 6) and not report.failed
    assert report.to_json()["conversations"] == {
        "conversations": 3,
        "turns_reached": {"1": 1, "2": 1, "3": 1},
        "stopped": {
            "total": 2,
            "by_reason": {"truncated": 1, "tool_mismatch": 1},
            "examples": {
                "truncated": ["a before turn 1 of 3"],
                "tool_mismatch": [f"b before turn 2 of 3: {MISMATCH}"],
            },
        },
        # b's turn 1, c's turns 1 and 2 of the 6 unique records.
        "regenerated_history_share": 0.5,
        "regenerated_history_records": 3,
        "records": 6,
    }


def test_report_shows_the_section(storage: Storage, tmp_path: Path) -> None:
    _three_conversations(storage)
    out = tmp_path / "report"
    result = CliRunner(env={"COLUMNS": "200"}).invoke(
        app, ["report", JOB, "--storage", str(storage.root), "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert (
        "conversations: 3 conversations (multi-turn all); turns recorded 1: 1, 2: 1, 3: 1; "
        "regenerated history: 3 of 6 records (50%); stopped before their last turn: 2"
    ) in result.stdout
    assert "conversations stopped before their last turn" in result.stdout
    assert f"b before turn 2 of 3: {MISMATCH}" in result.stdout
    assert OLD_ERROR not in result.stdout
    data = json.loads((out / "report.json").read_text("utf-8"))
    assert data["conversations"]["stopped"]["by_reason"] == {"truncated": 1, "tool_mismatch": 1}
    page = (out / "report.html").read_text("utf-8")
    assert "<h2>Conversations</h2>" in page and MISMATCH in page


def test_stopped_rows_alone_make_the_section(storage: Storage) -> None:
    build_job(storage, [_turn("a", 0), _turn("b", 0)], spec=ALL_TURNS)
    storage.write_stopped(JOB, "a", 0, _stopped("a", 1, 2, "truncated"))  # no incarnation: counts
    section = build_report(storage, JOB).to_json()["conversations"]
    assert section["turns_reached"] == {"1": 2} and section["stopped"]["by_reason"] == {"truncated": 1}
    assert (section["regenerated_history_share"], section["regenerated_history_records"]) == (0.0, 0)


def test_no_section_without_later_turns_or_stops(storage: Storage, tmp_path: Path) -> None:
    build_job(storage, [_turn("a", 0), _turn("b", 0)], spec=ALL_TURNS)
    # A stop of another incarnation of the job id is not this job's.
    storage.write_stopped(JOB, "a", 0, _stopped("a", 1, 2, "truncated", inc="inc1"))
    report = build_report(storage, JOB)
    assert report.conversations is None and "conversations" not in report.to_json()
    result = CliRunner().invoke(app, ["report", JOB, "--storage", str(storage.root)])
    assert result.exit_code == 0, result.output
    assert "conversations" not in result.stdout


def test_no_section_in_last_mode(storage: Storage) -> None:
    """In ``last`` mode a record's turn counts the dataset's assistant turns before it: one record per
    row, with the dataset's history, so there is nothing to say about conversations."""
    build_job(storage, CLEAN)
    assert max(s.turn for s in CLEAN) == 1
    assert "conversations" not in build_report(storage, JOB).to_json()
