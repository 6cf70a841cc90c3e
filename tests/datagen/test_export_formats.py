"""Exports checked against the trainers' own rules (trainer-formats.md §4.1, §4.2, §4.4), on jobs
built in a temporary storage: a manifest, an uploaded input file and committed shards whose output
ids are written by hand from the real DeepSeek tokenizer."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from datagen.errors import ConfigError
from datagen.export import ExportFormat, ExportOptions, export_job
from datagen.export.shuffle import shuffled_batches
from datagen.export.tokens import load_job_tokens, read_stop_ids
from datagen.prompts.tokenization import (
    bundled_tokenizer_path,
    default_chat_template_path,
    get_renderer,
)
from datagen.records.schema import records_to_table
from datagen.records.storage import Storage
from datagen_cli import app
from tests.support.export_jobs import (
    EOS,
    HI_PROMPT,
    I_THINK,
    JOB,
    LET_ME,
    MULTI,
    REASONED,
    THE_ANSWER,
    THINK,
    THINK_END,
    TOOL_CALLS,
    Sample,
    build_job,
    read_jsonl,
)
from tests.support.records import make_record

REFUSAL_WITHIN_S = 1.0


def renderer() -> Any:
    return get_renderer(bundled_tokenizer_path(), str(default_chat_template_path()), False, "{}")


def check_token_rows(rows: list[dict[str, Any]], min_supervised: int = 1) -> None:
    """SpecForge's and speculators' rules for a pre-tokenized row."""
    ids = [row["id"] for row in rows]
    assert len(ids) == len(set(ids)), "ids must be unique"
    for row in rows:
        assert isinstance(row["id"], str) and row["id"]
        assert len(row["input_ids"]) == len(row["loss_mask"]) > 0
        assert set(row["loss_mask"]) <= {0, 1}
        assert all(isinstance(i, int) and i >= 0 for i in row["input_ids"])
        assert sum(row["loss_mask"]) >= min_supervised
        # One prompt then one output: the mask never goes from 1 back to 0.
        assert row["loss_mask"] == sorted(row["loss_mask"])


def mixed_samples() -> list[Sample]:
    return [
        Sample("hi", REASONED, messages=[{"role": "user", "content": "Hi"}], partition="math"),
        Sample("trunc", [*I_THINK, *LET_ME], finish="length", partition="math"),
        MULTI,
        Sample("hi", [9, 9, EOS]),  # the same key committed again after a crash: dropped
        Sample(
            "hi", [*THE_ANSWER, THINK_END, *I_THINK, EOS], gen=1, messages=[{"role": "user", "content": "Hi"}]
        ),
        Sample(
            "tool",
            [*I_THINK, THINK_END, TOOL_CALLS, *THE_ANSWER, EOS],
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
            partition="chat",
        ),
    ]


@pytest.fixture
def mixed_job(storage: Storage) -> Storage:
    build_job(storage, mixed_samples(), shards=2)
    return storage


def test_specforge_rows_follow_the_trainer_rules(mixed_job: Storage, tmp_path: Path) -> None:
    out = tmp_path / "out" / "specforge.jsonl"
    stats = export_job(mixed_job, JOB, ExportFormat.SPECFORGE, out)
    rows = read_jsonl(out)
    check_token_rows(rows)
    assert [r["id"] for r in rows] == ["hi", "trunc", "multi_t1_g0", "hi_t0_g1", "tool"]
    # Written by hand: "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜><think>\n"
    # + "I think.</think>The answer." + EOS.
    assert rows[0] == {
        "id": "hi",
        "input_ids": [0, 128803, 23166, 128804, 128821, 201, 43, 2118, 16, 128822, 671, 3287, 16, 1],
        "loss_mask": [0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1],
    }
    assert set(rows[1]) == {"id", "input_ids", "loss_mask"}
    # Token formats keep truncated rows by default: their tokens are exact target samples.
    assert (stats.records, stats.duplicates, stats.written, sum(stats.dropped.values())) == (6, 1, 5, 0)
    assert stats.tokens == sum(len(r["input_ids"]) for r in rows)
    assert not list(out.parent.glob("*.tmp"))


def test_speculators_rows(mixed_job: Storage, tmp_path: Path) -> None:
    out = tmp_path / "speculators.jsonl"
    export_job(mixed_job, JOB, ExportFormat.SPECULATORS, out)
    rows = read_jsonl(out)
    check_token_rows(rows)
    by_id = {r["id"]: r for r in rows}
    hi = by_id["hi"]
    assert set(hi) == {"id", "primary_id", "input_ids", "loss_mask", "text", "metadata"}
    assert hi["text"] == (
        "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜><think>\n"
        "I think.</think>The answer.<｜end▁of▁sentence｜>"
    )
    assert hi["metadata"] == {
        "idx": 0,
        "finish_reason": "stop",
        "is_tool_call": False,
        "usage": {"prompt_tokens": 6, "completion_tokens": 8},
        "endpoint": "/generate",
        "sampling_params": {"max_new_tokens": 64, "temperature": 0.6, "top_p": 0.95, "sampling_seed": 7},
        "server": "sim-a",
        # A job without a recipe (tests/datagen/test_export_arms.py has one with).
        "arm": None,
        "chat_template_kwargs": None,
    }
    assert (by_id["hi_t0_g1"]["primary_id"], by_id["multi_t1_g0"]["primary_id"]) == ("hi", "multi")
    assert by_id["trunc"]["metadata"]["finish_reason"] == "length"
    assert by_id["tool"]["metadata"]["is_tool_call"] is True
    assert [r["metadata"]["idx"] for r in rows] == list(range(len(rows)))


def test_conversations_split_reasoning_at_think_end(mixed_job: Storage, tmp_path: Path) -> None:
    out = tmp_path / "conversations.jsonl"
    stats = export_job(mixed_job, JOB, ExportFormat.CONVERSATIONS, out)
    rows = read_jsonl(out)
    by_id = {r["id"]: r for r in rows}
    assert "trunc" not in by_id and stats.dropped["truncated"] == 1  # dropped by default here
    assert by_id["hi"]["conversations"] == [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "The answer.", "reasoning_content": "I think."},
    ]
    assert by_id["hi_t0_g1"]["conversations"][-1] == {
        "role": "assistant",
        "content": "I think.",
        "reasoning_content": "The answer.",
    }
    assert by_id["multi_t1_g0"]["conversations"] == [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "The answer.", "reasoning_content": "Let me"},
    ]
    assert by_id["tool"]["tools"] == [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    for row in rows:
        roles = [m["role"] for m in row["conversations"] if m["role"] != "system"]
        assert roles == ["user", "assistant"] * (len(roles) // 2), "user/assistant alternate"
        assert row["conversations"][-1]["role"] == "assistant"
        assert row["status"] == "success" and row["id"]


def test_conversations_keep_truncated_and_missing_input(storage: Storage, tmp_path: Path) -> None:
    hi = [{"role": "user", "content": "Hi"}]
    samples = [
        Sample("trunc", [*I_THINK, *LET_ME], finish="length", messages=hi),
        Sample("gone", REASONED, in_input=False),
        Sample("long", REASONED, messages=hi),
    ]
    build_job(storage, samples)
    out = tmp_path / "c.jsonl"
    options = ExportOptions(drop_truncated=False, max_length=len(HI_PROMPT) + 5)
    stats = export_job(storage, JOB, ExportFormat.CONVERSATIONS, out, options)
    rows = {r["id"]: r for r in read_jsonl(out)}
    assert set(rows) == {"trunc", "long"} and stats.dropped["no_input"] == 1
    # No think-end: all of the text is reasoning, the answer is empty.
    assert rows["trunc"]["conversations"][-1] == {
        "role": "assistant",
        "content": "",
        "reasoning_content": "I think.Let me",
    }
    assert (rows["trunc"]["status"], rows["trunc"]["finish_reason"]) == ("truncated", "length")
    # Clipped to 5 output tokens ("I think.</think>The"): no longer the whole turn.
    assert rows["long"]["status"] == "truncated"
    assert rows["long"]["conversations"][-1]["content"] == "The"


def test_conversations_without_thinking(storage: Storage, tmp_path: Path) -> None:
    build_job(
        storage, [Sample("plain", [*THE_ANSWER, EOS])], spec={"chat_template_kwargs": {"thinking": False}}
    )
    out = tmp_path / "c.jsonl"
    export_job(storage, JOB, ExportFormat.CONVERSATIONS, out)
    [row] = read_jsonl(out)
    assert row["conversations"][-1] == {"role": "assistant", "content": "The answer."}


def test_conversations_refuse_multi_turn_all_jobs(storage: Storage, tmp_path: Path) -> None:
    build_job(storage, [Sample("hi", REASONED)], spec={"multi_turn": "all"})
    with pytest.raises(ConfigError, match="multi-turn mode 'all'"):
        export_job(storage, JOB, ExportFormat.CONVERSATIONS, tmp_path / "out" / "c.jsonl")
    assert not (tmp_path / "out").exists()  # nothing written, not even a temporary file
    export_job(storage, JOB, ExportFormat.SPECFORGE, tmp_path / "out" / "s.jsonl")


def test_cli_refuses_conversations_of_a_multi_turn_all_job_at_once(storage: Storage, tmp_path: Path) -> None:
    """Issue 39: refused from the manifest in one line, before any progress bar or tokenizer load."""
    build_job(storage, [Sample("hi", REASONED)], spec={"multi_turn": "all"})
    args = ["export", JOB, "--storage", str(storage.root), "--format", "conversations"]
    args += ["--out", str(tmp_path / "c.jsonl")]
    started = time.monotonic()
    result = CliRunner().invoke(app, args)
    elapsed_s = time.monotonic() - started
    assert isinstance(result.exception, ConfigError), result.output
    assert elapsed_s < REFUSAL_WITHIN_S
    assert result.output == ""  # no bar drawn, not even its last frame
    shell = subprocess.run(
        [sys.executable, "-m", "datagen_cli", *args], capture_output=True, text=True, timeout=60, check=False
    )
    assert shell.returncode == 3 and shell.stdout == ""
    [line] = shell.stderr.splitlines()
    assert (
        line.startswith(f"error: job {JOB} ran in multi-turn mode 'all'") and "export a token format" in line
    )
    assert not (tmp_path / "c.jsonl").exists()


def test_parquet_export_loads_with_datasets(mixed_job: Storage, tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    out = tmp_path / "pq"
    stats = export_job(mixed_job, JOB, ExportFormat.PARQUET, out, ExportOptions(shard_size=2))
    names = sorted(p.name for p in (out / "data").iterdir())
    assert names == [f"train-0000{i}-of-00003.parquet" for i in range(3)]
    assert len(stats.files) == 3
    by_dir = datasets.load_dataset("parquet", data_dir=str(out / "data"), cache_dir=str(tmp_path / "cache"))
    by_path = datasets.load_dataset(str(out), cache_dir=str(tmp_path / "cache2"))
    rows = by_dir["train"].to_list()
    assert rows == by_path["train"].to_list()
    assert set(by_dir["train"].column_names) == {
        "id",
        "primary_id",
        "input_ids",
        "loss_mask",
        "finish_reason",
        "partition",
        "arm",
        "chat_template_kwargs",
        "sampling_params",
    }
    check_token_rows(rows)
    hi = next(r for r in rows if r["id"] == "hi")
    assert hi["input_ids"] == [*HI_PROMPT, *REASONED]
    assert hi["loss_mask"] == [0] * 6 + [1] * 8
    assert (hi["primary_id"], hi["finish_reason"], hi["partition"]) == ("hi", "stop", "math")


def test_filters_drop_truncated_min_supervised_partition(mixed_job: Storage, tmp_path: Path) -> None:
    out = tmp_path / "f.jsonl"
    options = ExportOptions(
        drop_truncated=True, partitions=frozenset({"math", "chat"}), min_supervised_tokens=8
    )
    stats = export_job(mixed_job, JOB, ExportFormat.SPECFORGE, out, options)
    # multi has 7 output tokens, tool 9; hi_t0_g1 is in partition default; trunc is truncated.
    assert [r["id"] for r in read_jsonl(out)] == ["hi", "tool"]
    assert stats.summary()["dropped"] == {"partition": 1, "truncated": 1, "min_supervised": 1, "no_input": 0}
    assert stats.duplicates == 1


def test_max_length_clips_and_counts_supervised_after_clipping(mixed_job: Storage, tmp_path: Path) -> None:
    out = tmp_path / "clip.jsonl"
    stats = export_job(mixed_job, JOB, ExportFormat.SPECFORGE, out, ExportOptions(max_length=8))
    rows = {r["id"]: r for r in read_jsonl(out)}
    check_token_rows(list(rows.values()))
    assert rows["hi"] == {"id": "hi", "input_ids": [*HI_PROMPT, 43, 2118], "loss_mask": [0] * 6 + [1, 1]}
    # The other prompts ("Question trunc?" ...) are 9 tokens or more: nothing supervised is left.
    assert set(rows) == {"hi", "hi_t0_g1"} and stats.dropped["min_supervised"] == 3
    assert stats.clipped == 2 and all(len(r["input_ids"]) == 8 for r in rows.values())
    # Clipped and unclipped batches share one schema, so the shuffle's bucket files take both: at 14
    # tokens the first shard has a clipped row (multi), the second none (hi_t0_g1 is 14, tool is dropped).
    for name, seed in (("plain.jsonl", None), ("shuffled.jsonl", 1)):
        options = ExportOptions(max_length=14, shuffle_seed=seed)
        export_job(mixed_job, JOB, ExportFormat.SPECFORGE, tmp_path / name, options)
    plain, shuffled = read_jsonl(tmp_path / "plain.jsonl"), read_jsonl(tmp_path / "shuffled.jsonl")
    assert (
        sorted(r["id"] for r in shuffled)
        == sorted(r["id"] for r in plain)
        == ["hi", "hi_t0_g1", "multi_t1_g0", "trunc"]
    )


def test_shuffle_is_deterministic_and_a_permutation(storage: Storage, tmp_path: Path) -> None:
    samples = [Sample(f"s{i:03d}", REASONED if i % 2 else [*THE_ANSWER, EOS]) for i in range(60)]
    build_job(storage, samples, shards=3)

    def order(seed: int | None, name: str) -> list[str]:
        export_job(storage, JOB, ExportFormat.SPECFORGE, tmp_path / name, ExportOptions(shuffle_seed=seed))
        return [r["id"] for r in read_jsonl(tmp_path / name)]

    plain, first, again, other = order(None, "a"), order(7, "b"), order(7, "c"), order(8, "d")
    assert first == again and first != plain and first != other
    assert sorted(first) == sorted(other) == plain
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".datagen-shuffle")]


def test_bucket_shuffle_across_buckets(tmp_path: Path) -> None:
    batches = [pa.record_batch({"x": list(range(n, n + 100))}) for n in range(0, 1000, 100)]

    def run(seed: int) -> list[int]:
        got = shuffled_batches(batches, seed=seed, buckets=7, tmp_dir=tmp_path)
        return [v for b in got for v in b.column("x").to_pylist()]

    first = run(3)
    assert first == run(3) != run(4)
    assert sorted(first) == list(range(1000)) and first != list(range(1000))
    assert not list(tmp_path.iterdir())


def test_shard_size_splits_jsonl_into_a_directory(mixed_job: Storage, tmp_path: Path) -> None:
    out = tmp_path / "shards"
    stats = export_job(mixed_job, JOB, ExportFormat.SPECFORGE, out, ExportOptions(shard_size=2))
    files = sorted(out.iterdir())
    assert [f.name for f in files] == [f"train-0000{i}-of-00003.jsonl" for i in range(3)]
    assert [len(read_jsonl(f)) for f in files] == [2, 2, 1] and stats.written == 5
    with pytest.raises(ConfigError, match="not an empty directory"):
        export_job(mixed_job, JOB, ExportFormat.SPECFORGE, out, ExportOptions(shard_size=2))


def test_cli_export_prints_a_json_summary(mixed_job: Storage, tmp_path: Path) -> None:
    out = tmp_path / "cli.jsonl"
    args = ["export", JOB, "--storage", str(mixed_job.root), "--format", "speculators", "--out", str(out)]
    result = CliRunner().invoke(app, [*args, "--drop-truncated", "--partition", "math"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["written"] == 1 and summary["duplicates"] == 1
    assert summary["dropped"] == {"partition": 3, "truncated": 1, "min_supervised": 0, "no_input": 0}
    assert [r["id"] for r in read_jsonl(out)] == ["hi"]
    bad = CliRunner().invoke(
        app,
        ["export", JOB, "--storage", str(mixed_job.root), "--format", "x", "--out", "o"],
        env={"COLUMNS": "300"},
    )
    # A format that does not exist is a usage error naming the ones that do (the option is an enum).
    assert bad.exit_code == 2
    assert "'x' is not one of 'specforge', 'speculators', 'conversations', 'parquet'" in bad.output


def test_decode_many_matches_transformers_decode() -> None:
    from datagen.export.tokens import JobTokens

    tokens = JobTokens(renderer(), EOS, THINK, THINK_END, frozenset({EOS}), frozenset({TOOL_CALLS}))
    sequences = [[*HI_PROMPT, *REASONED], [TOOL_CALLS, *THE_ANSWER], []]
    for skip in (False, True):
        expected = [renderer().decode(s, skip_special_tokens=skip) for s in sequences]
        assert tokens.decode_many(sequences, skip_special_tokens=skip) == expected


def test_stop_ids_read_generation_config(tmp_path: Path) -> None:
    assert read_stop_ids(bundled_tokenizer_path(), EOS) == {EOS}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS, 128803]}))
    assert read_stop_ids(str(tmp_path), EOS) == {EOS, 128803}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert read_stop_ids(str(tmp_path), None) == {7}


def test_tokenizer_override_must_match_the_manifest(mixed_job: Storage, tmp_path: Path) -> None:
    assert load_job_tokens(mixed_job, JOB).stop_ids == {EOS}
    manifest_path = Path(mixed_job.url(JOB, "manifest.json"))
    manifest = json.loads(manifest_path.read_text())
    manifest["tokenizer"]["tokenizer_sha256"] = "0" * 64
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match="not the one job"):
        load_job_tokens(mixed_job, JOB)


def test_export_of_a_running_job_is_a_snapshot_of_committed_shards(
    mixed_job: Storage, tmp_path: Path
) -> None:
    # A worker mid-commit: its shard is written but its commit object is not (yet).
    extra = records_to_table([make_record("late", [0, 5, 6, 1], 2, job_id=JOB)])
    records_dir = Path(mixed_job.url(JOB, "records"))
    pq.write_table(extra, records_dir / "uncommitted.parquet")
    out = tmp_path / "snapshot.jsonl"
    stats = export_job(mixed_job, JOB, ExportFormat.SPECFORGE, out)
    assert "late" not in {r["id"] for r in read_jsonl(out)}
    assert stats.records == 6
    # A shard committed while an export reads does not join it halfway.
    batches = mixed_job.iter_record_batches(JOB)
    first = next(batches)
    mixed_job.commit_shard(JOB, "later", extra, {"worker": "w"})
    seen = first.num_rows + sum(b.num_rows for b in batches)
    assert seen == 6
    assert sum(b.num_rows for b in mixed_job.iter_record_batches(JOB)) == 7  # the next export has it
