"""`datagen report` on jobs built in a temporary storage: clean data passes, planted defects are flagged."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from typer.testing import CliRunner

from datagen.records.storage import Storage
from datagen.report import CheckStatus, build_report
from datagen.report.stats import LENGTH_EDGES, LengthHistogram
from datagen_cli import app
from tests.support.export_jobs import (
    ASSISTANT,
    BOS,
    CLEAN,
    EOS,
    HI,
    HI_MESSAGES,
    HI_PROMPT,
    I_THINK,
    JOB,
    REASONED,
    THE_ANSWER,
    THINK,
    THINK_END,
    USER,
    Sample,
    build_job,
)

DOUBLE_NEWLINE = 271  # "\n\n"


def _statuses(storage: Storage) -> dict[str, tuple[str, int]]:
    report = build_report(storage, JOB)
    return {name: (check.status.value, check.found) for name, check in report.checks.items()}


def test_clean_job_passes_with_counts(storage: Storage, tmp_path: Path) -> None:
    build_job(storage, CLEAN)
    report = build_report(storage, JOB)
    assert not report.failed
    assert (report.records, report.unique) == (3, 3)
    assert report.by_finish == {"stop": 2, "length": 1}
    assert report.by_partition == {"math": 2, "chat": 1}
    assert report.by_partition_finish[("math", "length")] == 1
    assert report.by_class == {"short": 3}
    # Prompts: "Hi" is 6 tokens (twice), the two-turn one 12; outputs: 8 and 7 (stop), 5 (length).
    assert (report.prompt_lengths.count, report.prompt_lengths.total) == (3, 24)
    assert (report.prompt_lengths.minimum, report.prompt_lengths.maximum) == (6, 12)
    assert report.output_lengths["stop"].total == 15 and report.output_lengths["length"].total == 5
    statuses = {n: c.status for n, c in report.checks.items()}
    assert statuses.pop("truncated") is CheckStatus.WARN  # counted, not a failure
    assert set(statuses.values()) == {CheckStatus.OK}

    result = CliRunner().invoke(
        app, ["report", JOB, "--storage", str(storage.root), "--out", str(tmp_path / "r")]
    )
    assert result.exit_code == 0, result.output
    assert "all checks pass" in result.stdout
    page = (tmp_path / "r" / "report.html").read_text("utf-8")
    assert page.count("data:image/png;base64,") == 2
    assert (tmp_path / "r" / "output_lengths.png").read_bytes().startswith(b"\x89PNG")
    data = json.loads((tmp_path / "r" / "report.json").read_text("utf-8"))
    assert data["by_finish"] == {"stop": 2, "length": 1} and data["failed"] is False
    assert data["by_partition"]["math"] == {"total": 2, "stop": 1, "length": 1}


def test_planted_defects_are_flagged(storage: Storage) -> None:
    samples = [
        *CLEAN,
        Sample("nothink", [*THE_ANSWER, EOS], messages=HI_MESSAGES),  # stop without </think>
        Sample("hi", [*THE_ANSWER, EOS], messages=HI_MESSAGES),  # the same key again
        Sample("hi-copy", REASONED, messages=HI_MESSAGES),  # hi's exact ids under another key
        Sample("nostop", [*I_THINK, THINK_END, *THE_ANSWER], messages=HI_MESSAGES),  # no EOS at the end
        Sample("noprompt", [*THE_ANSWER, EOS], prompt=[BOS, USER, *HI, ASSISTANT]),  # no <think>\n
    ]
    build_job(storage, samples)
    rejected = [{"line": 4, "reason": "invalid JSON: Expecting value (column 1)"}, {"line": 9, "reason": "x"}]
    storage.write_rejected(JOB, "upload.jsonl", rejected)
    assert _statuses(storage) == {
        "generation_prompt": ("fail", 1),
        "think_end": ("fail", 1),
        "stop_id": ("fail", 1),
        "duplicate_sequences": ("fail", 1),
        "duplicate_keys": ("warn", 1),
        "truncated": ("warn", 1),
        "rejected_rows": ("warn", 2),
        "flagged_rows": ("ok", 0),
    }
    report = build_report(storage, JOB)
    assert report.checks["think_end"].examples == ["nothink (0 think-end tokens, finish stop)"]
    assert report.checks["stop_id"].examples == ["nostop (last output id 16)"]
    assert report.checks["duplicate_sequences"].examples == ["hi-copy repeats hi"]
    assert report.checks["generation_prompt"].examples == ["noprompt"]
    assert report.rejected_reasons == {"invalid JSON": 1, "x": 1}
    assert (report.records, report.unique) == (8, 7)

    result = CliRunner().invoke(app, ["report", JOB, "--storage", str(storage.root)])
    assert result.exit_code == 1
    assert "checks failed" in result.stdout


def test_length_histogram_bins_by_hand() -> None:
    histogram = LengthHistogram()
    histogram.add(np.array([0, 1, 5, 6, 1000, 1000, 3_000_000]))
    assert LENGTH_EDGES[:8] == (0, 1, 2, 3, 4, 5, 6, 8)
    assert histogram.counts[LENGTH_EDGES.index(5)] == 1 and histogram.counts[LENGTH_EDGES.index(6)] == 1
    # 1000 lies in [2**(39/4), 2**(40/4)) = [861, 1024); 3 million in the open last bin.
    assert histogram.counts[LENGTH_EDGES.index(861)] == 2 and histogram.counts[-1] == 1
    assert (histogram.count, histogram.minimum, histogram.maximum) == (7, 0, 3_000_000)
    # Quantiles are the top of the bin where the cumulative count gets there: 6 is in [6, 8).
    assert histogram.quantile(0.5) == 7 and histogram.quantile(0.8) == 1023
    assert [(low, count) for low, _, count in histogram.octaves()][:4] == [(0, 1), (1, 1), (2, 0), (4, 2)]


def test_thinking_off_outputs_must_not_close_a_think_block(storage: Storage) -> None:
    samples = [Sample("plain", [*THE_ANSWER, EOS]), Sample("closes", REASONED)]
    build_job(storage, samples, spec={"chat_template_kwargs": {"thinking": False}})
    report = build_report(storage, JOB)
    assert report.checks["think_end"].examples == ["closes (1 think-end tokens, finish stop)"]
    assert report.checks["generation_prompt"].found == 0
    # The premise: with thinking off, the template closes the think block in the prompt itself
    # ("<｜Assistant｜><think>\n\n</think>\n\n"), where a thinking-on prompt ends with "<think>\n".
    prompts = [
        row["input_ids"][: row["prompt_len"]]
        for batch in storage.iter_record_batches(JOB, columns=["input_ids", "prompt_len"])
        for row in batch.to_pylist()
    ]
    assert len(prompts) == 2
    for prompt in prompts:
        assert prompt[-5:] == [ASSISTANT, THINK, DOUBLE_NEWLINE, THINK_END, DOUBLE_NEWLINE]
        assert prompt[-2:] != HI_PROMPT[-2:]
