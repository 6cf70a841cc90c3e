"""What a worker reads once per job, cached for the prompts of that job that it runs."""

from __future__ import annotations

from dataclasses import dataclass

from datagen.control.jobs import JobStore
from datagen.spec import JobSpec

__all__ = ["JobInfo", "JobInfos"]


@dataclass(frozen=True)
class JobInfo:
    """What a worker reads once per job: its spec and the tokenizer identity for records."""

    spec: JobSpec
    tokenizer: str
    stop_ids: tuple[int, ...] = ()


class JobInfos:
    def __init__(self, jobs: JobStore) -> None:
        self._jobs = jobs
        self._seen: dict[tuple[str, str], JobInfo] = {}

    def get(self, job_id: str, incarnation: str = "") -> JobInfo:
        # By incarnation too: a new job of a reused id may have another spec.
        info = self._seen.get((job_id, incarnation))
        if info is None:
            spec, tokenizer, stop_ids = self._jobs.run_facts(job_id)
            info = JobInfo(spec, tokenizer, tuple(stop_ids))
            self._seen[job_id, incarnation] = info
        return info
