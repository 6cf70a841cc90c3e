"""Rebuilding jobs from storage, the source of truth, when Redis lost or rolled back its data.

Redis holds the working state (queues, counters, the rows guard); storage holds what a job *is*
(its manifest with the spec and incarnation, its uploads) and what it *did* (commit objects and
their shards), plus how it ended when that must outlive Redis (``deleted.json``,
``cancelled.json``, `Storage.write_ending`). When Redis lost its data (`datagen.control.epoch`), went back
to an older snapshot, or holds fewer done prompts than storage has records, the coordinator
rebuilds each such job: its Redis state is dropped, its hash made again with the *same*
incarnation (so records of prompts in flight still count), and its uploads ingested again from
the first line, with every prompt that has a committed record counted done instead of enqueued
(`service.committed`). A job deleted without its files stays deleted; a cancelled one comes back
cancelled. The job says it was rebuilt (``rebuilt`` in its JSON: when, why, what storage had).
The manifest is read and validated whole before anything of the job is dropped: a job whose
manifest does not validate is left as it is (`datagen recover` answers 409 naming the field).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeGuard

from datagen.control.jobs import JobStore
from datagen.control.progress import now_ms
from datagen.errors import InvalidSpecError, JobNotFoundError, JobStateError
from datagen.records.storage import Storage
from datagen.spec import JobSpec, validate_spec
from datagen.states import JobState, RebuildReason
from service.committed import Committed, read_committed
from service.lifecycle import ENDING_CANCELLED, ENDING_DELETED, JobControls

__all__ = ["Rebuilder", "Suspicion"]

log = logging.getLogger(__name__)

StartIngest = Callable[[str, list[str], Committed], None]


@dataclass(frozen=True)
class Suspicion:
    """What the caller knows of Redis, and says in each rebuilt job's note: ``lost`` (a job missing
    from Redis was lost, not deleted), ``rolled_back`` (every live job may be behind its storage)."""

    reason: str
    lost: bool = False
    rolled_back: bool = False
    # Redis's epoch ``seq`` at a coordinator's start (a time in ms; 0: none): a stored job created
    # after it that Redis lacks was made after the data Redis holds, so Redis went back in time
    # while no coordinator watched (a job deleted since has a marker, or no files).
    epoch_ms: int = 0

    @property
    def label(self) -> RebuildReason:
        return RebuildReason.ROLLED_BACK if self.rolled_back else RebuildReason.LOST


class Rebuilder:
    def __init__(
        self,
        jobs: JobStore,
        storage: Storage,
        controls: JobControls,
        *,
        start_ingest: StartIngest,
        stop_ingest: Callable[[str], None],
        on_rebuilt: Callable[[RebuildReason], None] = lambda reason: None,
    ) -> None:
        self.jobs = jobs
        self.storage = storage
        self.controls = controls
        self.start_ingest = start_ingest
        self.stop_ingest = stop_ingest
        self.on_rebuilt = on_rebuilt  # counts rebuilds (the coordinator's metric)

    def reconcile(self, suspicion: Suspicion) -> list[str]:
        """Hold every stored job to Redis and rebuild the ones Redis lost or holds behind; returns
        their ids."""
        rebuilt = []
        for job_id in self.storage.list_jobs():
            why = self._why_rebuild(job_id, suspicion)
            if why is None:
                continue
            try:
                self.rebuild(job_id, *why)
            except JobStateError as exc:  # its manifest does not validate: the others go on
                log.error("job %s: %s", job_id, exc)
                continue
            rebuilt.append(job_id)
        return rebuilt

    def _why_rebuild(self, job_id: str, suspicion: Suspicion) -> tuple[str, RebuildReason] | None:
        manifest = self.storage.read_manifest(job_id)
        incarnation = _incarnation(manifest)
        if manifest is None or not incarnation:
            return None  # nothing to rebuild from: no manifest, or one from before incarnations
        held = self.jobs.incarnation(job_id)
        if self.storage.ending(job_id, ENDING_DELETED, incarnation):
            if held == incarnation:  # Redis went back to before the delete
                self.controls.forget(job_id)
                log.warning("job %s: deleted, but Redis held it again (an older snapshot); forgotten", job_id)
            return None
        if held is None:
            if suspicion.lost or suspicion.rolled_back:
                return suspicion.reason, suspicion.label
            created = manifest.get("created_at_ms")
            created_ms = created if _is_int(created) else 0
            if suspicion.epoch_ms and created_ms > suspicion.epoch_ms:
                why = "Redis went back to an older snapshot (the job is newer than Redis's data)"
                return why, RebuildReason.ROLLED_BACK
            return None
        if held != incarnation:
            # A job of this id being made right now (its manifest follows its hash), or a stale
            # manifest: Redis's newer incarnation is left alone.
            return None
        try:
            progress = self.jobs.progress(job_id)
        except JobNotFoundError:
            return None
        if progress.state.is_final:
            return None
        if suspicion.rolled_back:
            return suspicion.reason, suspicion.label
        committed = read_committed(self.storage, job_id)
        if len(committed) > progress.done + progress.in_flight:
            why = f"Redis counts {progress.done} prompts done, storage holds {len(committed)} records"
            return why, RebuildReason.BEHIND
        return None

    def rebuild(self, job_id: str, reason: str, label: RebuildReason) -> dict[str, Any]:
        """Make the job again from storage (see the module docstring); returns its ``rebuilt`` note.
        A manifest that does not validate raises JobStateError before anything of the job changes."""
        stored = _read_manifest(self.storage, job_id)
        incarnation = stored.incarnation
        if self.storage.ending(job_id, ENDING_DELETED, incarnation):
            raise JobNotFoundError(f"job {job_id} was deleted; it is not rebuilt")
        previous = self._previous(job_id)
        self.stop_ingest(job_id)
        self.controls.forget(job_id, keep_hash=True)
        committed = read_committed(self.storage, job_id)
        note: dict[str, Any] = {
            "at_ms": now_ms(),
            "reason": reason,
            "committed": len(committed),
            "unreadable_shards": committed.unreadable_shards,
            "in_flight_before": previous.get("in_flight", 0),
            "done_before": previous.get("done"),
            "rebuilds": int(previous.get("rebuilds", 0)) + 1,
        }
        fields: dict[str, str | int] = {"rebuilt": json.dumps(note, sort_keys=True)}
        if stored.context_len:
            fields["context_len"] = stored.context_len
        cancelled = self.storage.ending(job_id, ENDING_CANCELLED, incarnation)
        inputs = [] if cancelled else self.storage.input_names(job_id)
        if not inputs:  # nothing to ingest again: what is committed is the whole job
            fields.update(
                accepted=len(committed),
                done=len(committed),
                output_tokens=sum(committed.output_tokens.values()),
                finished_at_ms=now_ms(),
            )
        self.jobs.create(
            job_id,
            stored.spec,
            tokenizer_identity=stored.tokenizer_identity,
            stop_ids=stored.stop_ids,
            incarnation=incarnation,
            created_at_ms=stored.created_at_ms,
            state=JobState.CANCELLED if cancelled else JobState.INGESTING,
            fields=fields,
            replace=True,
        )
        log.warning(
            "job %s rebuilt from storage (%s): %d prompts have committed records%s; %s",
            job_id,
            reason,
            len(committed),
            f", {committed.unreadable_shards} shards unreadable" if committed.unreadable_shards else "",
            "it stays cancelled" if cancelled else f"ingesting its uploads again ({len(inputs)})",
        )
        self.on_rebuilt(label)
        if inputs:
            self.start_ingest(job_id, inputs, committed)
        elif not cancelled:
            self.jobs.finish_ingest(job_id)  # no upload left: it completes with what it has
        return note

    def _previous(self, job_id: str) -> dict[str, Any]:
        """What Redis still says of the job (nothing if it lost it)."""
        try:
            progress = self.jobs.progress(job_id)
        except JobNotFoundError:
            return {}
        previous: dict[str, Any] = {"done": progress.done, "in_flight": progress.in_flight}
        if progress.rebuilt:
            previous["rebuilds"] = progress.rebuilt.get("rebuilds", 0)
        return previous


@dataclass(frozen=True)
class _StoredJob:
    """What a rebuild makes the job from: its manifest, read and validated whole first."""

    incarnation: str
    spec: JobSpec
    tokenizer_identity: str
    stop_ids: list[int]
    context_len: int | None
    created_at_ms: int | None


def _incarnation(manifest: object) -> str:
    """The incarnation a manifest names ('': none, or no manifest a rebuild can start from)."""
    return str(manifest.get("incarnation") or "") if isinstance(manifest, dict) else ""


def _read_manifest(storage: Storage, job_id: str) -> _StoredJob:
    """The job's manifest as a rebuild uses it. JobNotFoundError without one (or one from before
    incarnations); JobStateError naming the field when it does not validate (a spec written by an
    older version, an edited file)."""
    manifest = storage.read_manifest(job_id)
    if not _incarnation(manifest):
        raise JobNotFoundError(
            f"job {job_id} has no manifest with an incarnation in storage ({storage.url(job_id)}); "
            "there is nothing to rebuild it from: submit its dataset again under a new job id"
        )
    assert isinstance(manifest, dict)
    try:
        return _stored_job(manifest)
    except (InvalidSpecError, ValueError) as exc:
        raise JobStateError(
            f"job {job_id} cannot be rebuilt: its manifest ({storage.url(job_id)}/manifest.json) does not "
            f"validate: {exc}. Nothing of the job was changed; restore a valid manifest.json, or submit "
            "its dataset again under a new job id"
        ) from exc


def _stored_job(manifest: dict[str, Any]) -> _StoredJob:
    incarnation, spec = manifest["incarnation"], manifest.get("spec")
    if not isinstance(incarnation, str):
        raise ValueError(f"incarnation: expected a string, got {json.dumps(incarnation)[:80]}")
    if not isinstance(spec, dict):
        raise ValueError("spec: expected the job spec as a JSON object")
    preflight = _object(manifest, "preflight")
    stop_ids = preflight.get("stop_ids") or []
    if not isinstance(stop_ids, list) or not all(_is_int(i) for i in stop_ids):
        raise ValueError("preflight.stop_ids: expected a list of token ids")
    return _StoredJob(
        incarnation=incarnation,
        spec=validate_spec(spec),
        tokenizer_identity=_tokenizer_identity(manifest, spec),
        stop_ids=list(stop_ids),
        context_len=_optional_int(preflight, "context_len", "preflight.context_len"),
        created_at_ms=_optional_int(manifest, "created_at_ms"),
    )


def _object(parent: dict[str, Any], name: str) -> dict[str, Any]:
    value = parent.get(name) or {}
    if not isinstance(value, dict):
        raise ValueError(f"{name}: expected a JSON object")
    return value


def _optional_int(parent: dict[str, Any], name: str, where: str = "") -> int | None:
    value = parent.get(name)
    if value is None or value == 0:
        return None
    if not _is_int(value) or value < 0:
        raise ValueError(f"{where or name}: expected a whole number, got {json.dumps(value)[:80]}")
    return int(value)


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _tokenizer_identity(manifest: dict[str, Any], spec: dict[str, Any]) -> str:
    """What the submit wrote into the job (`service.coordinator`): name and file hash."""
    identity = _object(manifest, "tokenizer")
    name, digest = identity.get("tokenizer"), identity.get("tokenizer_sha256")
    if name and digest:
        return f"{name}@sha256:{digest}"
    return str(name or spec.get("tokenizer", ""))
