"""A job's ingestion counters, partition labels and breakdown written straight into its keys, for
tests that need a job in some state without running an ingestion (production writes them as a
chunk lands: `datagen.control.ingest_chunks`, ``lua/ingest_land.lua``)."""

from __future__ import annotations

from redis.client import Pipeline

from datagen.control.keys import BreakdownField, Keys


def add_ingest_counts(pipe: Pipeline, keys: Keys, job_id: str, counts: dict[str, int], line: int) -> None:
    """Add ``counts`` to the job's counters and set its checkpoint line, in ``pipe``."""
    key = keys.job(job_id)
    for name, value in counts.items():
        if value:
            pipe.hincrby(key, name, value)
    pipe.hset(key, "ingest_line", line)


def add_partition_labels(pipe: Pipeline, keys: Keys, job_id: str, partitions: list[str]) -> None:
    """Label ``partitions`` as the job's own (not ``other``), in ``pipe``: in its labelled
    partitions, and in its hash (``labels`` and ``label:<partition>``, `label_field` in lib.lua)."""
    if partitions:
        pipe.sadd(keys.job_partitions(job_id), *partitions)
        pipe.hset(keys.job(job_id), mapping={f"label:{p}": 1 for p in partitions})
        pipe.hincrby(keys.job(job_id), "labels", len(partitions))


def add_breakdown(pipe: Pipeline, keys: Keys, job_id: str, counts: dict[BreakdownField, int]) -> None:
    """Add ``(counter, partition label, class) -> n`` to the job's breakdown, in ``pipe``."""
    key = keys.job_breakdown(job_id)
    for name, n in counts.items():
        pipe.hincrby(key, name.encode(), n)
