"""`datagen report` of a job with a recipe: its records by arm (counts, shares, lengths, finishes,
truncation, think structure, the template variables and sampling each arm's records carry), and no
such section for a job without a recipe or for shards written before records named their arm."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
from typer.testing import CliRunner

from datagen.prompts.provenance import canonical_kwargs_json
from datagen.prompts.tokenization import renderer_for
from datagen.records.schema import ARM, TEMPLATE_KWARGS, Record, records_to_table
from datagen.records.storage import Storage
from datagen.report import build_report
from datagen.report.arms import MAX_VALUES_KEPT, NO_ARM, UNKNOWN_VALUE, ThinkShape, ValueTally, think_shape
from datagen.spec import JobSpec
from datagen_cli import app
from tests.support.export_jobs import (
    CLEAN,
    EOS,
    HI_MESSAGES,
    I_THINK,
    JOB,
    LET_ME,
    REASONED,
    THE_ANSWER,
    THINK_END,
    build_job,
)
from tests.support.records import make_record, write_manifest_once
from tests.support.specs import NO_CONTEXT_LEN, job_spec

THINK_ON = '{"thinking":true}'
THINK_OFF = '{"thinking":false}'
RECIPE = {
    "assign": "cycle",
    "arms": [
        {"name": "deep", "chat_template_kwargs": {"thinking": True}},
        {"name": "fast", "chat_template_kwargs": {"thinking": False}, "sampling": {"temperature": 0.0}},
        {"name": "idle"},  # an arm no record came from
    ],
}
# The sampling each record says it was sent: "fast" records of both classes, so two distinct texts.
DEEP_SAMPLING = '{"max_new_tokens": 64, "temperature": 0.6}'
FAST_SHORT = '{"max_new_tokens": 64, "temperature": 0.0}'
FAST_LONG = '{"max_new_tokens": 256, "temperature": 0.0}'
# "Hi" rendered: "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜>" then "<think>\n" (6 ids) with thinking
# on, "<think>\n\n</think>\n\n" (8 ids) with thinking off.
DEEP_PROMPT_LEN, FAST_PROMPT_LEN = 6, 8


def _write_manifest(storage: Storage, spec: JobSpec) -> None:
    manifest = {
        "job_id": JOB,
        "spec": json.loads(spec.model_dump_json()),
        "tokenizer": renderer_for(spec).identity(),
        "servers": {},
    }
    write_manifest_once(storage, JOB, manifest)


def _record(spec: JobSpec, sample_id: str, arm: str, output: list[int], finish: str, sampling: str) -> Record:
    """A record of ``arm``: "Hi" rendered with the arm's template variables, then ``output``."""
    prompt = renderer_for(spec, spec.arm_named(arm)).render(HI_MESSAGES)
    return make_record(
        sample_id,
        prompt + output,
        len(prompt),
        job_id=JOB,
        finish_type=finish,
        finish_matched=str(output[-1]) if finish == "stop" else None,
        finish_length=len(output) if finish == "length" else None,
        sampling_params=sampling,
        arm=arm,
        chat_template_kwargs=canonical_kwargs_json(spec.template_kwargs(spec.arm_named(arm))),
    )


def _recipe_records(spec: JobSpec) -> list[Record]:
    """deep: outputs of 8 (stop), 5 (length, reasoning never closed), 7 (stop) ids; fast: 4 (stop) and
    6 (length) ids, no reasoning; then d1 again (a key committed twice: not counted again)."""
    return [
        _record(spec, "d1", "deep", REASONED, "stop", DEEP_SAMPLING),
        _record(spec, "f1", "fast", [*THE_ANSWER, EOS], "stop", FAST_SHORT),
        _record(spec, "d2", "deep", [*I_THINK, *LET_ME], "length", DEEP_SAMPLING),
        _record(spec, "f2", "fast", [*THE_ANSWER, *THE_ANSWER], "length", FAST_LONG),
        _record(spec, "d3", "deep", [*LET_ME, THINK_END, *THE_ANSWER, EOS], "stop", DEEP_SAMPLING),
        _record(spec, "d1", "deep", [*LET_ME, *LET_ME], "length", DEEP_SAMPLING),
    ]


def _as_version_3(table: pa.Table) -> pa.Table:
    """The table as a worker before schema version 4 wrote it: no arm columns."""
    table = table.drop_columns([ARM, TEMPLATE_KWARGS])
    versions = pa.array([3] * table.num_rows, type=pa.int16())
    return table.set_column(table.schema.get_field_index("schema_version"), "schema_version", versions)


def test_records_are_broken_down_by_arm(storage: Storage) -> None:
    spec = job_spec(NO_CONTEXT_LEN, recipe=RECIPE)
    _write_manifest(storage, spec)
    storage.commit_shard(JOB, "w-00000000", records_to_table(_recipe_records(spec)), {"worker": "w"})
    report = build_report(storage, JOB)
    # The fast arm's prompts end with the thinking-off generation prompt: held to their own.
    assert not report.failed, [c.to_json() for c in report.checks.values() if c.found]
    arms = report.arms
    assert arms is not None and arms.records == 5
    assert [name for name, _, _ in arms.rows()] == ["deep", "fast", "idle"]
    deep, fast, idle = arms.arms["deep"], arms.arms["fast"], arms.arms["idle"]
    assert (deep.records, arms.share("deep"), fast.records, arms.share("fast")) == (3, 0.6, 2, 0.4)
    assert (idle.records, arms.share("idle")) == (0, 0.0)

    assert deep.by_finish == {"stop": 2, "length": 1}
    assert (deep.truncated, deep.truncation_rate) == (1, 0.3333)
    assert deep.think == {ThinkShape.CLOSED: 2, ThinkShape.UNCLOSED: 1}
    prompts = deep.prompt_lengths
    assert (prompts.count, prompts.total, prompts.minimum, prompts.maximum) == (3, 18, 6, 6)
    outputs = deep.all_outputs()
    assert (outputs.count, outputs.total, outputs.minimum, outputs.maximum) == (3, 20, 5, 8)
    assert (deep.output_lengths["stop"].total, deep.output_lengths["length"].total) == (15, 5)
    assert deep.template_kwargs.counts == {THINK_ON: 3}
    assert (deep.sampling_params.common, deep.sampling_params.distinct) == (DEEP_SAMPLING, "1")

    assert fast.by_finish == {"stop": 1, "length": 1}
    assert (fast.truncated, fast.truncation_rate) == (1, 0.5)
    assert fast.think == {ThinkShape.NONE: 2}
    prompts = fast.prompt_lengths
    assert (prompts.count, prompts.total, prompts.minimum, prompts.maximum) == (2, 16, 8, 8)
    outputs = fast.all_outputs()
    assert (outputs.count, outputs.total, outputs.minimum, outputs.maximum) == (2, 10, 4, 6)
    assert fast.template_kwargs.counts == {THINK_OFF: 2}
    assert fast.sampling_params.counts == {FAST_SHORT: 1, FAST_LONG: 1}
    assert fast.sampling_params.distinct == "2"

    header, rows = arms.summary()
    assert header == ["arm", "records", "share", "length", "stop", "truncated", "think"]
    assert rows == [
        ["deep", "3", "60.0%", "1", "2", "33.3%", "closed 2, unclosed 1"],
        ["fast", "2", "40.0%", "1", "1", "50.0%", "none 2"],
        ["idle", "0", "0.0%", "0", "0", "0.0%", ""],
    ]
    assert arms.settings()[:2] == [
        ["deep", "chat_template_kwargs", THINK_ON, "1"],
        ["deep", "sampling_params", DEEP_SAMPLING, "1"],
    ]


def test_report_files_show_the_arms(storage: Storage, tmp_path: Path) -> None:
    spec = job_spec(NO_CONTEXT_LEN, recipe=RECIPE)
    _write_manifest(storage, spec)
    storage.commit_shard(JOB, "w-00000000", records_to_table(_recipe_records(spec)), {"worker": "w"})
    out = tmp_path / "r"
    result = CliRunner().invoke(app, ["report", JOB, "--storage", str(storage.root), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "records by arm" in result.stdout and "all checks pass" in result.stdout
    data: dict[str, Any] = json.loads((out / "report.json").read_text("utf-8"))
    by_arm = {arm["name"]: arm for arm in data["arms"]}
    assert [arm["name"] for arm in data["arms"]] == ["deep", "fast", "idle"]
    fast = by_arm["fast"]
    assert (fast["records"], fast["share"], fast["truncation_rate"]) == (2, 0.4, 0.5)
    assert fast["by_finish"] == {"stop": 1, "length": 1} and fast["think"] == {"none": 2}
    assert (fast["output_lengths"]["min"], fast["output_lengths"]["max"]) == (4, 6)
    assert fast["chat_template_kwargs"]["value"] == THINK_OFF
    assert fast["sampling_params"]["values"] == {FAST_SHORT: 1, FAST_LONG: 1}
    assert by_arm["deep"]["think"] == {"closed": 2, "unclosed": 1}
    assert (out / "output_lengths_by_arm.png").read_bytes().startswith(b"\x89PNG")
    page = (out / "report.html").read_text("utf-8")
    assert page.count("data:image/png;base64,") == 3
    assert "Records by arm" in page and "closed 2, unclosed 1" in page


def test_a_job_without_a_recipe_has_no_arms_section(storage: Storage, tmp_path: Path) -> None:
    build_job(storage, CLEAN)
    report = build_report(storage, JOB)
    assert report.arms is None and report.arm_tally is None
    assert "arms" not in report.to_json()
    out = tmp_path / "r"
    result = CliRunner().invoke(app, ["report", JOB, "--storage", str(storage.root), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "records by arm" not in result.stdout
    assert not (out / "output_lengths_by_arm.png").exists()


def test_shards_before_arms_have_no_arms_section(storage: Storage) -> None:
    spec = job_spec(NO_CONTEXT_LEN, recipe=RECIPE)
    _write_manifest(storage, spec)
    table = _as_version_3(records_to_table(_recipe_records(spec)[:2]))
    storage.commit_shard(JOB, "w-00000000", table, {"worker": "w"})
    report = build_report(storage, JOB)
    assert report.arms is None and "arms" not in report.to_json()
    assert report.unique == 2 and report.by_finish == {"stop": 2}
    # Without the record's template variables, its prompt is held to the job's generation prompt:
    # the thinking-off one (f1) does not end with it.
    assert report.checks["generation_prompt"].examples == ["f1"]


def test_records_without_an_arm_are_counted_apart(storage: Storage) -> None:
    """An older shard next to a version-4 one: its records under NO_ARM, last."""
    spec = job_spec(NO_CONTEXT_LEN, recipe=RECIPE)
    _write_manifest(storage, spec)
    deep, fast = _recipe_records(spec)[:2]
    storage.commit_shard(JOB, "w-00000000", _as_version_3(records_to_table([deep])), {"worker": "w"})
    storage.commit_shard(JOB, "w-00000001", records_to_table([fast]), {"worker": "w"})
    arms = build_report(storage, JOB).arms
    assert arms is not None
    assert [(name, stats.records, share) for name, stats, share in arms.rows()] == [
        ("deep", 0, 0.0),
        ("fast", 1, 0.5),
        ("idle", 0, 0.0),
        (NO_ARM, 1, 0.5),
    ]
    assert [arm["name"] for arm in arms.to_json()] == ["deep", "fast", "idle", None]
    old = arms.arms[NO_ARM]
    assert old.think == {ThinkShape.CLOSED: 1} and old.template_kwargs.counts == {UNKNOWN_VALUE: 1}


def test_think_shapes_and_kept_values_by_hand() -> None:
    assert [think_shape(True, n) for n in (0, 1, 2)] == [
        ThinkShape.UNCLOSED,
        ThinkShape.CLOSED,
        ThinkShape.REPEATED,
    ]
    assert [think_shape(False, n) for n in (0, 1)] == [ThinkShape.NONE, ThinkShape.STRAY]
    values = ValueTally()
    for n in range(MAX_VALUES_KEPT + 2):
        values.add(f"v{n}")
    values.add("v0")
    assert (len(values.counts), values.unlisted, values.distinct) == (MAX_VALUES_KEPT, 2, "8+")
    assert values.common == "v0" and values.counts["v0"] == 2
