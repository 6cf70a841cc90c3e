"""Records as workers commit them, with plausible values for the columns a test does not care about,
a manifest written as tools write one, and hidden-state features files written by hand (the
safetensors layout: an 8-byte little-endian header length, the JSON header, then the tensors' bytes)."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from datagen.records.schema import Record
from datagen.records.storage import Storage

__all__ = [
    "features_tensors",
    "make_record",
    "read_safetensors",
    "safetensors_bytes",
    "store_features",
    "write_manifest_once",
]

# safetensors' dtype names of the arrays a features file holds.
SAFETENSORS_DTYPES = {
    np.dtype(ml_dtypes.bfloat16): "BF16",
    np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3",
    np.dtype(np.float32): "F32",
    np.dtype(np.int64): "I64",
}
_HEADER_LENGTH = struct.Struct("<Q")
_HEADER_ALIGN = 8


def make_record(sample_id: str, input_ids: list[int], prompt_len: int, **fields: Any) -> Record:
    """A record with plausible values for every column the test does not care about."""
    values: dict[str, Any] = {
        "job_id": "job1",
        "turn": 0,
        "gen": 0,
        "partition": "default",
        "cls": "short",
        "finish_type": "stop",
        "finish_matched": "1",
        "finish_length": None,
        "max_new_tokens": 16,
        "server": "s",
        "tokenizer": "tok",
        "sampling_params": "{}",
        "rid": "r",
        "worker": "w",
        "attempts": 1,
        "cached_tokens": 0,
        "num_retractions": 0,
        "e2e_latency_s": 0.1,
        "enqueued_at_ms": 1,
        "started_at_ms": 2,
        "finished_at_ms": 3,
        **fields,
    }
    return Record(sample_id=sample_id, input_ids=input_ids, prompt_len=prompt_len, **values)


def write_manifest_once(storage: Storage, job_id: str, manifest: dict[str, Any]) -> dict[str, Any]:
    """Write the manifest unless one exists; return the one in force."""
    existing = storage.read_manifest(job_id)
    if existing is not None:
        return existing
    storage.write_manifest(job_id, manifest)
    return manifest


def safetensors_bytes(tensors: dict[str, np.ndarray]) -> bytes:
    """A safetensors file of ``tensors``, in order, written by hand (no ``__metadata__``, as vLLM's)."""
    header: dict[str, Any] = {}
    blobs: list[bytes] = []
    offset = 0
    for name, array in tensors.items():
        data = np.ascontiguousarray(array).tobytes()
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[array.dtype],
            "shape": list(array.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % _HEADER_ALIGN)
    return _HEADER_LENGTH.pack(len(text)) + text + b"".join(blobs)


def read_safetensors(data: bytes) -> dict[str, np.ndarray]:
    """The tensors of a safetensors file, as numpy arrays (bf16 and fp8 through ml_dtypes)."""
    (length,) = _HEADER_LENGTH.unpack_from(data)
    header = json.loads(data[_HEADER_LENGTH.size : _HEADER_LENGTH.size + length])
    body = data[_HEADER_LENGTH.size + length :]
    dtypes = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        start, end = entry["data_offsets"]
        tensors[name] = np.frombuffer(body[start:end], dtype=dtypes[entry["dtype"]]).reshape(entry["shape"])
    return tensors


def features_tensors(input_ids: list[int], hidden_states: np.ndarray) -> dict[str, np.ndarray]:
    """What vLLM's capture writes for a sequence: ``hidden_states`` [T, L, H] bf16, ``token_ids`` [T]."""
    assert hidden_states.shape[0] == len(input_ids)
    return {
        "hidden_states": hidden_states.astype(ml_dtypes.bfloat16),
        "token_ids": np.array(input_ids, dtype=np.int64),
    }


def store_features(
    storage: Storage, job_id: str, name: str, tensors: dict[str, np.ndarray], scratch: Path
) -> dict[str, Any]:
    """Write a features file locally and have storage adopt it, as a worker does before it commits
    the record; returns the record's features fields."""
    data = safetensors_bytes(tensors)
    local = scratch / f"{job_id}-{name}"
    local.parent.mkdir(parents=True, exist_ok=True)
    local.write_bytes(data)
    storage.adopt_feature(job_id, name, local)
    return {
        "features_file": name,
        "features_bytes": len(data),
        "features_sha256": hashlib.sha256(data).hexdigest(),
    }
