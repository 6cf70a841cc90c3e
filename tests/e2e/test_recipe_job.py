"""A job with a recipe end to end over real processes (Redis, a simulator that logs every request,
the coordinator, a worker, the CLI): three arms of reasoning effort at three temperatures, 3,000
samples. Every record's prompt ids equal an independent rendering (transformers'
``apply_chat_template``, not the project's renderer) with its arm's template variables; the arms'
shares meet the weights; the server was sent each arm's sampling; the job, the export and the report
count by arm."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import yaml
from transformers import AutoTokenizer

from datagen.prompts.tokenization import bundled_tokenizer_path, default_chat_template_path
from tests.support.e2e import FAST_STACK_ENV, get_job, job_records, start_worker
from tests.support.processes import ProcessStack, coordinator_stack
from tests.support.sim import read_request_log
from tests.support.wait import wait_until

pytestmark = pytest.mark.e2e

NS = "recipe"
ROWS = 1000
SAMPLES = 3
SEED = 11
MAX_NEW = 8
# Weights 4/4/2, as SpecForge draws gpt-oss's effort; each arm at its own temperature.
ARMS: dict[str, dict[str, Any]] = {
    "low": {"weight": 4, "effort": "low", "sampling": {"temperature": 0.6}},
    "medium": {"weight": 4, "effort": "medium", "sampling": {"temperature": 0.8}},
    "high": {"weight": 2, "effort": "high", "sampling": {"temperature": 1.0, "top_p": 0.9}},
}
JOB_TIMEOUT_S = 300.0


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[ProcessStack]:
    with coordinator_stack(tmp_path, NS, FAST_STACK_ENV) as stack:
        yield stack


def _rows() -> list[dict[str, Any]]:
    return [
        {
            "id": f"q{i}",
            "messages": [
                {"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": f"What is {i} times {i + 3}?"},
            ],
        }
        for i in range(ROWS)
    ]


def _spec_file(tmp: Path) -> Path:
    recipe = {
        "assign": "weighted",
        "seed": 5,
        "arms": [
            {
                "name": name,
                "weight": arm["weight"],
                "chat_template_kwargs": {"reasoning_effort": arm["effort"]},
                "sampling": arm["sampling"],
            }
            for name, arm in ARMS.items()
        ],
    }
    path = tmp / "recipe.yaml"
    path.write_text(yaml.safe_dump({"samples": SAMPLES, "recipe": recipe}))
    return path


def _independent_prompts(rows: list[dict[str, Any]]) -> dict[tuple[str, str], list[int]]:
    """(sample id, arm) -> the prompt ids transformers renders with the arm's kwargs."""
    tokenizer = AutoTokenizer.from_pretrained(bundled_tokenizer_path())
    template = default_chat_template_path().read_text()
    out = {}
    for row in rows:
        for name, arm in ARMS.items():
            out[(row["id"], name)] = list(
                tokenizer.apply_chat_template(
                    row["messages"],
                    add_generation_prompt=True,
                    tokenize=True,
                    return_dict=False,
                    chat_template=template,
                    reasoning_effort=arm["effort"],
                )
            )
    return out


def test_three_arms_render_sample_and_count_by_arm(stack: ProcessStack, tmp_path: Path) -> None:
    log_path = tmp_path / "requests.jsonl"
    sim = stack.spawn_sim("sim", "--time-scale", "0.01", "--request-log", str(log_path))
    start_worker(stack, "worker", f"sim={sim}", "--short-concurrency", "64")
    rows = _rows()
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # The dry run renders the first row under every arm.
    preview = stack.submit(dataset, "--spec", str(_spec_file(tmp_path)), "--dry-run")
    assert preview.returncode == 0, preview.stdout + preview.stderr
    for name in ARMS:
        assert f"arm {name} · share" in preview.stdout
    assert (
        "Answer briefly.\n\nReasoning: high<｜User｜>What is 0 times 3?<｜Assistant｜><think>"
        in preview.stdout
    )
    submitted = stack.submit(
        dataset,
        "--spec",
        str(_spec_file(tmp_path)),
        "--short-max-new-tokens",
        str(MAX_NEW),
        "--seed",
        str(SEED),
        "--job-id",
        "mix",
    )
    assert submitted.returncode == 0, submitted.stderr + stack.logs()
    job = wait_until(
        lambda: (j := get_job(stack, "mix"))["state"] == "completed" and j,
        JOB_TIMEOUT_S,
        "the job to complete",
        on_timeout=stack.logs,
    )

    records = job_records(stack, "mix")
    assert len(records) == ROWS * SAMPLES
    assert len({(r["sample_id"], r["gen"]) for r in records}) == ROWS * SAMPLES
    expected_prompts = _independent_prompts(rows)
    for record in records:
        arm = record["arm"]
        assert record["input_ids"][: record["prompt_len"]] == expected_prompts[(record["sample_id"], arm)]
        assert json.loads(record["chat_template_kwargs"]) == {"reasoning_effort": ARMS[arm]["effort"]}
        sent = json.loads(record["sampling_params"])
        assert sent["temperature"] == ARMS[arm]["sampling"]["temperature"]
        assert sent["top_p"] == ARMS[arm]["sampling"].get("top_p", 0.95)
        assert sent["sampling_seed"] == SEED + record["gen"]

    # Shares within ±3 % of the weights (4/4/2 of 10) on 3,000 samples.
    shares = Counter(r["arm"] for r in records)
    for name, arm in ARMS.items():
        assert abs(shares[name] / len(records) - arm["weight"] / 10) <= 0.03, shares

    # What reached the server: every record's request carried its arm's sampling.
    logged = {line["rid"]: line for line in read_request_log(log_path)}
    for record in records:
        params = logged[record["rid"]]["sampling_params"]
        assert params["temperature"] == ARMS[record["arm"]]["sampling"]["temperature"]
        assert params["top_p"] == ARMS[record["arm"]]["sampling"].get("top_p", 0.95)
        assert params["max_new_tokens"] == MAX_NEW

    # The job counts done per arm.
    assert {name: counts["done"] for name, counts in job["arms"].items()} == dict(shares)

    # The parquet export carries each row's arm, template variables and sampling.
    out = tmp_path / "export"
    exported = stack.cli("export", "mix", "--format", "parquet", "--out", str(out))
    assert exported.returncode == 0, exported.stdout + exported.stderr
    table = pq.read_table(sorted(out.rglob("*.parquet")))
    assert Counter(table.column("arm").to_pylist()) == shares
    kwargs = Counter(table.column("chat_template_kwargs").to_pylist())
    assert kwargs == {
        json.dumps({"reasoning_effort": ARMS[n]["effort"]}, separators=(",", ":")): k
        for n, k in shares.items()
    }

    # The report breaks the job down by arm.
    report_dir = tmp_path / "report"
    reported = stack.cli("report", "mix", "--out", str(report_dir))
    assert reported.returncode == 0, reported.stdout + reported.stderr
    assert "records by arm" in reported.stdout
    by_arm = json.loads((report_dir / "report.json").read_text())["arms"]
    assert {a["name"]: a["records"] for a in by_arm} == dict(shares)
