"""The one wall clock: milliseconds since the epoch, as every ``*_at_ms`` field, report and metric
stores them. Durations are measured with ``time.monotonic`` where they are measured, not here."""

from __future__ import annotations

import time

__all__ = ["now_ms"]


def now_ms() -> int:
    """Now, in whole milliseconds since the epoch (UTC)."""
    return int(time.time() * 1000)
