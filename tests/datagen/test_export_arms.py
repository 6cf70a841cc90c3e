"""Exports of a job with a recipe carry each row's arm, the template variables its prompt was rendered
with and the sampling params sent: ``parquet`` as columns (JSON strings), ``speculators`` in
``metadata`` (objects), ``conversations`` on the row, ``specforge`` in the arms side file beside the
export. Shards written before records named their arm export a null arm and the job's template
variables."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from datagen.errors import ConfigError
from datagen.export import ExportFormat, ExportOptions, export_job
from datagen.export.formats import arms_file_path
from datagen.prompts.provenance import canonical_kwargs_json
from datagen.prompts.tokenization import renderer_for
from datagen.records.schema import ARM, TEMPLATE_KWARGS, Record, records_to_table
from datagen.records.storage import Storage
from datagen.spec import JobSpec
from datagen_cli import app
from tests.support.export_jobs import (
    ASSISTANT,
    BOS,
    EOS,
    HI,
    HI_MESSAGES,
    JOB,
    NEWLINE,
    REASONED,
    THE_ANSWER,
    THINK,
    THINK_END,
    USER,
    read_jsonl,
)
from tests.support.records import make_record, write_manifest_once
from tests.support.specs import NO_CONTEXT_LEN, job_spec

RECIPE = {
    "assign": "cycle",
    "arms": [
        {"name": "low", "chat_template_kwargs": {"reasoning_effort": "low"}},
        {"name": "off", "chat_template_kwargs": {"thinking": False}, "sampling": {"temperature": 0.0}},
    ],
}
LOW_SAMPLING = '{"max_new_tokens":64,"temperature":0.6,"top_p":0.95}'
OFF_SAMPLING = '{"max_new_tokens":64,"temperature":0.0,"top_p":0.95}'
# "<｜begin▁of▁sentence｜>Reasoning: low<｜User｜>Hi<｜Assistant｜><think>\n": the effort ends the system
# prompt.
LOW_PROMPT = [BOS, 77666, 288, 28, 3157, USER, *HI, ASSISTANT, THINK, NEWLINE]
# "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜><think>\n\n</think>\n\n": thinking off.
DOUBLE_NEWLINE = 271
OFF_PROMPT = [BOS, USER, *HI, ASSISTANT, THINK, DOUBLE_NEWLINE, THINK_END, DOUBLE_NEWLINE]
ANSWER = [*THE_ANSWER, EOS]


def _write_manifest(storage: Storage, spec: JobSpec) -> None:
    manifest = {
        "job_id": JOB,
        "spec": json.loads(spec.model_dump_json()),
        "tokenizer": renderer_for(spec).identity(),
        "servers": {},
    }
    write_manifest_once(storage, JOB, manifest)
    storage.write_input(
        JOB, [b"".join(json.dumps({"id": s, "messages": HI_MESSAGES}).encode() + b"\n" for s in "ab")]
    )


def _record(spec: JobSpec, sample_id: str, arm: str | None, output: list[int], gen: int = 0) -> Record:
    """ "Hi" rendered with ``arm``'s template variables (the job's without one), then ``output``."""
    arm_spec = spec.arm_named(arm)
    prompt = renderer_for(spec, arm_spec).render(HI_MESSAGES)
    kwargs = canonical_kwargs_json(spec.template_kwargs(arm_spec))
    return make_record(
        sample_id,
        prompt + output,
        len(prompt),
        job_id=JOB,
        gen=gen,
        finish_matched=str(EOS),
        max_new_tokens=64,
        sampling_params=OFF_SAMPLING if arm == "off" else LOW_SAMPLING,
        arm=arm,
        chat_template_kwargs=kwargs,
    )


@pytest.fixture
def recipe_job(storage: Storage) -> Storage:
    """a: gen 0 "low" (reasoned), gen 1 "off"; b: "off" (the answer alone); two shards."""
    spec = job_spec(NO_CONTEXT_LEN, recipe=RECIPE)
    _write_manifest(storage, spec)
    first = [_record(spec, "a", "low", REASONED), _record(spec, "a", "off", ANSWER, gen=1)]
    storage.commit_shard(JOB, "w-00000000", records_to_table(first), {"worker": "w"})
    storage.commit_shard(
        JOB, "w-00000001", records_to_table([_record(spec, "b", "off", ANSWER)]), {"worker": "w"}
    )
    return storage


def _as_version_3(table: pa.Table) -> pa.Table:
    """The table as a worker before schema version 4 wrote it: no arm columns."""
    table = table.drop_columns([ARM, TEMPLATE_KWARGS])
    versions = pa.array([3] * table.num_rows, type=pa.int16())
    return table.set_column(table.schema.get_field_index("schema_version"), "schema_version", versions)


def _parquet_rows(out: Path) -> list[dict[str, Any]]:
    return pq.read_table(out / "data").to_pylist()


def test_parquet_has_arm_kwargs_and_sampling_columns(recipe_job: Storage, tmp_path: Path) -> None:
    out = tmp_path / "pq"
    export_job(recipe_job, JOB, ExportFormat.PARQUET, out)
    table = pq.read_table(out / "data")
    assert table.schema.names[-3:] == ["arm", "chat_template_kwargs", "sampling_params"]
    assert [f.type for f in table.schema][-3:] == [pa.string()] * 3
    rows = {r["id"]: r for r in table.to_pylist()}
    assert {k: rows["a"][k] for k in ("input_ids", "arm", "chat_template_kwargs", "sampling_params")} == {
        "input_ids": [*LOW_PROMPT, *REASONED],
        "arm": "low",
        "chat_template_kwargs": '{"reasoning_effort":"low"}',
        "sampling_params": '{"max_new_tokens":64,"temperature":0.6,"top_p":0.95}',
    }
    for row_id in ("a_t0_g1", "b"):
        assert rows[row_id]["input_ids"] == [*OFF_PROMPT, *ANSWER]
        assert (rows[row_id]["arm"], rows[row_id]["chat_template_kwargs"]) == ("off", '{"thinking":false}')
        assert rows[row_id]["sampling_params"] == '{"max_new_tokens":64,"temperature":0.0,"top_p":0.95}'


def test_speculators_metadata_names_the_arm(recipe_job: Storage, tmp_path: Path) -> None:
    out = tmp_path / "s.jsonl"
    export_job(recipe_job, JOB, ExportFormat.SPECULATORS, out)
    rows = {r["id"]: r for r in read_jsonl(out)}
    a = rows["a"]
    assert a["text"] == (
        "<｜begin▁of▁sentence｜>Reasoning: low<｜User｜>Hi<｜Assistant｜><think>\n"
        "I think.</think>The answer.<｜end▁of▁sentence｜>"
    )
    assert a["metadata"] == {
        "idx": 0,
        "finish_reason": "stop",
        "is_tool_call": False,
        "usage": {"prompt_tokens": 10, "completion_tokens": 8},
        "endpoint": "/generate",
        "sampling_params": {"max_new_tokens": 64, "temperature": 0.6, "top_p": 0.95},
        "server": "s",
        "arm": "low",
        "chat_template_kwargs": {"reasoning_effort": "low"},
    }
    off = rows["b"]["metadata"]
    assert (off["arm"], off["chat_template_kwargs"]) == ("off", {"thinking": False})
    assert off["sampling_params"] == {"max_new_tokens": 64, "temperature": 0.0, "top_p": 0.95}


def test_conversations_carry_the_arm(recipe_job: Storage, tmp_path: Path) -> None:
    out = tmp_path / "c.jsonl"
    export_job(recipe_job, JOB, ExportFormat.CONVERSATIONS, out)
    rows = {r["id"]: r for r in read_jsonl(out)}
    assert rows["a"] == {
        "id": "a",
        "conversations": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "The answer.", "reasoning_content": "I think."},
        ],
        "status": "success",
        "finish_reason": "stop",
        "arm": "low",
        "chat_template_kwargs": {"reasoning_effort": "low"},
    }
    # Thinking off: the prompt closed the think block, so the output is all content.
    assert rows["b"]["conversations"][-1] == {"role": "assistant", "content": "The answer."}
    assert (rows["b"]["arm"], rows["b"]["chat_template_kwargs"]) == ("off", {"thinking": False})


def _arm_line(index: int, row_id: str, sample_id: str, gen: int, arm: str) -> dict[str, Any]:
    return {
        "index": index,
        "id": row_id,
        "sample_id": sample_id,
        "turn": 0,
        "gen": gen,
        "arm": arm,
        "chat_template_kwargs": {"reasoning_effort": "low"} if arm == "low" else {"thinking": False},
        "sampling_params": {"max_new_tokens": 64, "temperature": 0.6 if arm == "low" else 0.0, "top_p": 0.95},
    }


def test_specforge_writes_the_arms_beside_its_rows(recipe_job: Storage, tmp_path: Path) -> None:
    out = tmp_path / "out" / "train.jsonl"
    stats = export_job(recipe_job, JOB, ExportFormat.SPECFORGE, out)
    side = tmp_path / "out" / "train.arms.jsonl"
    assert stats.arms_file == str(side) and stats.summary()["arms_file"] == str(side)
    rows = read_jsonl(out)
    assert set(rows[0]) == {"id", "input_ids", "loss_mask"}  # SpecForge's rows are left as they are
    assert read_jsonl(side) == [
        _arm_line(0, "a", "a", 0, "low"),
        _arm_line(1, "a_t0_g1", "a", 1, "off"),
        _arm_line(2, "b", "b", 0, "off"),
    ]
    assert sorted(p.name for p in out.parent.iterdir()) == ["train.arms.jsonl", "train.jsonl"]


def test_arms_file_follows_shuffle_and_shards(recipe_job: Storage, tmp_path: Path) -> None:
    out = tmp_path / "shards"
    options = ExportOptions(shard_size=2, shuffle_seed=5)
    export_job(recipe_job, JOB, ExportFormat.SPECFORGE, out, options)
    rows = [r for f in sorted(out.iterdir()) for r in read_jsonl(f)]
    lines = read_jsonl(tmp_path / "shards.arms.jsonl")  # beside the directory, not among its shards
    assert [line["id"] for line in lines] == [r["id"] for r in rows]
    assert [line["index"] for line in lines] == [0, 1, 2]
    assert sorted(p.name for p in out.iterdir()) == [
        "train-00000-of-00002.jsonl",
        "train-00001-of-00002.jsonl",
    ]


def test_arms_file_is_optional_and_never_stale(storage: Storage, tmp_path: Path) -> None:
    """Without a recipe no row has an arm: no side file by default, and an earlier export's is
    removed; ``arms_file=True`` writes one anyway, ``False`` none for a recipe job."""
    spec = job_spec(NO_CONTEXT_LEN)
    _write_manifest(storage, spec)
    storage.commit_shard(JOB, "w-00000000", records_to_table([_record(spec, "a", None, REASONED)]), {})
    out = tmp_path / "train.jsonl"
    side = arms_file_path(out)
    side.write_text('{"index": 0, "arm": "stale"}\n')
    stats = export_job(storage, JOB, ExportFormat.SPECFORGE, out)
    assert stats.arms_file is None and not side.exists() and out.exists()
    export_job(storage, JOB, ExportFormat.SPECFORGE, out, ExportOptions(arms_file=True))
    [line] = read_jsonl(side)
    assert (line["arm"], line["chat_template_kwargs"]) == (None, {})
    assert line["sampling_params"] == {"max_new_tokens": 64, "temperature": 0.6, "top_p": 0.95}
    assert not list(tmp_path.glob("*.tmp"))


def test_no_arms_file_for_a_recipe_job(recipe_job: Storage, tmp_path: Path) -> None:
    out = tmp_path / "out" / "train.jsonl"
    stats = export_job(recipe_job, JOB, ExportFormat.SPECFORGE, out, ExportOptions(arms_file=False))
    assert stats.arms_file is None and [p.name for p in out.parent.iterdir()] == ["train.jsonl"]


def test_arms_file_path_by_hand() -> None:
    assert arms_file_path(Path("/x/train.jsonl")) == Path("/x/train.arms.jsonl")
    assert arms_file_path(Path("/x/shards")) == Path("/x/shards.arms.jsonl")
    assert arms_file_path(Path("/x/a.b")) == Path("/x/a.b.arms.jsonl")


def test_arms_file_is_refused_for_other_formats(recipe_job: Storage, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--arms-file is for the specforge format only"):
        export_job(recipe_job, JOB, ExportFormat.PARQUET, tmp_path / "pq", ExportOptions(arms_file=True))
    assert not (tmp_path / "pq").exists()
    args = ["export", JOB, "--storage", str(recipe_job.root), "--format", "speculators", "--arms-file"]
    shell = subprocess.run(
        [sys.executable, "-m", "datagen_cli", *args, "--out", str(tmp_path / "s.jsonl")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert shell.returncode == 3 and shell.stdout == ""
    [line] = shell.stderr.splitlines()
    assert line == (
        "error: --arms-file is for the specforge format only, not speculators (parquet, speculators and "
        "conversations rows carry their arm themselves); drop --arms-file"
    )


def test_cli_writes_the_arms_file_and_names_it(recipe_job: Storage, tmp_path: Path) -> None:
    out = tmp_path / "cli.jsonl"
    args = ["export", JOB, "--storage", str(recipe_job.root), "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["arms_file"] == str(tmp_path / "cli.arms.jsonl")
    assert [line["arm"] for line in read_jsonl(tmp_path / "cli.arms.jsonl")] == ["low", "off", "off"]
    result = CliRunner().invoke(app, [*args, "--no-arms-file"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout.strip().splitlines()[-1])["arms_file"] is None


def test_shards_before_arms_export_a_null_arm_and_the_jobs_kwargs(storage: Storage, tmp_path: Path) -> None:
    """A version-3 shard next to a version-4 one, shuffled together (one bucket file takes both)."""
    spec = job_spec(NO_CONTEXT_LEN, chat_template_kwargs={"thinking": False})
    _write_manifest(storage, spec)
    old = _as_version_3(records_to_table([_record(spec, "a", None, ANSWER)]))
    storage.commit_shard(JOB, "w-00000000", old, {"worker": "w"})
    storage.commit_shard(JOB, "w-00000001", records_to_table([_record(spec, "b", None, ANSWER)]), {})
    out = tmp_path / "pq"
    export_job(storage, JOB, ExportFormat.PARQUET, out, ExportOptions(shuffle_seed=1))
    rows = {r["id"]: r for r in _parquet_rows(out)}
    for row_id in ("a", "b"):
        assert (rows[row_id]["arm"], rows[row_id]["chat_template_kwargs"]) == (None, '{"thinking":false}')
    export_job(storage, JOB, ExportFormat.SPECULATORS, tmp_path / "s.jsonl")
    metadata = read_jsonl(tmp_path / "s.jsonl")[0]["metadata"]
    assert (metadata["arm"], metadata["chat_template_kwargs"]) == (None, {"thinking": False})
    export_job(storage, JOB, ExportFormat.CONVERSATIONS, tmp_path / "c.jsonl")
    assert not {"arm", "chat_template_kwargs"} & set(read_jsonl(tmp_path / "c.jsonl")[0])


def test_shards_before_arms_without_a_manifest_export_nulls(tmp_path: Path) -> None:
    storage = Storage(tmp_path / "store")
    record = make_record("a", [0, 128803, 128804, 42, 1], 3, sampling_params='{"temperature":0.6}')
    storage.commit_shard(JOB, "s1", _as_version_3(records_to_table([record])), {})
    out = tmp_path / "pq"
    export_job(storage, JOB, ExportFormat.PARQUET, out)
    [row] = _parquet_rows(out)
    assert (row["arm"], row["chat_template_kwargs"], row["sampling_params"]) == (
        None,
        None,
        '{"temperature":0.6}',
    )
    export_job(storage, JOB, ExportFormat.SPECFORGE, tmp_path / "s.jsonl", ExportOptions(arms_file=True))
    assert read_jsonl(tmp_path / "s.arms.jsonl") == [
        {
            "index": 0,
            "id": "a",
            "sample_id": "a",
            "turn": 0,
            "gen": 0,
            "arm": None,
            "chat_template_kwargs": None,
            "sampling_params": {"temperature": 0.6},
        }
    ]
