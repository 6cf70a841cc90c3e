"""Capture files: the safetensors header we read and write, and ``check_and_store`` on every kind
of source and every way a server's file can be wrong."""

from __future__ import annotations

import hashlib
import json
import struct
import tracemalloc
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from safetensors import safe_open

from datagen.errors import (
    CaptureFileError,
    CaptureMismatchError,
    FatalError,
    RetryableError,
    StorageError,
)
from datagen.features import fp8
from datagen.features.capture_file import FeatureDtype, check_and_store
from datagen.features.safetensors_file import encode_header, read_header

T, L, H = 10, 3, 8


def hidden_values(t: int = T, layers: int = L, size: int = H, seed: int = 0) -> np.ndarray:
    """float32 values that are exact in bf16 and F16: each token its own magnitude."""
    rng = np.random.default_rng(seed)
    values = rng.integers(-64, 64, (t, layers, size)).astype(np.float32) / 16
    return values * (2.0 ** (np.arange(t) % 3)).astype(np.float32).reshape(t, 1, 1)


def write_capture(
    path: Path,
    hidden: np.ndarray,
    ids: np.ndarray,
    *,
    dtype: str = "BF16",
    extra: dict[str, tuple[str, np.ndarray]] | None = None,
) -> Path:
    """A capture file as vLLM's connector lays it out (``token_ids`` first); ``hidden`` is float32
    for BF16/F16, or the raw bytes' array for F8_E4M3."""
    raw = {
        "BF16": lambda: hidden.astype(ml_dtypes.bfloat16).view(np.uint16).astype("<u2"),
        "F16": lambda: hidden.astype("<f2"),
        "F32": lambda: hidden.astype("<f4"),
        "F8_E4M3": lambda: hidden,
    }[dtype]()
    tensors = [("token_ids", "I64", ids.shape, ids.astype("<i8").tobytes())]
    tensors += [(name, dt, arr.shape, arr.tobytes()) for name, (dt, arr) in (extra or {}).items()]
    tensors.append(("hidden_states", dtype, hidden.shape, raw.tobytes()))
    header, _ = encode_header([(name, dt, shape) for name, dt, shape, _ in tensors])
    path.write_bytes(header + b"".join(data for *_, data in tensors))
    return path


@pytest.fixture
def ids() -> np.ndarray:
    return np.arange(100, 100 + T, dtype=np.int64)


@pytest.fixture
def src(tmp_path: Path, ids: np.ndarray) -> Path:
    return write_capture(tmp_path / "cmpl-a-0-12345678.safetensors", hidden_values(), ids)


# The header


def test_our_header_is_byte_for_byte_the_safetensors_package_s(tmp_path: Path) -> None:
    tensors: dict[str, np.ndarray] = {
        "token_ids": np.arange(3, dtype=np.int64),
        "x": np.ones((3, 2), dtype=np.float32),
    }
    for metadata in (None, {"format": "pt"}):
        safetensors.numpy.save_file(tensors, tmp_path / "theirs", metadata=metadata)
        header, infos = encode_header([("token_ids", "I64", (3,)), ("x", "F32", (3, 2))], metadata=metadata)
        assert (tmp_path / "theirs").read_bytes()[: len(header)] == header
        assert len(header) % 8 == 0  # the data starts 8-byte aligned
        assert [(i.name, i.begin, i.end) for i in infos] == [("token_ids", 0, 24), ("x", 24, 48)]


def test_a_header_is_read_into_typed_descriptions(tmp_path: Path) -> None:
    safetensors.numpy.save_file(
        {"b": np.zeros((2, 3), dtype=np.float16), "a": np.zeros(4, dtype=np.int64)},
        tmp_path / "f",
        metadata={"k": "v"},
    )
    with (tmp_path / "f").open("rb") as fh:
        header = read_header(fh, label="f")
    assert header.metadata == {"k": "v"}
    assert [(t.name, t.dtype, t.shape, t.begin, t.end) for t in header.tensors] == [
        ("a", "I64", (4,), 0, 32),
        ("b", "F16", (2, 3), 32, 44),
    ]
    assert header.file_bytes == (tmp_path / "f").stat().st_size
    assert header.data_start % 8 == 0


def _raw_file(path: Path, header: dict[str, object], data_bytes: int) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * data_bytes)
    return path


@pytest.mark.parametrize(
    ("header", "data_bytes", "reason"),
    [
        ({"x": {"dtype": "I64", "shape": [2], "data_offsets": [0, 16]}}, 8, "truncated: .* header says"),
        ({"x": {"dtype": "I64", "shape": [2], "data_offsets": [0, 16]}}, 24, "header says"),
        ({"x": {"dtype": "I64", "shape": [2], "data_offsets": [8, 24]}}, 24, "starts at 8, not 0"),
        ({"x": {"dtype": "I64", "shape": [3], "data_offsets": [0, 16]}}, 16, "spans 16 bytes"),
        ({"x": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 2]}}, 2, "dtype 'Q4'"),
        ({"x": {"dtype": "I64", "shape": [-1], "data_offsets": [0, 8]}}, 8, "shape"),
        ({"x": {"dtype": "I64", "shape": [1], "data_offsets": [0]}}, 8, "data_offsets"),
        ({"__metadata__": {"k": 1}}, 0, "__metadata__"),
    ],
)
def test_a_header_that_is_not_one_is_refused(
    tmp_path: Path, header: dict[str, object], data_bytes: int, reason: str
) -> None:
    with (
        _raw_file(tmp_path / "f", header, data_bytes).open("rb") as fh,
        pytest.raises(CaptureFileError, match=reason),
    ):
        read_header(fh, label="f")


@pytest.mark.parametrize(
    "content", [b"", b"\x05\0\0", struct.pack("<Q", 1000) + b"{}", struct.pack("<Q", 2) + b"[]"]
)
def test_a_file_too_short_or_not_json_is_refused(tmp_path: Path, content: bytes) -> None:
    (tmp_path / "f").write_bytes(content)
    with (
        (tmp_path / "f").open("rb") as fh,
        pytest.raises(CaptureFileError, match=r"truncated|not safetensors"),
    ):
        read_header(fh, label="f")


# Storing


def test_a_bf16_capture_is_stored_byte_for_byte(src: Path, tmp_path: Path, ids: np.ndarray) -> None:
    dest = tmp_path / "stored.safetensors"
    stored = check_and_store(src, dest, sent_ids=ids.tolist(), layer_count=L, dtype="bf16", hidden_size=H)
    assert dest.read_bytes() == src.read_bytes()
    assert stored.sha256 == hashlib.sha256(dest.read_bytes()).hexdigest()
    assert stored.bytes == dest.stat().st_size
    assert (stored.rows, stored.layers, stored.hidden_size) == (T, L, H)
    assert (stored.source_dtype, stored.stored_dtype) == ("BF16", "BF16")
    with safe_open(str(dest), "np") as f:
        assert sorted(f.keys()) == ["hidden_states", "token_ids"]
        assert f.metadata() is None
        assert np.array_equal(f.get_tensor("token_ids"), ids)
        assert (f.get_slice("hidden_states").get_shape(), f.get_slice("hidden_states").get_dtype()) == (
            [T, L, H],
            "BF16",
        )


def test_metadata_is_dropped_and_the_data_kept(tmp_path: Path, ids: np.ndarray) -> None:
    values = hidden_values().astype(np.float16)
    safetensors.numpy.save_file(
        {"hidden_states": values, "token_ids": ids}, tmp_path / "src.safetensors", metadata={"x": "y"}
    )
    dest = tmp_path / "stored.safetensors"
    check_and_store(tmp_path / "src.safetensors", dest, sent_ids=ids.tolist(), layer_count=L, dtype="bf16")
    with dest.open("rb") as fh:
        assert read_header(fh, label="dest").metadata is None
    with safe_open(str(dest), "np") as f:
        assert np.array_equal(f.get_tensor("hidden_states"), values)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_chunks_smaller_than_the_file_give_the_same_bytes(
    src: Path, tmp_path: Path, ids: np.ndarray, dtype: FeatureDtype
) -> None:
    sent = ids.tolist()
    whole = check_and_store(src, tmp_path / "whole", sent_ids=sent, layer_count=L, dtype=dtype, chunk_rows=T)
    for chunk_rows in (1, 3, 4, T + 5):
        dest = tmp_path / f"by-{chunk_rows}"
        stored = check_and_store(src, dest, sent_ids=sent, layer_count=L, dtype=dtype, chunk_rows=chunk_rows)
        assert stored == whole
        assert dest.read_bytes() == (tmp_path / "whole").read_bytes()


def test_fp8_from_bf16_is_speculators_layout_with_per_token_scales(
    src: Path, tmp_path: Path, ids: np.ndarray
) -> None:
    dest = tmp_path / "stored.safetensors"
    stored = check_and_store(src, dest, sent_ids=ids.tolist(), layer_count=L, dtype="fp8", chunk_rows=3)
    assert (stored.source_dtype, stored.stored_dtype) == ("BF16", "F8_E4M3")
    assert stored.sha256 == hashlib.sha256(dest.read_bytes()).hexdigest()
    assert stored.bytes == dest.stat().st_size
    q, scales = fp8.quantize(hidden_values())
    with dest.open("rb") as fh:
        header = read_header(fh, label="dest")
        data = dest.read_bytes()[header.data_start :]
    layout = {t.name: (t.dtype, t.shape) for t in header.tensors}
    assert layout == {
        "token_ids": ("I64", (T,)),
        "hidden_states": ("F8_E4M3", (T, L, H)),
        "hidden_states_scales": ("F32", (T, 1, 1)),
    }
    hidden = header.get("hidden_states")
    assert hidden is not None
    assert data[hidden.begin : hidden.end] == q.view(np.uint8).tobytes()
    with safe_open(str(dest), "np") as f:
        assert np.array_equal(f.get_tensor("hidden_states_scales"), scales)
        assert np.array_equal(f.get_tensor("token_ids"), ids)


def test_an_fp8_capture_is_stored_as_it_is(tmp_path: Path, ids: np.ndarray) -> None:
    q, scales = fp8.quantize(hidden_values())
    src = write_capture(
        tmp_path / "src.safetensors",
        q.view(np.uint8),
        ids,
        dtype="F8_E4M3",
        extra={"hidden_states_scales": ("F32", scales)},
    )
    dest = tmp_path / "stored.safetensors"
    stored = check_and_store(src, dest, sent_ids=ids.tolist(), layer_count=L, dtype="fp8", chunk_rows=4)
    assert dest.read_bytes() == src.read_bytes()
    assert (stored.source_dtype, stored.stored_dtype) == ("F8_E4M3", "F8_E4M3")


def test_an_f16_capture_is_kept_f16_for_bf16_and_quantised_for_fp8(tmp_path: Path, ids: np.ndarray) -> None:
    src = write_capture(tmp_path / "src.safetensors", hidden_values(), ids, dtype="F16")
    stored = check_and_store(src, tmp_path / "a", sent_ids=ids.tolist(), layer_count=L, dtype="bf16")
    assert (tmp_path / "a").read_bytes() == src.read_bytes()
    assert (stored.source_dtype, stored.stored_dtype) == ("F16", "F16")
    check_and_store(src, tmp_path / "b", sent_ids=ids.tolist(), layer_count=L, dtype="fp8", chunk_rows=3)
    q, scales = fp8.quantize(hidden_values().astype(np.float16))
    with safe_open(str(tmp_path / "b"), "np") as f:
        assert np.array_equal(f.get_tensor("hidden_states_scales"), scales)
    assert q.view(np.uint8).tobytes() in (tmp_path / "b").read_bytes()


def test_memory_stays_bounded_by_the_chunk(tmp_path: Path) -> None:
    t, layers, size = 512, 4, 1024  # 4 MiB of bf16
    ids = np.arange(t, dtype=np.int64)
    src = write_capture(tmp_path / "src.safetensors", hidden_values(t, layers, size), ids)
    file_bytes = src.stat().st_size
    sent = ids.tolist()
    dtypes: tuple[FeatureDtype, ...] = ("bf16", "fp8")
    for dtype in dtypes:
        tracemalloc.start()
        try:
            check_and_store(
                src, tmp_path / dtype, sent_ids=sent, layer_count=layers, dtype=dtype, chunk_rows=8
            )
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        # A chunk is 64 KiB of bf16; the FP8 path adds 5 bytes of scratch per value.
        assert peak < file_bytes / 8, (dtype, peak)


# What is refused


def _refused(src: Path, dest: Path, ids: np.ndarray, reason: str, **kwargs: object) -> CaptureFileError:
    options: dict[str, object] = {
        "sent_ids": ids.tolist(),
        "layer_count": L,
        "dtype": "bf16",
        "chunk_rows": 4,
    }
    options.update(kwargs)
    with pytest.raises(CaptureFileError, match=reason) as caught:
        check_and_store(src, dest, **options)  # type: ignore[arg-type]
    assert not dest.exists()
    assert "\n" not in str(caught.value)
    return caught.value


def test_a_missing_file_is_refused(tmp_path: Path, ids: np.ndarray) -> None:
    error = _refused(tmp_path / "gone.safetensors", tmp_path / "dest", ids, "gone.safetensors: missing")
    assert isinstance(error, RetryableError)


def test_a_truncated_file_is_refused(src: Path, tmp_path: Path, ids: np.ndarray) -> None:
    src.write_bytes(src.read_bytes()[:-5])
    _refused(src, tmp_path / "dest", ids, r"truncated: \d+ bytes where its header says \d+")


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        (
            {"other": ("F32", np.zeros(2, dtype=np.float32))},
            r"holds \['hidden_states', 'other', 'token_ids'\]",
        ),
        (
            {"hidden_states_scales": ("F32", np.ones((T, 1, 1), dtype=np.float32))},
            "holds .*hidden_states_scales",
        ),
    ],
)
def test_unexpected_keys_are_refused(
    tmp_path: Path, ids: np.ndarray, extra: dict[str, tuple[str, np.ndarray]], reason: str
) -> None:
    src = write_capture(tmp_path / "src", hidden_values(), ids, extra=extra)
    _refused(src, tmp_path / "dest", ids, reason)


def test_an_fp8_file_without_scales_is_refused(tmp_path: Path, ids: np.ndarray) -> None:
    q, _ = fp8.quantize(hidden_values())
    src = write_capture(tmp_path / "src", q.view(np.uint8), ids, dtype="F8_E4M3")
    _refused(src, tmp_path / "dest", ids, "not .*hidden_states_scales", dtype="fp8")


def test_a_file_without_token_ids_is_refused(tmp_path: Path, ids: np.ndarray) -> None:
    safetensors.numpy.save_file({"hidden_states": hidden_values().astype(np.float16)}, tmp_path / "src")
    _refused(tmp_path / "src", tmp_path / "dest", ids, r"holds \['hidden_states'\], not")


def test_other_token_ids_are_refused_naming_the_first_difference(
    src: Path, tmp_path: Path, ids: np.ndarray
) -> None:
    sent = ids.copy()
    sent[7] = 5
    _refused(src, tmp_path / "dest", sent, r"differs from the ids sent at position 7 \(107 != 5\)")
    _refused(src, tmp_path / "dest", ids[:-1], f"holds {T} ids where {T - 1} were sent")


def test_a_short_file_from_an_abort_mid_prefill_is_refused(tmp_path: Path, ids: np.ndarray) -> None:
    src = write_capture(tmp_path / "src", hidden_values()[:6], ids)
    _refused(src, tmp_path / "dest", ids, f"has 6 rows for {T} token ids")


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_non_finite_values_are_refused_naming_their_layer_slots(
    tmp_path: Path, ids: np.ndarray, dtype: FeatureDtype
) -> None:
    values = hidden_values()
    values[2, 2, 5] = np.nan
    values[9, 0, 1] = -np.inf  # in a later chunk
    src = write_capture(tmp_path / "src", values, ids)
    _refused(
        src,
        tmp_path / "dest",
        ids,
        r"2 non-finite .* layer slot\(s\) 0, 2 of 3, first at row 2 of 10",
        dtype=dtype,
    )


def test_non_finite_f16_values_are_refused(tmp_path: Path, ids: np.ndarray) -> None:
    values = hidden_values()
    values[4, 1, 0] = np.inf  # what an F16 model that overflows writes
    src = write_capture(tmp_path / "src", values, ids, dtype="F16")
    _refused(src, tmp_path / "dest", ids, r"layer slot\(s\) 1 of 3, first at row 4")


def test_fp8_nan_bytes_and_bad_scales_are_refused(tmp_path: Path, ids: np.ndarray) -> None:
    q, scales = fp8.quantize(hidden_values())
    raw = q.view(np.uint8).copy()
    raw[3, 1, 2] = 0xFF  # e4m3fn NaN (0x7F or 0xFF; no infinity)
    src = write_capture(
        tmp_path / "src", raw, ids, dtype="F8_E4M3", extra={"hidden_states_scales": ("F32", scales)}
    )
    _refused(src, tmp_path / "dest", ids, r"layer slot\(s\) 1 of 3, first at row 3", dtype="fp8")
    for bad in (0.0, -1.0, np.nan, np.inf):
        wrong = scales.copy()
        wrong[6] = bad
        src = write_capture(
            tmp_path / "src",
            q.view(np.uint8),
            ids,
            dtype="F8_E4M3",
            extra={"hidden_states_scales": ("F32", wrong)},
        )
        _refused(
            src, tmp_path / "dest", ids, "1 FP8 scales not finite and positive, first at row 6", dtype="fp8"
        )


def test_what_the_server_was_started_with_is_a_mismatch_not_a_retry(tmp_path: Path, ids: np.ndarray) -> None:
    q, scales = fp8.quantize(hidden_values())
    fp8_src = write_capture(
        tmp_path / "fp8",
        q.view(np.uint8),
        ids,
        dtype="F8_E4M3",
        extra={"hidden_states_scales": ("F32", scales)},
    )
    bf16_src = write_capture(tmp_path / "bf16", hidden_values(), ids)
    f32_src = write_capture(tmp_path / "f32", hidden_values(), ids, dtype="F32")
    cases: list[tuple[Path, dict[str, object], str]] = [
        (fp8_src, {"dtype": "bf16"}, "F8_E4M3 .* but the job stores bf16"),
        (f32_src, {"dtype": "fp8"}, "is F32; a job stores"),
        (bf16_src, {"layer_count": L + 1}, f"{L} layer slots where the job asks for {L + 1}"),
        (bf16_src, {"hidden_size": 4096}, f"hidden size {H} where the job's model has 4096"),
    ]
    for src, change, reason in cases:
        options: dict[str, object] = {"sent_ids": ids.tolist(), "layer_count": L, "dtype": "bf16", **change}
        with pytest.raises(CaptureMismatchError, match=reason) as caught:
            check_and_store(src, tmp_path / "dest", **options)  # type: ignore[arg-type]
        assert isinstance(caught.value, FatalError)
        assert not isinstance(caught.value, RetryableError)
        assert not (tmp_path / "dest").exists()


def test_a_copy_that_cannot_be_written_is_a_storage_error(src: Path, tmp_path: Path, ids: np.ndarray) -> None:
    with pytest.raises(StorageError, match="writing hidden states to"):
        check_and_store(
            src, tmp_path / "no" / "such" / "dir", sent_ids=ids.tolist(), layer_count=L, dtype="bf16"
        )


def test_chunk_rows_must_be_positive(src: Path, tmp_path: Path, ids: np.ndarray) -> None:
    with pytest.raises(ValueError, match="chunk_rows"):
        check_and_store(
            src, tmp_path / "dest", sent_ids=ids.tolist(), layer_count=L, dtype="bf16", chunk_rows=0
        )
