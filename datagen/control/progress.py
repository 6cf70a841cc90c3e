"""A job's progress as read from its hash: what `GET /jobs/{id}`, the CLI and the metrics show."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from datagen.clock import now_ms
from datagen.control.keys import BreakdownField
from datagen.states import JobState

__all__ = ["INT_FIELDS", "JobProgress", "arm_counts", "progress_from_hash"]

# The job hash's count of stored features not yet consumed (`datagen.control.jobs.JobStore`).
RETAINED_FEATURES = "features_retained_bytes"
INT_FIELDS = (
    "rows",
    "accepted",
    "rejected",
    "skipped",
    "flagged",
    "done",
    "failed",
    "cancelled",
    "retried",
    "prompt_tokens",
    "output_tokens",
    "created_at_ms",
    "finished_at_ms",
    "ingest_line",
    "first_record_at_ms",
    "tail_from_ms",
)


@dataclass(frozen=True)
class JobProgress:
    job_id: str
    state: JobState
    rows: int
    accepted: int
    rejected: int
    skipped: int
    done: int
    failed: int
    in_flight: int
    prompt_tokens: int
    output_tokens: int
    created_at_ms: int
    finished_at_ms: int
    error: str | None
    storage_error: str | None = None
    cancelled: int = 0
    retried: int = 0
    paused: bool = False
    flagged: int = 0
    priority: str = "normal"
    weight: float = 1.0
    # Set once by the count scripts (`count_and_complete` in datagen/control/lua/lib.lua); 0 until then.
    first_record_at_ms: int = 0
    tail_from_ms: int = 0
    # Set when the job was rebuilt from storage after Redis lost or rolled back its data
    # (`service.rebuild`): when, why, and what it cost.
    rebuilt: dict[str, Any] | None = None
    # The class whose backlog ingestion waits to have room in (`service.ingest`); None when it does not.
    waiting_for_room: str | None = None
    # A completed job that a resubmission reopened and that has run nothing new since: when it
    # completed (`JobStore.restart_ingest`); its rates and tail stay those of then. 0 otherwise.
    completed_before_ms: int = 0
    # A job with features and a budget: bytes of features stored and not yet consumed by a pull.
    features_retained_bytes: int | None = None
    # A job with a recipe: its arms' names, in the recipe's order (empty without one).
    recipe_arms: tuple[str, ...] = ()
    # A job with a recipe read with its breakdown (`JobStore.progress_many(with_arms=True)`): each
    # arm's counts (`arm_counts`); None otherwise.
    arms: dict[str, dict[str, int]] | None = None

    @property
    def queued(self) -> int:
        return max(0, self.accepted - self.done - self.failed - self.cancelled - self.in_flight)

    def end_ms(self, at_ms: int | None = None) -> int:
        """Where the job's rates and tail are measured to: its completion, else ``at_ms`` or now."""
        return self.finished_at_ms or self.completed_before_ms or (at_ms if at_ms is not None else now_ms())

    def elapsed_s(self, at_ms: int | None = None) -> float:
        return max(1e-3, (self.end_ms(at_ms) - self.created_at_ms) / 1000)

    def time_to_first_record_s(self) -> float | None:
        """Seconds from the job's creation to its first record; None before it has one."""
        if not self.first_record_at_ms:
            return None
        return max(0.0, (self.first_record_at_ms - self.created_at_ms) / 1000)

    def tail_s(self, at_ms: int | None = None) -> float | None:
        """Seconds the job has spent in its tail, its last 5 % of prompts: from the count that
        reached 95 % to the job's end (or ``at_ms``/now while it runs); None before the tail starts."""
        if not self.tail_from_ms:
            return None
        return max(0.0, (self.end_ms(at_ms) - self.tail_from_ms) / 1000)

    def to_json(self, at_ms: int | None = None) -> dict[str, Any]:
        elapsed_s = self.elapsed_s(at_ms)
        finished = self.done + self.failed + self.cancelled
        remaining = max(0, self.accepted - finished)
        rate = finished / elapsed_s
        eta_s = None if self.state.is_final else (remaining / rate if rate > 0 else None)
        first_s, tail_s = self.time_to_first_record_s(), self.tail_s(at_ms)
        return {
            "id": self.job_id,
            "state": self.state.value,
            "rows": self.rows,
            "total": self.accepted,
            "rejected": self.rejected,
            "skipped": self.skipped,
            "flagged": self.flagged,
            "queued": self.queued if not self.state.is_final else 0,
            # A cancelled job's prompts may still be finishing (or being aborted).
            "in_flight": self.in_flight,
            "done": self.done,
            "failed": self.failed,
            "cancelled": self.cancelled,
            "retried": self.retried,
            "paused": self.paused,
            "priority": self.priority,
            "weight": self.weight,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.output_tokens,
            "tokens_per_s": round(self.output_tokens / elapsed_s, 2),
            "elapsed_s": round(elapsed_s, 3),
            "eta_s": None if eta_s is None else round(eta_s, 1),
            "created_at_ms": self.created_at_ms,
            "rebuilt": self.rebuilt,
            "finished_at_ms": self.finished_at_ms or None,
            "time_to_first_record_s": None if first_s is None else round(first_s, 3),
            "tail_s": None if tail_s is None else round(tail_s, 3),
            "error": self.error,
            "storage_error": self.storage_error,
            # Only an ingesting job waits (a coordinator stopped mid-wait may leave the field behind).
            "waiting_for_room": self.waiting_for_room if self.state is JobState.INGESTING else None,
            # Against the spec's features.retain_bytes (None: nothing counted, no budget kept).
            "features_retained_bytes": self.features_retained_bytes,
            # A job with a recipe: {arm: {done, generated_tokens}}; null without one.
            "arms": self.arms,
        }


def progress_from_hash(job_id: str, raw: dict[bytes, bytes], running: int, paused: bool) -> JobProgress:
    """A job's progress from its hash as `datagen.control.jobs.JobStore` read it."""
    fields = {k.decode(): v.decode() for k, v in raw.items()}
    ints = {name: int(fields.get(name, 0) or 0) for name in INT_FIELDS}
    return JobProgress(
        job_id=job_id,
        state=JobState(fields["state"]),
        rows=ints["rows"],
        accepted=ints["accepted"],
        rejected=ints["rejected"],
        skipped=ints["skipped"],
        done=ints["done"],
        failed=ints["failed"],
        in_flight=running,
        prompt_tokens=ints["prompt_tokens"],
        output_tokens=ints["output_tokens"],
        created_at_ms=ints["created_at_ms"],
        finished_at_ms=ints["finished_at_ms"],
        error=fields.get("error"),
        storage_error=fields.get("storage_error"),
        cancelled=ints["cancelled"],
        retried=ints["retried"],
        paused=paused,
        flagged=ints["flagged"],
        priority=fields.get("priority", "normal"),
        weight=float(fields.get("weight", 1.0)),
        first_record_at_ms=ints["first_record_at_ms"],
        tail_from_ms=ints["tail_from_ms"],
        rebuilt=json.loads(fields["rebuilt"]) if fields.get("rebuilt") else None,
        waiting_for_room=fields.get("waiting_for_room") or None,
        completed_before_ms=_completed_before_ms(fields.get("completed_before"), ints),
        features_retained_bytes=int(retained) if (retained := fields.get(RETAINED_FEATURES)) else None,
        recipe_arms=_recipe_arms(fields.get("spec")),
    )


def _recipe_arms(raw_spec: str | None) -> tuple[str, ...]:
    """The arm names of the stored spec's recipe. A spec without a recipe is stored without the key
    (`JobSpec`'s serializer), so most jobs are told apart without parsing their spec."""
    if not raw_spec or '"recipe"' not in raw_spec:
        return ()
    recipe = json.loads(raw_spec).get("recipe") or {}
    return tuple(str(arm["name"]) for arm in recipe.get("arms", ()))


# The per-arm counters `tally` in datagen/control/lua/lib.lua writes, as `arm_counts` names them.
ARM_COUNTERS = {"done": "done", "output_tokens": "generated_tokens"}


def arm_counts(arms: Sequence[str], breakdown: Mapping[BreakdownField, int]) -> dict[str, dict[str, int]]:
    """Each recipe arm's prompts done and their generated tokens, summed over the breakdown's
    partitions and classes: every arm of ``arms`` (0 before its first record), and any other arm
    the breakdown counts."""
    counts = {arm: dict.fromkeys(ARM_COUNTERS.values(), 0) for arm in arms}
    for field, n in breakdown.items():
        arm, name = field.arm, ARM_COUNTERS.get(field.base)
        if arm is None or name is None:
            continue
        per_arm = counts.setdefault(arm, dict.fromkeys(ARM_COUNTERS.values(), 0))
        per_arm[name] += n
    return counts


def _completed_before_ms(raw: str | None, ints: dict[str, int]) -> int:
    """The completion time in ``completed_before`` (``<finished_at_ms> <accepted> <output_tokens>``,
    `JobStore.restart_ingest`) while the job's accepted prompts and output tokens are still those of
    then; else 0 (as `count_and_complete` in lua/lib.lua decides at the job's next completion)."""
    parts = (raw or "").split()
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        return 0
    at_ms, accepted, tokens = (int(p) for p in parts)
    return at_ms if (accepted, tokens) == (ints["accepted"], ints["output_tokens"]) else 0
