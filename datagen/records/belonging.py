"""Whether a job's manifest and ending markers belong to it: storage is the truth, but a file copied
or planted into a job's folder is not the job's.

A manifest names its job (``job_id``, since the first release) and its incarnation. An ending
marker (``deleted.json``, ``cancelled.json``: `datagen.records.manifests.JobManifests.write_ending`)
names its job, which ending it is, and the incarnation it ends. A file that names another job (or,
for a marker, another ending) is refused: a rebuild neither starts from it nor drops a job for it,
and the reader names the file. A marker of another incarnation than the manifest's is an earlier
job's when it is older than the manifest (outdated, ignored without a word), and refused otherwise.

Files written before they named their job stay readable: a manifest without ``job_id`` is read as is
(no release wrote one; a tool's or a test's), and a marker without it counts when its incarnation is
the manifest's, which only that job's own manifest holds (a random id made at each create). None of
this stops someone who may write the storage from forging a file by hand: they could as well delete
the records (see `docs/operator/security.md`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["EndingVerdict", "ending_body", "judge_ending", "manifest_problem"]


def ending_body(job_id: str, ending: str, incarnation: str, at_ms: int) -> dict[str, Any]:
    """What an ending marker holds."""
    return {"job_id": job_id, "ending": ending, "incarnation": incarnation, "at_ms": at_ms}


@dataclass(frozen=True)
class EndingVerdict:
    """``honoured``: the marker ends this incarnation. ``problem``: why it is refused (None when it
    is the job's own, outdated or not)."""

    honoured: bool
    problem: str | None = None


def judge_ending(
    marker: object, *, job_id: str, ending: str, incarnation: str, manifest_created_ms: int
) -> EndingVerdict:
    """Whether ``marker`` (decoded JSON) marks incarnation ``incarnation`` (the manifest's) of job
    ``job_id`` ``ending``; ``manifest_created_ms``: when that incarnation was made (0: unknown)."""
    if not isinstance(marker, dict):
        return EndingVerdict(False, "is not a JSON object")
    named_job = marker.get("job_id")
    if named_job is not None and named_job != job_id:
        return EndingVerdict(False, f"names job {str(named_job)[:80]!r}, not {job_id}")
    named_ending = marker.get("ending")
    if named_ending is not None and named_ending != ending:
        return EndingVerdict(False, f"says {str(named_ending)[:80]!r}, not {ending!r}")
    named = marker.get("incarnation")
    if not isinstance(named, str) or not named:
        return EndingVerdict(False, "names no incarnation")
    if named == incarnation:
        return EndingVerdict(True)
    at_ms = marker.get("at_ms")
    if isinstance(at_ms, int) and not isinstance(at_ms, bool) and at_ms < manifest_created_ms:
        return EndingVerdict(False)  # an earlier job's of this id, outdated by the manifest
    if not manifest_created_ms:
        return EndingVerdict(False)  # no time to tell by: taken for an earlier job's
    return EndingVerdict(
        False,
        f"names incarnation {named[:40]!r}, not the manifest's {incarnation!r}, and is not older than it",
    )


def manifest_problem(manifest: object, job_id: str) -> str | None:
    """Why a decoded manifest is not job ``job_id``'s (None: it is, or names no job)."""
    if not isinstance(manifest, dict):
        return "is not a JSON object"
    named_job = manifest.get("job_id")
    if named_job is not None and named_job != job_id:
        return f"names job {str(named_job)[:80]!r}, not {job_id}"
    return None
