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

**Single flight.** A job is rebuilt by one process at a time across every coordinator of the
namespace: the rebuild holds the job's lease (`datagen.control.leases`, ``{ns}:job:<id>:rebuild``).
Its token fences what it writes: the hash is replaced only while the lease still holds it
(``create.lua``), the hash keeps it (``rebuild_token``), and the job's ingest fence admits only the
ingestion this rebuild starts, so an older rebuild's ingestion (here or on another coordinator)
lands nothing more. Whoever finds the lease held waits for it. A rebuild that succeeded leaves a
done marker on the lease for `JOIN_WINDOW_MS`: a recover asked while a rebuild runs, or within that
window after it, *joins* it (answers its note; the job is rebuilt once), and a reconcile leaves the
job alone, as long as the job's hash carries that rebuild's token; if it does not (the holder died,
lost its lease, or Redis went back to before it), the waiter takes the lease and rebuilds itself.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeGuard

from datagen.clock import now_ms
from datagen.control.jobs import JobStore, ingest_fence_value
from datagen.control.leases import HeldLease, Leases, done_token
from datagen.errors import InvalidSpecError, JobNotFoundError, JobStateError
from datagen.records.storage import Storage
from datagen.spec import JobSpec, validate_spec
from datagen.states import JobState, RebuildReason
from service.committed import Committed, read_committed
from service.lifecycle import ENDING_CANCELLED, ENDING_DELETED, JobControls

__all__ = ["Rebuilder", "Suspicion"]

log = logging.getLogger(__name__)

# (job id, uploads in order, what storage has committed, the ingest fence's value the ingestion holds to)
StartIngest = Callable[[str, list[str], Committed, str], None]
# How long a rebuild or recover waits for another's rebuild of the same job (it renews its lease
# while it works; a dead holder's lease expires within `datagen.control.leases.LEASE_TTL_MS`).
REBUILD_WAIT_S = 300.0
# How long after a rebuild of a job ends a recover of it joins that rebuild instead of making one
# more (concurrent recovers are not all handled at the same instant).
JOIN_WINDOW_MS = 5_000


@dataclass(frozen=True)
class Suspicion:
    """What the caller knows of Redis, and says in each rebuilt job's note: ``lost`` (a job missing
    from Redis was lost, not deleted), ``rolled_back`` (every live job may be behind its storage)."""

    reason: str
    lost: bool = False
    rolled_back: bool = False
    # Redis's epoch at a coordinator's start (`datagen.control.epoch`; None: none): a stored job
    # whose manifest names this id with a higher ``seq`` (the epoch when it was created) and that
    # Redis lacks was made after the data Redis holds, so Redis went back in time while no
    # coordinator watched (a job deleted since has a marker, or no files). No clock takes part.
    epoch_id: str | None = None
    epoch_seq: int = 0

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
        leases: Leases | None = None,
    ) -> None:
        self.jobs = jobs
        self.leases = leases or Leases(jobs.redis)
        self.storage = storage
        self.controls = controls
        self.start_ingest = start_ingest
        self.stop_ingest = stop_ingest
        self.on_rebuilt = on_rebuilt  # counts rebuilds (the coordinator's metric)

    def reconcile(self, suspicion: Suspicion) -> list[str]:
        """Hold every stored job to Redis and rebuild the ones Redis lost or holds behind; returns
        their ids. A job another process is rebuilding meanwhile is waited for and left to it."""
        rebuilt = []
        for job_id in self.storage.list_jobs():
            if self._why_rebuild(job_id, suspicion) is None:
                continue
            try:
                lease = self._take(job_id)
                if lease is None:
                    continue  # rebuilt by another process while this one waited
                with lease:  # looked at again under the lease: the job may have changed meanwhile
                    why = self._why_rebuild(job_id, suspicion)
                    if why is None:
                        continue
                    self._rebuild(job_id, *why, lease=lease)
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
            if _newer_than_redis(manifest, suspicion):
                why = "Redis went back to an older snapshot (the job is newer than Redis's data)"
                return why, RebuildReason.ROLLED_BACK
            return None
        if held != incarnation:
            # A job of this id being made right now (its manifest follows its hash), or a stale
            # manifest: Redis's newer incarnation is left alone.
            return None
        return self._why_rebuild_held(job_id, suspicion)

    def _why_rebuild_held(self, job_id: str, suspicion: Suspicion) -> tuple[str, RebuildReason] | None:
        """Why a job Redis holds (the manifest's incarnation) is rebuilt, if it is."""
        try:
            progress = self.jobs.progress(job_id)
        except JobNotFoundError:
            return None
        if progress.state.is_final:
            return None
        if suspicion.rolled_back:
            return suspicion.reason, suspicion.label
        if progress.state is JobState.INGESTING and progress.rebuilt:
            # Rebuilt and ingesting its uploads again (here or on another coordinator): it counts
            # its committed prompts done as it goes, so fewer done than committed is no sign of a
            # Redis behind its storage.
            return None
        committed = read_committed(self.storage, job_id)
        if len(committed) > progress.done + progress.in_flight:
            why = f"Redis counts {progress.done} prompts done, storage holds {len(committed)} records"
            return why, RebuildReason.BEHIND
        return None

    def rebuild(self, job_id: str, reason: str, label: RebuildReason) -> tuple[dict[str, Any], bool]:
        """Make the job again from storage (see the module docstring), once: returns its
        ``rebuilt`` note and whether this call joined a rebuild already running (its note, then).
        A manifest that does not validate raises JobStateError before anything of the job changes."""
        _read_manifest(self.storage, job_id)  # 404 or 409 at once, before any wait
        lease = self._take(job_id)
        if lease is None:
            progress = self.jobs.progress(job_id)
            return progress.rebuilt or {}, True
        with lease:
            return self._rebuild(job_id, reason, label, lease=lease), False

    def _take(self, job_id: str) -> HeldLease | None:
        """The job's rebuild lease; None when another rebuild of the job runs (then waited for)
        or has just ended (a done marker), and the job's hash carries its token: the job is rebuilt
        already. A holder that died, lost its lease or whose work Redis no longer holds is not
        waited for twice: the lease is taken over it."""
        key = self.jobs.keys.job_rebuild_lease(job_id)
        deadline = time.monotonic() + REBUILD_WAIT_S
        over_done = False
        while True:
            held = self.leases.try_acquire(key, done_ms=JOIN_WINDOW_MS, over_done=over_done)
            if isinstance(held, HeldLease):
                return held
            done = done_token(held)
            if done is not None:
                if self.jobs.rebuild_token(job_id) == done:
                    return None
                over_done = True  # that rebuild's work is not what Redis holds: take the lease
                continue
            log.info("job %s: another rebuild of it is running; waiting for it", job_id)
            if not self.leases.wait_released(key, held, max(0.0, deadline - time.monotonic())):
                raise JobStateError(
                    f"job {job_id}: another rebuild of it has been running for over {REBUILD_WAIT_S:.0f} s; "
                    f"GET /jobs/{job_id} shows its result once it is done"
                )

    def _rebuild(self, job_id: str, reason: str, label: RebuildReason, *, lease: HeldLease) -> dict[str, Any]:
        stored = _read_manifest(self.storage, job_id)
        incarnation = stored.incarnation
        if self.storage.ending(job_id, ENDING_DELETED, incarnation):
            raise JobNotFoundError(f"job {job_id} was deleted; it is not rebuilt")
        previous = self._previous(job_id)
        self.stop_ingest(job_id)
        lease.check()  # a rebuilder that lost its lease drops nothing
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
            rebuild=lease.fencing,  # refused unless the lease still holds this rebuild's token
        )
        log.warning(
            "job %s rebuilt from storage (%s): %d prompts have committed records%s; %s",
            job_id,
            reason,
            len(committed),
            f", {committed.unreadable_shards} shards unreadable" if committed.unreadable_shards else "",
            "it stays cancelled" if cancelled else f"ingesting its uploads again ({len(inputs)})",
        )
        lease.done()  # the job is made again: whoever comes for the lease now joins this rebuild
        self.on_rebuilt(label)
        if inputs:
            self.start_ingest(job_id, inputs, committed, ingest_fence_value(incarnation, lease.token))
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


def _newer_than_redis(manifest: dict[str, Any], suspicion: Suspicion) -> bool:
    """Whether the job was made when Redis's epoch (the same ``id``) had counted past what Redis
    holds now (the epoch the manifest names: `service.coordinator`); a manifest without it (older
    versions) or of another ``id`` says nothing."""
    made = manifest.get("epoch")
    if not isinstance(made, dict) or suspicion.epoch_id is None or made.get("id") != suspicion.epoch_id:
        return False
    seq = made.get("seq")
    return _is_int(seq) and seq > suspicion.epoch_seq


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _tokenizer_identity(manifest: dict[str, Any], spec: dict[str, Any]) -> str:
    """What the submit wrote into the job (`service.coordinator`): name and file hash."""
    identity = _object(manifest, "tokenizer")
    name, digest = identity.get("tokenizer"), identity.get("tokenizer_sha256")
    if name and digest:
        return f"{name}@sha256:{digest}"
    return str(name or spec.get("tokenizer", ""))
