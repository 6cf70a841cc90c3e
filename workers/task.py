"""The function name every prompt's RQ job carries.

Prompt jobs are executed by the datagen worker's own asyncio loop (``workers.worker``), which
reads the payload and never calls this. A stock ``rq worker`` pointed at our queues would call
it; it fails loudly instead of generating without group commit and retries.
"""

from __future__ import annotations

from typing import Any

__all__ = ["run_prompt"]


def run_prompt(payload: dict[str, Any]) -> None:
    raise RuntimeError(
        "datagen prompt jobs must be run by `datagen worker`, not by a stock `rq worker` "
        f"(job {payload.get('job')!r}, sample {payload.get('sample_id')!r})"
    )
