"""Records as workers commit them, with plausible values for the columns a test does not care about,
and a manifest written as tools write one."""

from __future__ import annotations

from typing import Any

from datagen.records.schema import Record
from datagen.records.storage import Storage

__all__ = ["make_record", "write_manifest_once"]


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
