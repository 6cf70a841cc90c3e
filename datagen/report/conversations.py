"""How the conversations of a multi-turn ``all`` job went: the report's ``conversations`` section.

In ``all`` mode a dataset conversation is regenerated turn by turn, one record per turn (``turn`` 0, 1, …
under one ``sample_id`` and ``gen``), and the history of every turn from 1 on holds the model's own text
of the earlier turns. A conversation that stopped before its last turn has one row in storage
(`Storage.iter_stopped`) saying why: ``truncated``, ``tool_mismatch`` or ``error``.

`ConversationTally` is fed the scan's first record per key and holds one 16-byte digest and a turn
per conversation (about 100 bytes each with the dict's overhead); the report shows it only when a record
has turn > 0 or a conversation stopped (`ConversationTally.present`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from datagen.records.reader import key_digest

__all__ = ["ConversationTally"]

SHARE_DIGITS = 4
UNKNOWN_REASON = "unknown"


def _example(row: dict[str, Any]) -> str:
    gen = row.get("gen")
    where = f"{row.get('sample_id', '?')}" + (f" gen {gen}" if gen else "")
    turns = row.get("turns")
    where += f" before turn {row.get('turn', '?')}" + (f" of {turns}" if turns is not None else "")
    message = str(row.get("message") or "")
    return f"{where}: {message}" if message else where


@dataclass
class ConversationTally:
    max_examples: int
    records: int = 0  # unique records
    regenerated: int = 0  # of which turn > 0: their history holds regenerated text
    stopped: Counter[str] = field(default_factory=Counter)
    stopped_examples: dict[str, list[str]] = field(default_factory=dict)
    # A conversation, (sample_id, gen) as the key of its turn 0 → the highest turn recorded.
    _last_turn: dict[bytes, int] = field(default_factory=dict, init=False, repr=False)

    def add_rows(
        self, sample_ids: Sequence[str], turns: Sequence[int], gens: Sequence[int], new: np.ndarray
    ) -> None:
        """One batch's columns; ``new`` marks the first record of each key."""
        last_turn = self._last_turn
        for i in np.flatnonzero(new).tolist():
            turn = turns[i]
            conversation = key_digest(sample_ids[i], 0, gens[i])
            if turn > last_turn.get(conversation, -1):
                last_turn[conversation] = turn
            self.records += 1
            if turn > 0:
                self.regenerated += 1

    def add_stopped(self, rows: Iterable[dict[str, Any]]) -> None:
        """Stopped rows (`Storage.iter_stopped`: the job's current incarnation only)."""
        for row in rows:
            reason = str(row.get("reason") or UNKNOWN_REASON)
            self.stopped[reason] += 1
            examples = self.stopped_examples.setdefault(reason, [])
            if len(examples) < self.max_examples:
                examples.append(_example(row))

    @property
    def present(self) -> bool:
        return bool(self.regenerated or self.stopped)

    @property
    def conversations(self) -> int:
        return len(self._last_turn)

    @property
    def turns_reached(self) -> Counter[int]:
        """Turns recorded (the highest turn + 1) → conversations."""
        return Counter(turn + 1 for turn in self._last_turn.values())

    @property
    def regenerated_share(self) -> float:
        return round(self.regenerated / self.records, SHARE_DIGITS) if self.records else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "conversations": self.conversations,
            "turns_reached": {str(n): c for n, c in sorted(self.turns_reached.items())},
            "stopped": {
                "total": self.stopped.total(),
                "by_reason": dict(self.stopped.most_common()),
                "examples": {r: self.stopped_examples[r] for r, _ in self.stopped.most_common()},
            },
            "regenerated_history_share": self.regenerated_share,
            "regenerated_history_records": self.regenerated,
            "records": self.records,
        }
