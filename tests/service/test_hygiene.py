"""Deduplication and benchmark decontamination at ingestion, over the real coordinator and Redis."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from datagen.records.storage import Storage
from datagen.report import build_report
from datagen.settings import CoordinatorSettings
from service.app import create_app
from tests.support.ingest import wait_ingested
from tests.support.planted import CONTAMINATED, NEAR_COPIES, ROWS, planted_rows, write_benchmark
from tests.support.specs import make_spec

NS = "t"


@pytest.fixture
def settings(redis_url: str, tmp_path: Path) -> CoordinatorSettings:
    # Benchmark files are read from tmp_path: the operator's allowlist must name it.
    return CoordinatorSettings(
        redis_url=redis_url,
        storage=str(tmp_path / "store"),
        namespace=NS,
        tokenizer_allowlist=str(tmp_path / "benchmarks"),
    )


def _body(rows: list[dict[str, Any]]) -> bytes:
    return ("\n".join(json.dumps(r) for r in rows) + "\n").encode()


def _post(client: TestClient, rows: list[dict[str, Any]], job_id: str, **spec: Any) -> None:
    files = {"dataset": ("d.jsonl", _body(rows), "application/jsonl")}
    data = {"spec": json.dumps(make_spec(**spec)), "job_id": job_id}
    response = client.post("/jobs", data=data, files=files)
    assert response.status_code == 202, response.text


def _rejected(client: TestClient, job_id: str) -> dict[int, dict[str, Any]]:
    errors = client.get(f"/jobs/{job_id}/errors", params={"kind": "rejected", "limit": 10_000}).json()
    return {e["line"]: e for e in errors["errors"]}


def _row(sample_id: str, text: str) -> dict[str, Any]:
    return {"id": sample_id, "messages": [{"role": "user", "content": text}]}


def test_planted_near_duplicates_and_contaminated_rows_are_rejected(
    client: TestClient, tmp_path: Path
) -> None:
    benchmark = tmp_path / "benchmarks" / "bench.jsonl"
    write_benchmark(benchmark)
    spec = {"dedup": "near", "decontaminate": [str(benchmark)]}
    _post(client, planted_rows(), "planted", **spec)
    job = wait_ingested(client, "planted")
    rejected = _rejected(client, "planted")
    found_copies = {
        line for line, kept in NEAR_COPIES.items() if rejected.get(line, {}).get("duplicate_of") == kept
    }
    found_items = {
        line
        for line, item in CONTAMINATED.items()
        if rejected.get(line, {}).get("reason") == f"contaminated: bench {item}"
    }
    clean = ROWS - len(NEAR_COPIES) - len(CONTAMINATED)
    flagged_clean = set(rejected) - set(NEAR_COPIES) - set(CONTAMINATED)
    assert len(found_copies) >= 0.95 * len(NEAR_COPIES)
    assert len(found_items) >= 0.95 * len(CONTAMINATED)
    assert len(flagged_clean) <= 0.005 * clean
    # Hand-checked: line 101 is the edited copy of line 4; line 505 embeds item B0.
    assert rejected[101]["reason"] == "duplicate of line 4"
    assert rejected[505]["reason"] == "contaminated: bench B0"
    assert job["rejected"] == len(rejected) and job["total"] == ROWS - len(rejected)


def test_exact_duplicates_are_rejected_across_uploads_and_restarts(
    settings: CoordinatorSettings, client: TestClient
) -> None:
    first = [
        _row("a", "What is the capital of France?"),
        _row("b", "what  is the CAPITAL of France?"),
        _row("c", "Other."),
    ]
    _post(client, first, "exact")
    wait_ingested(client, "exact")
    assert {line: e["reason"] for line, e in _rejected(client, "exact").items()} == {2: "duplicate of line 1"}

    with TestClient(create_app(settings)) as restarted:  # a new coordinator reads the seen rows back
        # Line 1 repeats row "a" (not enqueued again, and not counted again: the first upload counted
        # it); line 2 is "c" again under a new id.
        _post(restarted, [_row("a", "What is the capital of France?"), _row("d", "OTHER.")], "exact")
        job = wait_ingested(restarted, "exact")
        reasons = [(e["line"], e["reason"]) for e in restarted.get("/jobs/exact/errors").json()["errors"]]
    assert reasons == [(2, "duplicate of line 1"), (2, "duplicate of line 3 of an earlier upload")]
    assert (job["rows"], job["total"], job["skipped"], job["rejected"]) == (4, 2, 0, 2)


def test_dedup_off_keeps_every_row(client: TestClient) -> None:
    rows = [_row("a", "Same text."), _row("b", "same text.")]
    _post(client, rows, "off", dedup="off")
    assert wait_ingested(client, "off")["total"] == 2


def test_builtin_humaneval_set_is_matched(client: TestClient) -> None:
    humaneval_0 = (
        "from typing import List\n\n\n"
        "def has_close_elements(numbers: List[float], threshold: float) -> bool:\n"
        '    """ Check if in given list of numbers, are any two numbers closer to each other than\n'
        "    given threshold."
    )
    rows = [_row("a", f"Please solve this. {humaneval_0} Thanks!"), _row("b", "Write a haiku about rain.")]
    _post(client, rows, "he", decontaminate=["humaneval"])
    wait_ingested(client, "he")
    assert [(line, e["reason"]) for line, e in _rejected(client, "he").items()] == [
        (1, "contaminated: humaneval HumanEval/0")
    ]


def test_dry_run_reports_what_ingestion_rejects(client: TestClient, tmp_path: Path) -> None:
    benchmark = tmp_path / "benchmarks" / "bench.jsonl"
    write_benchmark(benchmark)
    rows = planted_rows()
    spec = json.dumps(make_spec(dedup="near", decontaminate=[str(benchmark)]))
    files = {"dataset": ("d.jsonl", _body(rows), "application/jsonl")}
    preview = client.post("/jobs/dry-run", data={"spec": spec}, files=files).json()
    _post(client, rows, "same", dedup="near", decontaminate=[str(benchmark)])
    wait_ingested(client, "same")
    ingested = _rejected(client, "same")
    assert {r["line"]: r["reason"] for r in preview["rejected"]} == {
        k: v["reason"] for k, v in ingested.items()
    }
    hygiene = preview["hygiene"]
    assert (hygiene["duplicates"], hygiene["contaminated"]) == (40, 19)
    first = hygiene["examples"][0]
    # Side by side: line 101 and the row it copies (line 4).
    assert (first["line"], first["duplicate_of"], first["match"]) == (101, 4, "near")
    assert first["kept_text"] == rows[3]["messages"][0]["content"][:200]  # type: ignore[index]


def test_a_relative_decontamination_path_is_refused(client: TestClient) -> None:
    files = {"dataset": ("d.jsonl", _body([_row("a", "x")]), "application/jsonl")}
    data = {"spec": json.dumps(make_spec(decontaminate=["bench.jsonl"]))}
    response = client.post("/jobs", data=data, files=files)
    assert response.status_code == 400
    assert "built-in set (humaneval)" in response.json()["error"]


def test_a_decontamination_file_outside_the_allowlist_is_refused_unread(
    client: TestClient, tmp_path: Path
) -> None:
    secret = tmp_path / "secret.jsonl"
    secret.write_text(
        json.dumps({"prompt": "the launch code is 0000 and must never leave this host ok"}) + "\n"
    )
    files = {"dataset": ("d.jsonl", _body([_row("a", "the launch code is 0000")]), "application/jsonl")}
    for route in ("/jobs", "/jobs/dry-run"):
        data = {"spec": json.dumps(make_spec(decontaminate=[str(secret)]))}
        response = client.post(route, data=data, files=files)
        assert response.status_code == 400, response.text
        assert "is not allowed on this coordinator" in response.json()["error"]
        assert "launch code" not in response.text


def test_report_counts_rejected_rows_by_class_and_partition(
    settings: CoordinatorSettings, client: TestClient
) -> None:
    rows = [
        {**_row("a", "Tell me about owls."), "partition": "birds"},
        {**_row("b", "tell me about OWLS."), "partition": "birds"},
        {**_row("c", "Tell me about owls."), "partition": "night"},
        {"id": "d", "messages": [{"role": "wizard", "content": "x"}]},
    ]
    _post(client, rows, "report")
    wait_ingested(client, "report")
    report = build_report(Storage(settings.storage), "report").to_json()
    assert report["rejected_by_class"] == {"duplicate": 2, "other": 1}
    assert report["rejected_by_partition"] == {
        "birds": {"duplicate": 1},
        "night": {"duplicate": 1},
        "unknown": {"other": 1},
    }
    assert report["rejected_reasons"]["duplicate"] == 2
