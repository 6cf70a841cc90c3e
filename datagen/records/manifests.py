"""What Redis may lose and storage keeps, for `datagen.records.storage`: each job's manifest (one per
incarnation), how an incarnation ended (``deleted.json``, ``cancelled.json``), which jobs exist, and
the Redis namespace that owns the root.

A manifest or marker that is not the job's own (`datagen.records.belonging`: copied or planted from
another job) is refused and named, never acted on: nothing is rebuilt from it, no job is dropped for it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Any

from datagen.clock import now_ms
from datagen.errors import ConfigError, ForeignFileError
from datagen.records.belonging import ending_body, judge_ending, manifest_problem
from datagen.records.layout import JOB_ID_PATTERN, NAMESPACE_MARKER, JobFolders, translated

__all__ = ["JobManifests"]

log = logging.getLogger(__name__)


class JobManifests(JobFolders):
    def __init__(self, root: str | os.PathLike[str]) -> None:
        super().__init__(root)
        self._refused: set[tuple[str, str]] = set()  # (path, sha256) of files refused and logged

    def write_manifest(self, job_id: str, manifest: dict[str, Any]) -> None:
        """Write the manifest of a new incarnation of the job, replacing an earlier one's (whose
        records, if any are left, then drop out of exports: they carry the old incarnation)."""
        path = self._path(job_id, "manifest.json")
        self._write_object(path, json.dumps(manifest, indent=2, sort_keys=True).encode("utf-8"))

    def read_manifest(self, job_id: str) -> dict[str, Any] | None:
        """The job's manifest (None: none stored). `ForeignFileError` naming the file when it is not
        the job's (it names another job: copied or planted) or not a JSON object
        (`datagen.records.belonging`): nothing is made of it, nor dropped for it."""
        path = self._path(job_id, "manifest.json")
        with translated(f"cannot read manifest {self._files.display(path)}"):
            try:
                data = self._files.read_bytes(path)
            except FileNotFoundError:
                return None
        return self._own_manifest(job_id, path, data)

    def _own_manifest(self, job_id: str, path: str, data: bytes) -> dict[str, Any]:
        try:
            manifest = json.loads(data)
        except ValueError:  # not JSON, or not UTF-8
            manifest = None
        problem = manifest_problem(manifest, job_id)
        if problem is not None:
            raise ForeignFileError(
                f"{self._files.display(path)} {problem}: refused, not acted on (nothing of job {job_id} "
                "was rebuilt from it or dropped). Put the job's own manifest.json back, or remove the file"
            )
        assert isinstance(manifest, dict)
        return manifest

    def list_jobs(self) -> list[str]:
        """Every job id with something stored (`service.rebuild` rebuilds jobs Redis lost from these),
        but those whose manifest is not theirs (:meth:`read_manifest`; one log line each): nothing is
        rebuilt from a copied or planted manifest, and no job is dropped for one."""
        directory = self._files.under_root("jobs")
        with translated(f"cannot list the jobs under {self._files.display(directory)}"):
            names = self._files.list_names(directory, "")
            job_ids = [n for n in names if JOB_ID_PATTERN.fullmatch(n)]
            paths = [self._path(job_id, "manifest.json") for job_id in job_ids]
            manifests = self._files.read_present(paths)
        kept = []
        for job_id, path, data in zip(job_ids, paths, manifests, strict=True):
            try:
                if data is not None:
                    self._own_manifest(job_id, path, data)
            except ForeignFileError as exc:
                log.warning("job %s left alone: %s", job_id, exc)
                continue
            kept.append(job_id)
        return kept

    def write_ending(self, job_id: str, ending: str, incarnation: str) -> None:
        """Mark the incarnation ``ending`` (``deleted``, ``cancelled``): a job that Redis forgot is
        rebuilt as it ended, never brought back to life. A new incarnation's manifest outdates it.
        The marker names the job, the ending and the incarnation (`datagen.records.belonging`)."""
        body = ending_body(job_id, ending, incarnation, now_ms())
        self._write_object(self._path(job_id, f"{ending}.json"), json.dumps(body).encode("utf-8"))

    def ending(self, job_id: str, ending: str, incarnation: str) -> bool:
        """Whether :meth:`write_ending` marked this incarnation (the manifest's) of the job
        ``ending``. A marker that is not the job's (another job's, another ending's, one of another
        incarnation newer than the manifest, or unreadable) is refused with one log line naming it,
        and never acted on (`datagen.records.belonging`)."""
        path = self._path(job_id, f"{ending}.json")
        with translated(f"cannot read {self._files.display(path)}"):
            try:
                data = self._files.read_bytes(path)
            except FileNotFoundError:
                return False
        try:
            marker = json.loads(data)
        except ValueError:  # not JSON, or not UTF-8
            marker = None
        verdict = judge_ending(
            marker,
            job_id=job_id,
            ending=ending,
            incarnation=incarnation,
            manifest_created_ms=self._created_ms(job_id, marker, incarnation),
        )
        if verdict.problem is not None:
            self._refuse_once(path, data, verdict.problem)
        return verdict.honoured

    def _created_ms(self, job_id: str, marker: object, incarnation: str) -> int:
        """When the manifest's incarnation was made (0: unknown), read only for a marker of
        another incarnation (the rare case that needs it)."""
        if not isinstance(marker, dict) or marker.get("incarnation") in (None, incarnation):
            return 0
        try:
            manifest = self.read_manifest(job_id) or {}
        except ForeignFileError:
            return 0
        created = manifest.get("created_at_ms")
        return created if isinstance(created, int) and not isinstance(created, bool) else 0

    def _refuse_once(self, path: str, data: bytes, problem: str) -> None:
        """One log line per refused file (and content) in this process, however often it is read."""
        seen = (path, hashlib.sha256(data).hexdigest())
        if seen in self._refused:
            return
        self._refused.add(seen)
        log.warning(
            "%s %s: refused, not acted on (a file copied or planted from elsewhere); remove it",
            self._files.display(path),
            problem,
        )

    def claim_namespace(self, namespace: str) -> None:
        """Bind this storage root to one Redis namespace, or refuse: job ids are unique only within
        a namespace, so two namespaces under one root would write (and delete) each other's jobs."""
        path = self._files.under_root(NAMESPACE_MARKER)
        with translated(f"cannot read {self._files.display(path)}"):
            try:
                owner = json.loads(self._files.read_bytes(path)).get("namespace")
            except FileNotFoundError:
                owner = None
        if owner is None:
            self._write_object(path, json.dumps({"namespace": namespace}).encode("utf-8"))
            return
        if owner != namespace:
            raise ConfigError(
                f"storage {self.root} belongs to Redis namespace {owner!r}, not {namespace!r}: give each "
                "namespace its own storage root (DATAGEN_STORAGE), e.g. a subdirectory named after it"
            )
