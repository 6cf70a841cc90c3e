"""What a worker reads once per job, cached for the prompts of that job that it runs."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from datagen.control.jobs import JobStore, RunFacts
from datagen.spec import JobSpec

__all__ = ["KNOWN_TOLD", "JobInfo", "JobInfos"]

# The jobs a claim is told this worker knows (the ones it used last): a claim hands out the run
# facts of the others with their first prompts. One the list leaves out only comes with its facts
# again (in the read the claim makes of its weight anyway); the claim's argument stays short.
KNOWN_TOLD = 64
# Jobs kept at most (a worker that lives through thousands of jobs keeps the last ones it used).
JOBS_KEPT = 4096


@dataclass(frozen=True)
class JobInfo:
    """What a worker reads once per job: its spec and the tokenizer identity for records."""

    spec: JobSpec
    tokenizer: str
    stop_ids: tuple[int, ...] = ()


class JobInfos:
    """Per job and incarnation (a new job of a reused id may have another spec). Filled by claims
    (`learn`) and, for a job no claim told of (a handed-back prompt, a next turn), by one read."""

    def __init__(self, jobs: JobStore) -> None:
        self._jobs = jobs
        self._seen: OrderedDict[tuple[str, str], JobInfo] = OrderedDict()
        # Claims run on the event loop, reads also from threads (`while_redis_down`).
        self._lock = threading.Lock()

    def get(self, job_id: str, incarnation: str = "") -> JobInfo:
        key = (job_id, incarnation)
        with self._lock:
            info = self._seen.get(key)
            if info is not None:
                self._seen.move_to_end(key)
                return info
        facts = self._jobs.run_facts(job_id)
        info = JobInfo(facts.spec, facts.tokenizer, facts.stop_ids)
        self._keep(key, info)
        return info

    def learn(self, job_id: str, facts: RunFacts) -> None:
        """A claim's run facts of a job, for its prompts of that incarnation."""
        self._keep((job_id, facts.incarnation), JobInfo(facts.spec, facts.tokenizer, facts.stop_ids))

    def _keep(self, key: tuple[str, str], info: JobInfo) -> None:
        with self._lock:
            self._seen[key] = info
            self._seen.move_to_end(key)
            while len(self._seen) > JOBS_KEPT:
                self._seen.popitem(last=False)

    def known(self) -> list[str]:
        """The ids of the jobs used last, at most `KNOWN_TOLD`: what a claim need not tell of."""
        with self._lock:
            recent: list[str] = []
            for job_id, _ in reversed(self._seen):
                if job_id not in recent:
                    recent.append(job_id)
                    if len(recent) == KNOWN_TOLD:
                        break
            return recent
