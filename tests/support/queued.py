"""Prompts' RQ jobs as the backlog script saves them (`datagen.control.dispatch.Dispatch.add`), for
tests of dispatch that need ids in a backlog and no real payload."""

from __future__ import annotations

import json
from collections.abc import Sequence

from datagen.control.rq_format import QueuedJobs


def queued(rq_ids: Sequence[str]) -> QueuedJobs:
    """Queued RQ jobs of ``rq_ids``, with placeholder data (a claim skips an id whose hash is gone)."""
    return QueuedJobs(json.dumps(["status", "queued"]), tuple((rq_id, rq_id, b"x") for rq_id in rq_ids))
