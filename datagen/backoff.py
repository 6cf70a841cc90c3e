"""Exponential backoff: the one rule every wait-and-try-again loop of the project follows (Redis
and storage outages, start-up, the wake-up channel, idle claim polls, failed commits).

The first wait is ``first_s``; each failure doubles the next, up to ``max_s``; a success starts
over. The loops differ in what they wait on (a thread event, the event loop, a deadline), so this
holds only the delays and leaves the sleeping to them.
"""

from __future__ import annotations

__all__ = ["Backoff"]


class Backoff:
    def __init__(self, first_s: float, max_s: float) -> None:
        if not 0 < first_s <= max_s:
            raise ValueError(f"backoff needs 0 < first_s <= max_s, got {first_s} and {max_s}")
        self.first_s = first_s
        self.max_s = max_s
        self._next_s = first_s
        # Waits taken since the last success: 0 while things work.
        self.failures = 0

    def next_s(self) -> float:
        """The wait after one more failure."""
        delay_s = self._next_s
        self._next_s = min(self.max_s, delay_s * 2)
        self.failures += 1
        return delay_s

    def reset(self) -> None:
        """A success: the next failure waits ``first_s`` again."""
        self._next_s = self.first_s
        self.failures = 0
