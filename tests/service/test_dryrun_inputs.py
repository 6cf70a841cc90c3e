"""The dry run of every input ``POST /jobs`` takes, over a real Redis, the real tokenizer and template:
compressed JSONL and Parquet uploads (columns mapped), a Parquet directory by reference under the
allowlist; each rendered as the same rows given as JSONL are, with the input's row total where its
format knows it, and only the first rows read. Bad inputs and references get one 4xx line, and
``datagen submit --dry-run`` takes them all."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from datagen.errors import InvalidSpecError
from datagen.prompts.tokenization import bundled_tokenizer_path, default_chat_template_path
from datagen.settings import CoordinatorSettings
from datagen_cli import app as cli
from service.dryrun import DRY_RUN_ROWS, reading
from tests.support.processes import serve_coordinator
from tests.support.specs import CLASS_LIMITS, spec_json

NS = "dryin"
# The DeepSeek tokenizer and datagen/templates/deepseek_r1.jinja, read off once and written by hand
# (as in tests/service/test_app.py): "Hi" is [0, 128803, 23166, 128804, 128821, 201].
HI_PROMPT = "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜><think>\n"
HI_TOKENS = 6
# Rows past the dry run's sample: their total is known only where the format says it.
BIG_ROWS = DRY_RUN_ROWS + 500
# What the preview says of the rows it rendered, whatever the input's format.
RENDERED = ("rows_sampled", "prompts", "classes", "rejected", "prompt_tokens_sampled", "examples", "hygiene")
# A password in a dataset URL, never to be shown.
PASSWORD = "hunter2-secret"


@pytest.fixture
def refs(tmp_path: Path) -> Path:
    path = tmp_path / "refs"
    path.mkdir()
    return path


@pytest.fixture
def settings(redis_url: str, tmp_path: Path, refs: Path) -> CoordinatorSettings:
    return CoordinatorSettings(
        redis_url=redis_url, storage=str(tmp_path / "store"), namespace=NS, dataset_allowlist=str(refs)
    )


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


# Three rows as JSONL: one a wizard's, which ingestion rejects.
ROWS = [
    {"id": "h", "messages": _user("Hi")},
    {"id": "bad", "messages": [{"role": "wizard", "content": "x"}]},
    {"id": "y", "messages": _user("Yo")},
]
JSONL = b"".join(json.dumps(row).encode() + b"\n" for row in ROWS)
# The same rows with other column names, mapped back with messages_column / id_column.
MAPPED = {"messages_column": "conv", "id_column": "uid"}


def _table(rows: list[dict[str, Any]]) -> pa.Table:
    return pa.table({"uid": [r["id"] for r in rows], "conv": [r["messages"] for r in rows]})


def _parquet_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, row_group_size=2)
    return bytes(sink.getvalue().to_pybytes())


def _dry_run(client: TestClient, name: str | None = None, body: bytes = b"", **fields: str) -> Any:
    files = None if name is None else {"dataset": (name, body, "application/octet-stream")}
    return client.post("/jobs/dry-run", data={"spec": spec_json(CLASS_LIMITS), **fields}, files=files)


def _preview(client: TestClient, name: str | None = None, body: bytes = b"", **fields: str) -> dict[str, Any]:
    response = _dry_run(client, name, body, **fields)
    assert response.status_code == 200, response.text
    preview: dict[str, Any] = response.json()
    return preview


def _rendered(preview: dict[str, Any]) -> dict[str, Any]:
    return {key: preview[key] for key in RENDERED}


@pytest.fixture
def as_jsonl(client: TestClient) -> dict[str, Any]:
    """The dry run of ``ROWS`` as a plain JSONL upload: what every other form must render alike."""
    preview = _preview(client, "d.jsonl", JSONL)
    [first, second] = preview["examples"]
    assert (first["sample_id"], first["prompt"], first["prompt_tokens"]) == ("h", HI_PROMPT, HI_TOKENS)
    assert second["sample_id"] == "y"
    assert [row["line"] for row in preview["rejected"]] == [2]
    assert (preview["format"], preview["rows_total"], preview["estimated_prompts"]) == ("jsonl", 3, 2)
    assert (preview["bytes_sampled"], preview["bytes_total"]) == (len(JSONL), len(JSONL))
    return _rendered(preview)


@pytest.mark.parametrize(
    ("name", "pack", "fmt"),
    [
        ("d.jsonl.gz", gzip.compress, "jsonl.gz"),
        ("d.jsonl.zst", lambda b: zstandard.ZstdCompressor().compress(b), "jsonl.zst"),
    ],
)
def test_a_compressed_jsonl_upload_renders_as_its_jsonl(
    client: TestClient, as_jsonl: dict[str, Any], name: str, pack: Any, fmt: str
) -> None:
    preview = _preview(client, name, pack(JSONL))
    assert _rendered(preview) == as_jsonl
    # All of it was sampled: its rows are known; bytes are a plain JSONL's measure only.
    assert (preview["format"], preview["rows_total"], preview["estimated_prompts"]) == (fmt, 3, 2)
    assert (preview["bytes_sampled"], preview["bytes_total"]) == (None, None)


def test_a_parquet_upload_with_mapped_columns_renders_as_its_jsonl(
    client: TestClient, as_jsonl: dict[str, Any]
) -> None:
    body = _parquet_bytes(_table(ROWS))
    preview = _preview(client, "rows.parquet", body, **MAPPED)
    assert _rendered(preview) == as_jsonl
    assert (preview["format"], preview["rows_total"]) == ("parquet", 3)
    # Told by the format field where the name does not tell.
    assert _rendered(_preview(client, "blob", body, format="parquet", **MAPPED)) == as_jsonl


def test_a_parquet_directory_by_reference_renders_as_its_jsonl(
    client: TestClient, as_jsonl: dict[str, Any], refs: Path
) -> None:
    shards = refs / "shards"
    shards.mkdir()
    pq.write_table(_table(ROWS[:2]), shards / "part-0.parquet")
    pq.write_table(_table(ROWS[2:]), shards / "part-1.parquet")
    preview = _preview(client, dataset_url=str(shards), **MAPPED)
    assert _rendered(preview) == as_jsonl
    assert (preview["format"], preview["rows_total"]) == ("parquet-dir", 3)


def test_a_saved_dataset_by_reference_renders_as_its_jsonl(
    client: TestClient, as_jsonl: dict[str, Any], refs: Path
) -> None:
    datasets = pytest.importorskip("datasets")
    rows = [{"uid": r["id"], "conv": r["messages"]} for r in ROWS]
    datasets.Dataset.from_list(rows).save_to_disk(str(refs / "saved"))
    preview = _preview(client, dataset_url=str(refs / "saved"), **MAPPED)
    assert _rendered(preview) == as_jsonl
    assert (preview["format"], preview["rows_total"]) == ("hf-dataset", 3)


def _big_rows(start: int, count: int) -> list[dict[str, Any]]:
    return [{"id": f"r{i}", "messages": _user(f"Question {i}?")} for i in range(start, start + count)]


def test_a_parquet_total_comes_from_its_footers_past_the_sample(client: TestClient, refs: Path) -> None:
    # One file: its footer. Two shards: each one's footer, though the sample reads only the first.
    upload = _preview(client, "big.parquet", _parquet_bytes(_table(_big_rows(0, BIG_ROWS))), **MAPPED)
    shards = refs / "big"
    shards.mkdir()
    pq.write_table(_table(_big_rows(0, DRY_RUN_ROWS + 100)), shards / "part-0.parquet")
    pq.write_table(_table(_big_rows(DRY_RUN_ROWS + 100, 400)), shards / "part-1.parquet")
    by_reference = _preview(client, dataset_url=str(shards), **MAPPED)
    for preview in (upload, by_reference):
        assert (preview["rows_sampled"], preview["rows_total"]) == (DRY_RUN_ROWS, BIG_ROWS)
        assert (preview["estimated_rows"], preview["estimated_prompts"]) == (BIG_ROWS, BIG_ROWS)


def test_a_big_gzip_upload_is_read_only_as_far_as_its_sample(client: TestClient) -> None:
    """Rows past the sample, then bytes that are no gzip at all: reading it all would fail, the dry
    run never gets there, and says it does not know the total rather than reading it."""
    rows = b"".join(json.dumps(row).encode() + b"\n" for row in _big_rows(0, BIG_ROWS))
    preview = _preview(client, "big.jsonl.gz", gzip.compress(rows) + b"not gzip" * 1000)
    assert (preview["rows_sampled"], preview["prompts"], preview["rows_total"]) == (DRY_RUN_ROWS,) * 2 + (
        None,
    )
    assert (preview["estimated_rows"], preview["estimated_prompts"]) == (None, None)


def test_a_big_plain_jsonl_upload_is_estimated_by_bytes(client: TestClient) -> None:
    rows = [json.dumps(row).encode() + b"\n" for row in _big_rows(0, BIG_ROWS)]
    preview = _preview(client, "big.jsonl", b"".join(rows))
    assert (preview["rows_sampled"], preview["rows_total"]) == (DRY_RUN_ROWS, None)
    assert preview["bytes_sampled"] == sum(map(len, rows[:DRY_RUN_ROWS]))
    # Later rows are a few bytes longer (longer ids and questions): the sample's rows stand for a
    # few too many.
    assert BIG_ROWS <= preview["estimated_rows"] < 1.05 * BIG_ROWS


@pytest.mark.parametrize(
    ("name", "body", "fields", "status", "message"),
    [
        (
            "d.jsonl",
            JSONL,
            {"messages_column": "conv"},
            400,
            "--messages-column and --id-column map Parquet and Arrow columns; this dataset is jsonl: name "
            "its fields messages and id",
        ),
        (
            "d",
            JSONL,
            {"format": "parquet-dir"},
            400,
            "a parquet-dir dataset is a directory and cannot be uploaded: give it by reference (dataset_url)",
        ),
        (
            "d.txt",
            JSONL,
            {"format": "csv"},
            400,
            "unknown dataset format 'csv': use one of jsonl, jsonl.gz, jsonl.zst, parquet, parquet-dir, "
            "hf-dataset",
        ),
        (
            None,
            b"",
            {},
            422,
            "give the dataset as an upload (`dataset`) or by reference (`dataset_url`), one of the two",
        ),
        (
            "x.parquet",
            _parquet_bytes(pa.table({"conversation": [_user("Hi")]})),
            {"messages_column": "conv"},
            400,
            "--messages-column 'conv': x.parquet has no such column (it has: conversation)",
        ),
    ],
    # Not the bodies: test ids must be the same in every xdist worker.
    ids=lambda value: f"{len(value)}-bytes" if isinstance(value, bytes) else None,
)
def test_an_input_that_cannot_be_read_is_refused_in_one_line(
    client: TestClient, name: str | None, body: bytes, fields: dict[str, str], status: int, message: str
) -> None:
    response = _dry_run(client, name, body, **fields)
    assert (response.status_code, response.json()["error"]) == (status, message)


@pytest.mark.parametrize(
    "body",
    [b"plain text", b"PAR1 not parquet", gzip.compress(JSONL, mtime=0)[:30]],
    ids=["text", "parquet-magic", "gzip-cut"],
)
def test_a_file_that_is_not_its_format_is_a_400(client: TestClient, body: bytes) -> None:
    for name in ("d.parquet", "d.jsonl.gz", "d.jsonl.zst"):
        response = _dry_run(client, name, body)
        assert response.status_code == 400, (name, response.text)
        assert response.json()["error"].startswith(f"cannot read {name}"), response.text


def test_a_reference_outside_the_allowlist_is_refused_as_the_submit_refuses_it(
    client: TestClient, tmp_path: Path
) -> None:
    outside = tmp_path / "outside.parquet"
    pq.write_table(_table(ROWS), outside)
    for url in (str(outside), f"s3://user:{PASSWORD}@data/d.parquet"):
        answers = [
            client.post(path, data={"spec": spec_json(CLASS_LIMITS), "dataset_url": url})
            for path in (
                "/jobs/dry-run",
                "/jobs",
            )
        ]
        shown = url.replace(PASSWORD, "***")
        for response in answers:
            assert (response.status_code, response.json()["error"]) == (
                400,
                f"dataset_url {shown!r} is not allowed on this coordinator; an operator must add it (or a "
                "prefix of it) to DATAGEN_DATASET_ALLOWLIST",
            )
            assert PASSWORD not in response.text


def test_a_missing_reference_is_a_400(client: TestClient, refs: Path) -> None:
    response = _dry_run(client, dataset_url=str(refs / "nothing.parquet"))
    assert response.status_code == 400
    assert response.json()["error"].startswith(f"dataset {refs / 'nothing.parquet'} is not there")


def test_a_password_a_lower_layer_put_in_its_message_is_not_shown() -> None:
    url = f"https://reader:{PASSWORD}@example.org/d.parquet"
    with pytest.raises(InvalidSpecError) as raised, reading("the dataset", None, url):
        raise InvalidSpecError(f"dataset is not there ({url}); check the URL")
    assert (
        str(raised.value) == "dataset is not there (https://reader:***@example.org/d.parquet); check the URL"
    )


def test_datagen_submit_dry_runs_a_parquet_file_and_a_reference(
    settings: CoordinatorSettings, refs: Path, tmp_path: Path
) -> None:
    upload = tmp_path / "x.parquet"
    pq.write_table(_table(ROWS), upload)
    pq.write_table(_table(ROWS), refs / "rows.parquet")
    common = (
        *("--tokenizer", bundled_tokenizer_path(), "--chat-template", str(default_chat_template_path())),
        *("--context-len", "4096", "--messages-column", "conv", "--id-column", "uid", "--dry-run"),
    )
    runner = CliRunner(env={"COLUMNS": "200"})
    with serve_coordinator(settings) as url:
        given = [
            ["submit", str(upload), "--format", "parquet", *common, "--coordinator", url],
            ["submit", "--dataset-url", str(refs / "rows.parquet"), *common, "--coordinator", url],
        ]
        results = [runner.invoke(cli, args) for args in given]
    for result in results:
        assert result.exit_code == 0, result.output
        assert HI_PROMPT.rstrip("\n") in result.output
        assert "sampled 3 rows: 2 prompts, 2 short / 0 long, 1 rejected" in result.output
        assert "parquet input, 3 rows\n" in result.output
        assert "--dry-run reads" not in result.output


def test_a_url_that_does_not_parse_is_refused_in_one_line_without_its_password(client: TestClient) -> None:
    url = f"s3://user:{PASSWORD}@[data/d.parquet"  # an unclosed "[": urlsplit cannot read it
    for path in ("/jobs/dry-run", "/jobs"):
        response = client.post(path, data={"spec": spec_json(CLASS_LIMITS), "dataset_url": url})
        assert (response.status_code, response.json()["error"]) == (
            400,
            "dataset_url 's3://***@[data/d.parquet' is not allowed on this coordinator; an operator must "
            "add it (or a prefix of it) to DATAGEN_DATASET_ALLOWLIST",
        )
