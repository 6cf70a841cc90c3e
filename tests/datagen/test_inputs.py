"""Every input format read as the JSONL rows `iter_prompts` reads: real files written by gzip,
zstandard, pyarrow and `datasets`, read back through `datagen.prompts.inputs`."""

from __future__ import annotations

import gzip
import io
import json
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from datagen.errors import InvalidSpecError
from datagen.prompts.dataset import Prompt, RowError, iter_prompts
from datagen.prompts.inputs import (
    PIN_EDGE_BYTES,
    ColumnMap,
    InputFile,
    InputFormat,
    Reference,
    RowStream,
    _storage,
    check_unchanged,
    format_for_name,
    open_reference,
    open_upload,
    parse_format,
    resolve_reference,
)
from datagen.prompts.sources import without_password

ROWS: list[dict[str, Any]] = [
    {"id": "a", "messages": [{"role": "user", "content": "Hi"}]},
    {"id": "b", "prompt": "Yo", "system": "Be brief."},
]


def _jsonl(rows: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


def _parquet(path: Path, columns: ColumnMap | None = None, name: str | None = None) -> RowStream:
    return open_upload(path.open("rb"), InputFormat.PARQUET, columns or ColumnMap(), name=name)


def _lines(stream: Any) -> list[bytes]:
    return list(iter(stream.readline, b""))


def test_the_format_is_told_by_the_name_or_refused_in_one_line() -> None:
    assert [
        format_for_name(n) for n in ("a.jsonl", "a.JSONL.GZ", "a.jsonl.zstd", "b.jsonl.zst", "c.parquet")
    ] == [
        InputFormat.JSONL,
        InputFormat.JSONL_GZ,
        InputFormat.JSONL_ZST,
        InputFormat.JSONL_ZST,
        InputFormat.PARQUET,
    ]
    assert format_for_name("d.csv") is None
    assert parse_format("hf-dataset") is InputFormat.HF_DATASET
    with pytest.raises(InvalidSpecError) as caught:
        parse_format("csv")
    assert str(caught.value) == (
        "unknown dataset format 'csv': use one of jsonl, jsonl.gz, jsonl.zst, parquet, parquet-dir, "
        "hf-dataset"
    )


@pytest.mark.parametrize(
    ("fmt", "pack"),
    [
        (InputFormat.JSONL, lambda b: b),
        (InputFormat.JSONL_GZ, gzip.compress),
        (InputFormat.JSONL_ZST, lambda b: zstandard.ZstdCompressor().compress(b)),
    ],
)
def test_jsonl_streams_decompressed_with_bytes_progress(fmt: InputFormat, pack: Any) -> None:
    blob = pack(_jsonl(ROWS))
    stream = open_upload(io.BytesIO(blob), fmt, ColumnMap(), name="d", size=len(blob))
    items = list(iter_prompts(stream))  # type: ignore[arg-type]
    assert [(i.line, i.sample_id) for i in items] == [(1, "a"), (2, "b")]
    assert stream.locate(2) == ("d", 2)
    assert stream.progress() == {
        "format": fmt.value,
        "rows_read": 2,
        "rows_total": None,
        "bytes_read": len(blob),
        "bytes_total": len(blob),
    }


def test_parquet_rows_map_columns_drop_null_struct_fields_and_parse_json_strings(tmp_path: Path) -> None:
    table = pa.table(
        {
            "uid": ["a", "b", "c", "d"],
            "conv": [
                [{"role": "user", "content": "Hi", "name": None}],
                [{"role": "user", "content": "Yo", "name": "n"}],
                None,
                None,
            ],
            "tools": [None, None, None, '[{"type": "function", "function": {"name": "f"}}]'],
            "prompt": [None, None, None, "Hello"],
            "unread": ["x", "y", "z", "w"],  # not a row field: never read
        }
    )
    pq.write_table(table, tmp_path / "x.parquet", row_group_size=2)
    with _parquet(tmp_path / "x.parquet", ColumnMap(messages="conv", id="uid"), "x.parquet") as stream:
        assert stream.progress()["rows_total"] == 4
        assert [json.loads(line) for line in _lines(stream)] == [
            {"id": "a", "messages": [{"role": "user", "content": "Hi"}]},
            {"id": "b", "messages": [{"role": "user", "content": "Yo", "name": "n"}]},
            {"id": "c"},
            {"id": "d", "tools": [{"type": "function", "function": {"name": "f"}}], "prompt": "Hello"},
        ]
        assert stream.locate(3) == ("x.parquet", 3)
        assert stream.progress()["rows_read"] == 4


def test_a_wrong_column_flag_is_one_line_naming_the_columns(tmp_path: Path) -> None:
    pq.write_table(pa.table({"conversation": [[{"role": "user", "content": "Hi"}]]}), tmp_path / "x.parquet")
    with pytest.raises(InvalidSpecError) as caught:
        _parquet(tmp_path / "x.parquet", ColumnMap(messages="conv"), "x")
    assert str(caught.value) == "--messages-column 'conv': x has no such column (it has: conversation)"


def test_readline_with_a_limit_returns_a_long_row_in_pieces(tmp_path: Path) -> None:
    pq.write_table(pa.table({"prompt": ["x" * 50, "y"]}), tmp_path / "x.parquet")
    with _parquet(tmp_path / "x.parquet") as stream:
        first = stream.readline(20)
        assert first == b'{"prompt": "xxxxxxxx'
        rest = stream.readline(100)
        assert (first + rest).endswith(b'x"}\n') and stream.readline() == b'{"prompt": "y"}\n'
        assert stream.readline() == b""


def test_a_parquet_directory_is_numbered_across_its_files_in_sorted_order(tmp_path: Path) -> None:
    data = tmp_path / "shards"
    data.mkdir()
    pq.write_table(pa.table({"id": ["c"], "prompt": ["3"]}), data / "b.parquet")
    pq.write_table(pa.table({"id": ["a", "b"], "prompt": ["1", None]}), data / "a.parquet")
    (data / "README.md").write_text("not a shard")
    reference = resolve_reference(str(data))
    assert (reference.format, [f.name for f in reference.files]) == (
        InputFormat.PARQUET_DIR,
        ["a.parquet", "b.parquet"],
    )
    with open_reference(Reference.from_json(reference.to_json()), ColumnMap()) as stream:
        items = list(iter_prompts(stream))  # type: ignore[arg-type]
        assert [(type(i).__name__, i.line) for i in items] == [("Prompt", 1), ("RowError", 2), ("Prompt", 3)]
        assert [stream.locate(n) for n in (1, 2, 3)] == [("a.parquet", 1), ("a.parquet", 2), ("b.parquet", 1)]
        assert stream.progress()["rows_total"] == 3  # from the footers, once the first batch is out


def test_a_saved_dataset_is_read_from_its_arrow_files(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    rows = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(3)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(InvalidSpecError, match="several splits: give one split's directory"):
        resolve_reference(str(tmp_path / "dd"))
    reference = resolve_reference(str(tmp_path / "dd" / "train"))
    assert reference.format is InputFormat.HF_DATASET
    assert reference.rows_total is None  # saved from memory: its info counts no split
    with open_reference(reference, ColumnMap()) as stream:
        items = [i for i in iter_prompts(stream) if isinstance(i, Prompt)]  # type: ignore[arg-type]
        assert stream.progress()["rows_total"] == 3  # counted from the arrow files, mapped
        assert [(i.sample_id, i.messages) for i in items] == [
            (f"r{n}", [{"role": "user", "content": f"q{n}"}]) for n in range(3)
        ]
        assert stream.progress()["rows_read"] == 3
        assert stream.locate(3) == (reference.files[0].name, 3)


def test_a_changed_input_is_refused_without_the_url_s_password() -> None:
    url = "https://reader:s3cr3t@data.example/d.parquet"
    pinned = Reference(url, InputFormat.PARQUET, [InputFile("d.parquet", {"size": 1, "etag": "a"})])
    now = Reference(url, InputFormat.PARQUET, [InputFile("d.parquet", {"size": 1, "etag": "b"})])
    with pytest.raises(InvalidSpecError) as caught:
        check_unchanged(pinned, now)
    assert str(caught.value).startswith(
        "dataset https://reader:***@data.example/d.parquet: d.parquet changed since it was submitted "
        "(etag differ)"
    )
    elsewhere = Reference(url, InputFormat.PARQUET, [InputFile("e.parquet", {"size": 1})])
    with pytest.raises(InvalidSpecError) as caught:
        check_unchanged(pinned, elsewhere)
    assert "s3cr3t" not in str(caught.value) and "reader:***@" in str(caught.value)


@pytest.mark.parametrize(
    ("url", "message", "shown"),
    [
        ("https://reader:s3cr3t@h/d", "404 for https://reader:s3cr3t@h/d", "404 for https://reader:***@h/d"),
        ("https://h/d", "404 for https://h/d", "404 for https://h/d"),
        ("s3://k:s3cr3t@[x/d", "bad s3://k:s3cr3t@[x/d", "bad s3://***@[x/d"),
        (None, "no url", "no url"),
    ],
)
def test_a_lower_layer_s_message_loses_the_url_s_password(url: str | None, message: str, shown: str) -> None:
    assert without_password(message, url) == shown


def test_a_missing_input_is_refused_without_the_password_its_store_quoted() -> None:
    url = "https://reader:s3cr3t@data.example/d.parquet"
    with pytest.raises(InvalidSpecError) as caught, _storage(url):
        raise FileNotFoundError(f"{url} answered 404")
    assert str(caught.value) == (
        "dataset https://reader:***@data.example/d.parquet is not there "
        "(https://reader:***@data.example/d.parquet answered 404); check the URL"
    )


def test_a_local_file_is_pinned_by_its_ends_and_a_change_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl.gz"
    body = gzip.compress(_jsonl(ROWS * 2000) + os.urandom(3 * PIN_EDGE_BYTES))
    path.write_bytes(body)
    pinned = Reference.from_json(resolve_reference(str(path)).to_json())
    assert pinned.format is InputFormat.JSONL_GZ
    assert set(pinned.files[0].pin) == {"size", "mtime", "head_sha256", "tail_sha256"}
    with open_reference(pinned, ColumnMap()):
        pass  # unchanged: opens
    # The same size, one byte changed in the middle: the ends still match, the mtime does not.
    changed = bytearray(body)
    changed[len(body) // 2] ^= 1
    path.write_bytes(bytes(changed))
    os.utime(path, (1, 1))
    with pytest.raises(InvalidSpecError) as caught:
        open_reference(pinned, ColumnMap())
    assert str(caught.value) == (
        f"dataset {path}: d.jsonl.gz changed since it was submitted (mtime differ); the job cannot go on "
        "from its checkpoint: submit the input as it is under a new job id"
    )
    path.unlink()
    with pytest.raises(InvalidSpecError, match="is not there"):
        open_reference(pinned, ColumnMap())


def test_unreadable_files_and_rows_are_reported_not_retried(tmp_path: Path) -> None:
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(InvalidSpecError, match=r"cannot read bad\.parquet: "):
        _parquet(tmp_path / "bad.parquet", name="bad.parquet")
    pq.write_table(pa.table({"other": [1, 2]}), tmp_path / "none.parquet")
    with _parquet(tmp_path / "none.parquet") as stream:
        items = list(iter_prompts(stream))  # type: ignore[arg-type]
    assert [(type(i), i.line) for i in items] == [(RowError, 1), (RowError, 2)]  # no row field: rejected
