"""Check a capture server's hidden-states file and write the copy a job keeps.

The server (vLLM ``extract_hidden_states`` with the file connector) writes ``hidden_states``
``[T, L, H]`` in the model dtype and ``token_ids`` I64 ``[T]``; speculators' FP8 connector writes
``hidden_states`` F8_E4M3 plus ``hidden_states_scales`` F32 ``[T, 1, 1]``. :func:`check_and_store`
reads it once, by chunks of rows, so memory stays bounded whatever T is, and writes ``dest``:

=========  ==============  ======================================================================
job dtype  source          stored
=========  ==============  ======================================================================
``bf16``   BF16 (or F16)   the same tensors, byte-identical data (``token_ids`` first, as vLLM's
                           file lays them out), no ``__metadata__``
``fp8``    BF16 (or F16)   ``token_ids`` I64, ``hidden_states`` F8_E4M3 ``[T, L, H]``,
                           ``hidden_states_scales`` F32 ``[T, 1, 1]``, quantised chunk by chunk
                           (`datagen.features.fp8`; tokens are independent)
``fp8``    F8_E4M3         the same tensors, byte-identical data
``bf16``   F8_E4M3         refused (:class:`~datagen.errors.CaptureMismatchError`)
=========  ==============  ======================================================================

The FP8 copy puts the scales after ``hidden_states`` (the safetensors package would put them
before): they are known only once every chunk is quantised, and the SHA-256 is taken over the
bytes in file order while they are written. Readers go by the header's offsets, so the order does
not matter to them (``safetensors.safe_open`` loads it).

**F16 sources** (vLLM ``--dtype float16``) are accepted: ``bf16`` means "the model's 16-bit
dtype, unquantised", so the copy stays F16, byte for byte, and :attr:`StoredFeatures.source_dtype`
says so. Converting to BF16 would drop three mantissa bits for nothing (every F16 value is in
BF16's range); a trainer reads the dtype from the header. ``fp8`` quantises F16 like BF16. An F16
model that overflows writes infinities, which the finiteness check refuses.

Checks, each a one-line :class:`~datagen.errors.CaptureFileError` (retryable: a new capture writes
a new file) naming the file: missing; a size other than its header says (a failed or unfinished
write); keys other than ``hidden_states`` + ``token_ids`` (+ ``hidden_states_scales`` for an
F8_E4M3 source); ``token_ids`` not the ids sent; fewer or more ``hidden_states`` rows than ids (an
abort mid-prefill leaves a short file); a NaN or infinity (naming the layer slots that hold one);
FP8 scales that are not finite and positive. A layout that follows from how the server was
started (F8_E4M3 for a ``bf16`` job, another model dtype, layer count or hidden size) raises
:class:`~datagen.errors.CaptureMismatchError` instead: sending again writes the same kind of file.
A failure to write ``dest`` raises :class:`~datagen.errors.StorageError`. On any failure ``dest``
is removed. ``dest`` is written in place and fsynced; the caller renames it and fsyncs the folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Literal

import numpy as np
import numpy.typing as npt

from datagen.errors import CaptureFileError, CaptureMismatchError, StorageError
from datagen.features import fp8
from datagen.features.safetensors_file import Header, TensorInfo, encode_header, read_header

__all__ = [
    "DEFAULT_CHUNK_ROWS",
    "HIDDEN_KEY",
    "IDS_KEY",
    "SCALES_KEY",
    "FeatureDtype",
    "StoredFeatures",
    "check_and_store",
]

HIDDEN_KEY = "hidden_states"
IDS_KEY = "token_ids"
SCALES_KEY = "hidden_states_scales"
# 32 tokens x 4 layers x 4096 hidden is 1 MiB of bf16 per chunk (and as much again of scratch
# for the check); the FP8 path adds 9 bytes of scratch per value (float32 work, uint32 scratch,
# FP8 out), 5.5 MiB in all. bench/capture_path.py measured the same CPU per GB from 8 to 128
# rows: larger chunks only cost memory.
DEFAULT_CHUNK_ROWS = 32
# How often the stored copy's write-back is started while it is written (see _Sink).
WRITEBACK_BYTES = 8 * 1024 * 1024
_FADVISE = getattr(os, "POSIX_FADV_DONTNEED", None)  # Linux and most Unixes; not macOS

FeatureDtype = Literal["bf16", "fp8"]
_FP8_SOURCE = "F8_E4M3"
_SIXTEEN_BIT_SOURCES = ("BF16", "F16")
_SCALES_SHAPE_TAIL = (1, 1)


@dataclass(frozen=True)
class StoredFeatures:
    """What :func:`check_and_store` wrote: ``bytes`` and ``sha256`` (hex) of the whole file."""

    bytes: int
    sha256: str
    rows: int
    layers: int
    hidden_size: int
    source_dtype: str
    stored_dtype: str


@dataclass(frozen=True)
class _Bits:
    """How to spot a non-finite value in a dtype's raw bits: clear the sign with ``magnitude_mask``;
    the value is NaN or infinite when what is left is at least ``nonfinite_from``."""

    elem: str
    magnitude_mask: int
    nonfinite_from: int


_BITS = {
    "BF16": _Bits("<u2", fp8.MAGNITUDE_MASK_16, fp8.BF16_EXPONENT_MASK),
    "F16": _Bits("<u2", fp8.MAGNITUDE_MASK_16, fp8.F16_EXPONENT_MASK),
    # e4m3fn has no infinity; its NaN is the largest magnitude.
    _FP8_SOURCE: _Bits("u1", fp8.E4M3_MAGNITUDE_MASK, fp8.E4M3_NAN_MAGNITUDE),
}


@dataclass(frozen=True)
class _Source:
    fh: BinaryIO
    label: str
    header: Header
    hidden: TensorInfo
    ids: TensorInfo
    scales: TensorInfo | None

    def read(self, info: TensorInfo) -> bytes:
        self.fh.seek(self.header.data_start + info.begin)
        buf = bytearray(info.nbytes)
        _read_exact(self.fh, memoryview(buf), self.label)
        return bytes(buf)


class _Sink:
    """``dest``, written unbuffered, hashed and counted as it is written.

    Every ``WRITEBACK_BYTES`` it asks the kernel to start writing back what it holds so far
    (``posix_fadvise(DONTNEED)`` starts write-back without waiting for it, and drops the pages
    once clean): the disk then works while we check and hash, and the final fsync waits only for
    the tail. The stored copy is not read again soon, so leaving the page cache to the capture
    files is right too.
    """

    def __init__(self, fh: BinaryIO, dest: Path) -> None:
        self._fh = fh
        self._dest = dest
        self.sha256 = hashlib.sha256()
        self.bytes = 0
        self._advised_bytes = 0

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        self.sha256.update(view)
        try:
            while view:
                written = self._fh.write(view) or 0
                view = view[written:]
                self.bytes += written
            if self.bytes - self._advised_bytes >= WRITEBACK_BYTES:
                self._start_writeback()
        except OSError as exc:
            raise StorageError(f"writing hidden states to {self._dest} failed: {exc}") from exc

    def seal(self) -> None:
        """Write back the rest and wait for all of it (fsync)."""
        try:
            os.fsync(self._fh.fileno())
        except OSError as exc:
            raise StorageError(f"fsync of {self._dest} failed: {exc}") from exc

    def _start_writeback(self) -> None:
        if _FADVISE is not None:
            os.posix_fadvise(
                self._fh.fileno(), self._advised_bytes, self.bytes - self._advised_bytes, _FADVISE
            )
        self._advised_bytes = self.bytes


def check_and_store(
    src: Path,
    dest: Path,
    *,
    sent_ids: Sequence[int],
    layer_count: int,
    dtype: FeatureDtype,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    hidden_size: int | None = None,
) -> StoredFeatures:
    """Check the capture file ``src`` against the ids sent and the job's layout, and write the
    stored copy to ``dest`` (see the module docstring). ``hidden_size`` is checked when given.

    It blocks on the disk and the CPU for about a second per GB: call it in a thread
    (``asyncio.to_thread``); file I/O, hashlib and numpy release the GIL, so stores in several
    threads use several cores.
    """
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be at least 1, not {chunk_rows}")
    label = f"capture file {src.name}"
    try:
        fh = src.open("rb", buffering=0)
    except FileNotFoundError as exc:
        raise CaptureFileError(f"{label}: missing (the server's write failed, or it crashed)") from exc
    except OSError as exc:
        raise CaptureFileError(f"{label}: cannot be opened: {exc}") from exc
    with fh:
        source = _open_source(fh, label, layer_count=layer_count, hidden_size=hidden_size, dtype=dtype)
        ids_bytes = source.read(source.ids)
        _check_ids(ids_bytes, sent_ids, label)
        _check_rows(source)
        scales_bytes = source.read(source.scales) if source.scales is not None else b""
        if scales_bytes:
            _check_scales(scales_bytes, label)
        if dtype == "fp8" and source.hidden.dtype != _FP8_SOURCE:
            return _store_quantised(source, dest, ids_bytes, chunk_rows)
        return _store_copy(source, dest, {IDS_KEY: ids_bytes, SCALES_KEY: scales_bytes}, chunk_rows)


def _open_source(
    fh: BinaryIO, label: str, *, layer_count: int, hidden_size: int | None, dtype: FeatureDtype
) -> _Source:
    header = read_header(fh, label=label)
    hidden, ids = header.get(HIDDEN_KEY), header.get(IDS_KEY)
    expected = {HIDDEN_KEY, IDS_KEY}
    if hidden is not None and hidden.dtype == _FP8_SOURCE:
        expected.add(SCALES_KEY)
    if hidden is None or ids is None or header.names() != expected:
        raise CaptureFileError(f"{label}: holds {sorted(header.names())}, not {sorted(expected)}")
    if ids.dtype != "I64" or len(ids.shape) != 1:
        raise CaptureFileError(f"{label}: {IDS_KEY} is {ids.dtype} {list(ids.shape)}, not I64 [T]")
    _check_hidden_layout(hidden, label, layer_count=layer_count, hidden_size=hidden_size, dtype=dtype)
    return _Source(fh, label, header, hidden, ids, header.get(SCALES_KEY))


def _check_hidden_layout(
    hidden: TensorInfo, label: str, *, layer_count: int, hidden_size: int | None, dtype: FeatureDtype
) -> None:
    if hidden.dtype not in (*_SIXTEEN_BIT_SOURCES, _FP8_SOURCE):
        raise CaptureMismatchError(
            f"{label}: {HIDDEN_KEY} is {hidden.dtype}; a job stores BF16, F16 or F8_E4M3"
            " (start the capture server with the model's 16-bit dtype)"
        )
    if dtype == "bf16" and hidden.dtype == _FP8_SOURCE:
        raise CaptureMismatchError(
            f"{label}: {HIDDEN_KEY} is F8_E4M3 (an FP8 connector) but the job stores bf16:"
            " point the job at a server with the plain file connector, or set its dtype to fp8"
        )
    if len(hidden.shape) != 3:
        raise CaptureFileError(f"{label}: {HIDDEN_KEY} has shape {list(hidden.shape)}, not [T, L, H]")
    _, layers, size = hidden.shape
    if layers != layer_count:
        raise CaptureMismatchError(
            f"{label}: {layers} layer slots where the job asks for {layer_count}:"
            " the server was started with other eagle_aux_hidden_state_layer_ids"
        )
    if hidden_size is not None and size != hidden_size:
        raise CaptureMismatchError(
            f"{label}: hidden size {size} where the job's model has {hidden_size}:"
            " the server runs another model"
        )


def _check_ids(ids_bytes: bytes, sent_ids: Sequence[int], label: str) -> None:
    got = np.frombuffer(ids_bytes, dtype="<i8")
    sent = np.asarray(sent_ids, dtype=np.int64)
    if got.shape != sent.shape:
        raise CaptureFileError(f"{label}: {IDS_KEY} holds {got.size} ids where {sent.size} were sent")
    differ = np.flatnonzero(got != sent)
    if differ.size:
        at = int(differ[0])
        raise CaptureFileError(
            f"{label}: {IDS_KEY} differs from the ids sent at position {at}"
            f" ({int(got[at])} != {int(sent[at])})"
        )


def _check_rows(source: _Source) -> None:
    rows, count = source.hidden.shape[0], source.ids.shape[0]
    if rows != count:
        raise CaptureFileError(
            f"{source.label}: {HIDDEN_KEY} has {rows} rows for {count} token ids"
            " (an abort mid-prefill leaves a short file)"
        )
    scales = source.scales
    if scales is not None and (scales.dtype != "F32" or scales.shape != (count, *_SCALES_SHAPE_TAIL)):
        raise CaptureFileError(
            f"{source.label}: {SCALES_KEY} is {scales.dtype} {list(scales.shape)}, not F32 [{count}, 1, 1]"
        )


def _check_scales(scales_bytes: bytes, label: str) -> None:
    scales = np.frombuffer(scales_bytes, dtype="<f4")
    bad = np.flatnonzero(~(np.isfinite(scales) & (scales > 0)))
    if bad.size:
        at = int(bad[0])
        raise CaptureFileError(
            f"{label}: {bad.size} FP8 scales not finite and positive, first at row {at} ({scales[at]})"
        )


def _read_exact(fh: BinaryIO, view: memoryview, label: str) -> None:
    try:
        while view:
            got = fh.readinto(view)  # type: ignore[attr-defined]
            if not got:
                raise CaptureFileError(f"{label}: truncated while being read (changed under the reader?)")
            view = view[got:]
    except OSError as exc:
        raise CaptureFileError(f"{label}: reading failed: {exc}") from exc


def _chunks(source: _Source, chunk_rows: int) -> Iterator[tuple[int, npt.NDArray[np.unsignedinteger]]]:
    """``(first row, rows)`` of ``hidden_states`` as raw bits ``[n, L, H]``, in one reused buffer:
    each chunk is valid until the next is asked for."""
    hidden = source.hidden
    rows = hidden.shape[0]
    buf = np.empty((max(1, min(chunk_rows, rows)), *hidden.shape[1:]), dtype=_BITS[hidden.dtype].elem)
    source.fh.seek(source.header.data_start + hidden.begin)
    for start in range(0, rows, chunk_rows):
        view = buf[: min(chunk_rows, rows - start)]
        _read_exact(source.fh, view.data.cast("B"), source.label)
        yield start, view


def _store(
    dest: Path, tensors: list[tuple[str, str, tuple[int, ...]]], body: Callable[[_Sink], None]
) -> _Sink:
    """Write the header for ``tensors`` and ``body`` to ``dest``, fsync it; remove it on any failure."""
    header, infos = encode_header(tensors)
    try:
        with dest.open("wb", buffering=0) as fh:
            sink = _Sink(fh, dest)
            sink.write(header)
            body(sink)
            sink.seal()
    except OSError as exc:
        _remove_quietly(dest)
        raise StorageError(f"writing hidden states to {dest} failed: {exc}") from exc
    except BaseException:
        _remove_quietly(dest)
        raise
    if sink.bytes != len(header) + (infos[-1].end if infos else 0):
        raise AssertionError(f"wrote {sink.bytes} bytes to {dest}, not what its header says")
    return sink


def _remove_quietly(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)


def _store_copy(source: _Source, dest: Path, small: dict[str, bytes], chunk_rows: int) -> StoredFeatures:
    """The source's tensors in its own data order, each checked; ``hidden_states`` streamed."""
    check = _checker(source)

    def body(sink: _Sink) -> None:
        for info in source.header.tensors:
            if info.name != HIDDEN_KEY:
                sink.write(small[info.name])
                continue
            for start, chunk in _chunks(source, chunk_rows):
                check(start, chunk)
                sink.write(chunk.data.cast("B"))

    tensors = [(t.name, t.dtype, t.shape) for t in source.header.tensors]
    return _stored(source, _store(dest, tensors, body), stored_dtype=source.hidden.dtype)


def _store_quantised(source: _Source, dest: Path, ids_bytes: bytes, chunk_rows: int) -> StoredFeatures:
    """``token_ids``, then ``hidden_states`` quantised chunk by chunk, then the scales."""
    hidden = source.hidden
    rows, layers, size = hidden.shape
    quantise = _Quantiser(source, min(chunk_rows, rows))
    scales = np.empty(rows, dtype=np.float32)

    def body(sink: _Sink) -> None:
        sink.write(ids_bytes)
        for start, chunk in _chunks(source, chunk_rows):
            sink.write(quantise(start, chunk, scales[start : start + chunk.shape[0]]))
        sink.write(scales.astype("<f4", copy=False).data.cast("B"))

    tensors = [
        (IDS_KEY, "I64", (rows,)),
        (HIDDEN_KEY, _FP8_SOURCE, (rows, layers, size)),
        (SCALES_KEY, "F32", (rows, *_SCALES_SHAPE_TAIL)),
    ]
    return _stored(source, _store(dest, tensors, body), stored_dtype=_FP8_SOURCE)


def _stored(source: _Source, sink: _Sink, *, stored_dtype: str) -> StoredFeatures:
    rows, layers, size = source.hidden.shape
    return StoredFeatures(
        bytes=sink.bytes,
        sha256=sink.sha256.hexdigest(),
        rows=rows,
        layers=layers,
        hidden_size=size,
        source_dtype=source.hidden.dtype,
        stored_dtype=stored_dtype,
    )


def _checker(source: _Source) -> Callable[[int, npt.NDArray[np.unsignedinteger]], None]:
    """A check of one chunk of raw bits for NaN and infinity, with a scratch buffer of its own."""
    bits = _BITS[source.hidden.dtype]
    scratch: list[npt.NDArray[np.unsignedinteger]] = []

    def check(start: int, chunk: npt.NDArray[np.unsignedinteger]) -> None:
        if not scratch or scratch[0].shape[0] < chunk.shape[0]:
            scratch[:] = [np.empty_like(chunk)]
        magnitude = scratch[0][: chunk.shape[0]]
        np.bitwise_and(chunk, bits.magnitude_mask, out=magnitude)
        if magnitude.size and magnitude.max() >= bits.nonfinite_from:
            raise _nonfinite_error(source, start, magnitude)

    return check


class _Quantiser:
    """Checks and quantises 16-bit chunks in preallocated buffers (float32 work, uint32 scratch,
    FP8 out), so a store allocates nothing per chunk."""

    def __init__(self, source: _Source, chunk_rows: int) -> None:
        self._source = source
        self._bits = _BITS[source.hidden.dtype]
        shape = (max(1, chunk_rows), *source.hidden.shape[1:])
        self._work = np.empty(shape, dtype=np.float32)
        self._out = np.empty(shape, dtype=np.uint8)
        self._scratch = np.empty(shape, dtype=np.uint32)
        self._row_values = math.prod(shape[1:])

    def __call__(
        self, start: int, chunk: npt.NDArray[np.unsignedinteger], scales: npt.NDArray[np.float32]
    ) -> memoryview:
        n = chunk.shape[0]
        work = self._work[:n]
        # The first half of the float32 buffer holds the sign-stripped bits until the values
        # overwrite them: no third buffer.
        magnitude = work.view(np.uint16).reshape(-1)[: chunk.size].reshape(chunk.shape)
        np.bitwise_and(chunk, self._bits.magnitude_mask, out=magnitude)
        row_max = magnitude.reshape(n, self._row_values).max(axis=1)
        if row_max.size and row_max.max() >= self._bits.nonfinite_from:
            raise _nonfinite_error(self._source, start, magnitude)
        scales[:] = fp8.scales_from_amax(fp8.amax_from_bits(row_max, source_dtype=self._source.hidden.dtype))
        if self._source.hidden.dtype == "BF16":
            fp8.bf16_bits_to_f32(chunk, out=work)
        else:
            np.copyto(work, chunk.view("<f2"))
        out = self._out[:n]
        fp8.quantize_scaled(work, scales, out=out, scratch=self._scratch[:n])
        return out.data.cast("B")


def _nonfinite_error(
    source: _Source, start: int, magnitude: npt.NDArray[np.unsignedinteger]
) -> CaptureFileError:
    """The error for a chunk at ``start`` whose sign-stripped bits hold a NaN or infinity; reads on
    to the end of ``hidden_states`` so it names every layer slot that holds one."""
    bits = _BITS[source.hidden.dtype]
    bad = magnitude >= bits.nonfinite_from
    first_row = start + int(np.flatnonzero(bad.any(axis=(1, 2)))[0])
    slots = bad.any(axis=(0, 2))
    count = int(bad.sum())
    end_of_chunk = start + magnitude.shape[0]
    rows = source.hidden.shape[0]
    if end_of_chunk < rows:
        rest = _Source(
            source.fh, source.label, source.header, _rows_from(source.hidden, end_of_chunk), source.ids, None
        )
        for _, chunk in _chunks(rest, max(1, magnitude.shape[0])):
            more = (chunk & bits.magnitude_mask) >= bits.nonfinite_from
            slots |= more.any(axis=(0, 2))
            count += int(more.sum())
    named = ", ".join(str(int(i)) for i in np.flatnonzero(slots))
    return CaptureFileError(
        f"{source.label}: {count} non-finite values (NaN or infinity) in layer slot(s) {named}"
        f" of {source.hidden.shape[1]}, first at row {first_row} of {rows}"
    )


def _rows_from(hidden: TensorInfo, first: int) -> TensorInfo:
    """``hidden`` without its first ``first`` rows."""
    return TensorInfo(
        name=hidden.name,
        dtype=hidden.dtype,
        shape=(hidden.shape[0] - first, *hidden.shape[1:]),
        begin=hidden.begin + first * hidden.row_bytes,
        end=hidden.end,
    )
