"""The failure report of a prompt that failed for good, as `JobStore.count_failed` stores it and
``GET /jobs/{id}/errors?kind=failed`` shows it; written by the worker and by the reaper."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from datagen.control.jobs import now_ms

__all__ = ["UNKNOWN_LABEL", "failure_report", "prompt_labels"]

# The breakdown label of a prompt whose payload does not say (an RQ job that is not a datagen prompt).
UNKNOWN_LABEL = "unknown"


def failure_report(rq_id: str, payload: Mapping[str, Any], *, reason: str, message: str) -> dict[str, object]:
    """``{rq_id, reason, message, at_ms, sample_id, turn}``; ``payload`` is the prompt's RQ payload
    (`workers.claim.rqbridge.payload_of`), empty when unknown."""
    return {
        "rq_id": rq_id,
        "reason": reason,
        "message": message,
        "at_ms": now_ms(),
        "sample_id": payload.get("sample_id"),
        "turn": payload.get("turn"),
    }


def prompt_labels(payload: Mapping[str, Any]) -> dict[str, str]:
    """The keyword arguments ``partition``, ``cls`` and ``incarnation`` of `JobStore.count_failed`
    (and ``count_cancelled``) for a prompt's RQ payload: a prompt of an earlier job of the same id
    is then not counted in the new one."""
    return {
        "partition": str(payload.get("partition", UNKNOWN_LABEL)),
        "cls": str(payload.get("cls", UNKNOWN_LABEL)),
        "incarnation": str(payload.get("inc", "")),
    }
