"""The safetensors header: read one into typed tensor descriptions, write one.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON, then the tensors'
bytes back to back. The JSON maps each tensor name to ``{"dtype", "shape", "data_offsets":
[begin, end]}`` (offsets relative to the data section) and may hold ``"__metadata__"`` (str to
str). We read and write it ourselves rather than through the ``safetensors`` package because its
numpy backend knows neither BF16 nor F8_E4M3, and the capture path streams rows instead of loading
a tensor whole.

A header that is not one (too long, not JSON, offsets that overlap, leave gaps or disagree with
the shape) raises :class:`~datagen.errors.CaptureFileError`: the only files read here are a
capture server's, and a new capture writes a new file.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import BinaryIO

from datagen.errors import CaptureFileError

__all__ = [
    "DTYPE_BYTES",
    "HEADER_ALIGN_BYTES",
    "Header",
    "TensorInfo",
    "encode_header",
    "read_header",
]

# The dtypes a capture file holds (safetensors spells them so), and the bytes of one element.
DTYPE_BYTES: dict[str, int] = {"BF16": 2, "F16": 2, "F8_E4M3": 1, "F32": 4, "I64": 8}
LENGTH_PREFIX_BYTES = 8
# The format requires the data section to start 8-byte aligned; the JSON is padded with spaces.
HEADER_ALIGN_BYTES = 8
# The safetensors package refuses longer headers (its MAX_HEADER_SIZE); a capture header is ~200 B.
MAX_HEADER_BYTES = 100_000_000
METADATA_KEY = "__metadata__"
_LENGTH = struct.Struct("<Q")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a file: ``begin``/``end`` are byte offsets into the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def row_bytes(self) -> int:
        """Bytes of one index along the first axis (a token, for the capture tensors)."""
        return math.prod(self.shape[1:]) * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class Header:
    """A parsed header. ``tensors`` is in data order; ``data_start`` is the file offset of the data."""

    tensors: tuple[TensorInfo, ...]
    metadata: dict[str, str] | None
    data_start: int

    @property
    def data_bytes(self) -> int:
        return self.tensors[-1].end if self.tensors else 0

    @property
    def file_bytes(self) -> int:
        """What the file's size must be."""
        return self.data_start + self.data_bytes

    def names(self) -> set[str]:
        return {t.name for t in self.tensors}

    def get(self, name: str) -> TensorInfo | None:
        return next((t for t in self.tensors if t.name == name), None)


def read_header(fh: BinaryIO, *, label: str) -> Header:
    """Read the header at the start of ``fh`` (left positioned after it) and check it against the
    file's size. ``label`` names the file in errors."""
    prefix = fh.read(LENGTH_PREFIX_BYTES)
    size_bytes = os.fstat(fh.fileno()).st_size
    if len(prefix) < LENGTH_PREFIX_BYTES:
        raise CaptureFileError(f"{label}: truncated: {size_bytes} bytes, shorter than a safetensors header")
    (length,) = _LENGTH.unpack(prefix)
    if length > MAX_HEADER_BYTES or LENGTH_PREFIX_BYTES + length > size_bytes:
        raise CaptureFileError(
            f"{label}: truncated or not safetensors: header of {length} bytes in a file of {size_bytes}"
        )
    raw = fh.read(length)
    try:
        parsed = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CaptureFileError(f"{label}: not safetensors: the header is not JSON ({exc})") from exc
    if not isinstance(parsed, dict):
        raise CaptureFileError(f"{label}: not safetensors: the header is not a JSON object")
    header = _parse(parsed, data_start=LENGTH_PREFIX_BYTES + length, label=label)
    if header.file_bytes != size_bytes:
        raise CaptureFileError(
            f"{label}: truncated: {size_bytes} bytes where its header says {header.file_bytes}"
            " (a write that failed, or one not finished)"
        )
    return header


def _parse(parsed: dict[str, object], *, data_start: int, label: str) -> Header:
    metadata = parsed.pop(METADATA_KEY, None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise CaptureFileError(f"{label}: not safetensors: __metadata__ is not a map of strings")
    tensors = sorted((_tensor(name, entry, label) for name, entry in parsed.items()), key=lambda t: t.begin)
    offset = 0
    for tensor in tensors:
        if tensor.begin != offset:
            raise CaptureFileError(
                f"{label}: not safetensors: {tensor.name} starts at {tensor.begin}, not {offset}"
            )
        offset = tensor.end
    return Header(tensors=tuple(tensors), metadata=metadata, data_start=data_start)


def _tensor(name: str, entry: object, label: str) -> TensorInfo:
    if not isinstance(entry, dict):
        raise CaptureFileError(f"{label}: not safetensors: entry {name!r} is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise CaptureFileError(
            f"{label}: tensor {name!r} has dtype {dtype!r}, not one of {sorted(DTYPE_BYTES)}"
        )
    if not (isinstance(shape, list) and all(_is_count(d) for d in shape)):
        raise CaptureFileError(f"{label}: not safetensors: tensor {name!r} has shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
        raise CaptureFileError(f"{label}: not safetensors: tensor {name!r} has data_offsets {offsets!r}")
    begin, end = offsets
    if end - begin != math.prod(shape) * DTYPE_BYTES[dtype]:
        raise CaptureFileError(
            f"{label}: not safetensors: tensor {name!r} spans {end - begin} bytes for shape {shape} {dtype}"
        )
    return TensorInfo(name=name, dtype=dtype, shape=tuple(shape), begin=begin, end=end)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def encode_header(
    tensors: Sequence[tuple[str, str, Sequence[int]]], *, metadata: Mapping[str, str] | None = None
) -> tuple[bytes, tuple[TensorInfo, ...]]:
    """The header bytes (length prefix included) for ``(name, dtype, shape)`` tensors laid out in
    the given order, and their descriptions.

    The JSON is compact, with the keys in the order the safetensors package writes them, so a file
    laid out as it lays them out gets the same bytes.
    """
    entries: dict[str, object] = {}
    if metadata is not None:
        entries[METADATA_KEY] = dict(metadata)
    infos = []
    offset = 0
    for name, dtype, shape in tensors:
        end = offset + math.prod(shape) * DTYPE_BYTES[dtype]
        infos.append(TensorInfo(name=name, dtype=dtype, shape=tuple(shape), begin=offset, end=end))
        entries[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-(LENGTH_PREFIX_BYTES + len(raw)) % HEADER_ALIGN_BYTES)
    return _LENGTH.pack(len(raw)) + raw, tuple(infos)
