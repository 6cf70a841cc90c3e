"""What storage says a job has done: the prompts of its current incarnation with a committed
record, read when the job is rebuilt (`service.rebuild`), so that its ingestion counts them done
instead of enqueuing them again (`service.ingest`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import pyarrow.compute as pc

from datagen.control.keys import prompt_key
from datagen.control.payload import PromptPayload
from datagen.errors import CorruptShardError
from datagen.records.storage import Storage
from datagen.states import StopReason

__all__ = ["Committed", "Settled", "read_committed", "settle_committed"]

log = logging.getLogger(__name__)

KEY_COLUMNS = ["sample_id", "turn", "gen", "output_len"]


@dataclass
class Committed:
    """Prompt key (`datagen.control.keys.prompt_key`) -> output tokens of its first committed record; and
    the conversations (sample id, gen) whose stop is stored."""

    output_tokens: dict[str, int] = field(default_factory=dict)
    stopped: set[tuple[str, int]] = field(default_factory=set)
    unreadable_shards: int = 0

    def __contains__(self, member: str) -> bool:
        return member in self.output_tokens

    def __len__(self) -> int:
        return len(self.output_tokens)

    def turns(self, sample_id: str, gen: int) -> int:
        """How many turns of a conversation are committed, from its first on without a gap."""
        turn = 0
        while prompt_key(sample_id, turn, gen) in self.output_tokens:
            turn += 1
        return turn


def read_committed(storage: Storage, job_id: str) -> Committed:
    """Every committed prompt of the job's current incarnation (the manifest's). A shard that does
    not hold to its commit object counts as not committed: its prompts run again, and the line
    says which shard (`datagen verify` says more)."""
    committed = Committed()
    for commit in storage.list_commits(job_id):
        try:
            table = storage.read_shard_table(job_id, commit, KEY_COLUMNS)
        except CorruptShardError as exc:
            committed.unreadable_shards += 1
            log.warning("job %s: rebuilding without shard %s: %s", job_id, commit.get("shard"), exc)
            continue
        samples = table.column("sample_id").to_pylist()
        turns = pc.cast(table.column("turn"), "int64").to_pylist()
        gens = pc.cast(table.column("gen"), "int64").to_pylist()
        outputs = table.column("output_len").to_pylist()
        for sample_id, turn, gen, out in zip(samples, turns, gens, outputs, strict=True):
            committed.output_tokens.setdefault(prompt_key(sample_id, turn, gen), int(out))
    committed.stopped = {(str(row["sample_id"]), int(row["gen"])) for row in storage.iter_stopped(job_id)}
    return committed


@dataclass
class Settled:
    """A chunk's new prompts, split by :func:`settle_committed`."""

    enqueue: list[PromptPayload]
    # Prompts already committed, with how many turns of each count (more than one for a
    # conversation of multi-turn ``all`` mode whose later turns were committed too).
    turns: list[tuple[PromptPayload, int]] = field(default_factory=list)
    output_tokens: int = 0

    @property
    def done(self) -> int:
        return sum(n for _, n in self.turns)

    @property
    def later_turns(self) -> int:
        """Turns counted beyond the first of each conversation (accepted, as workers add them)."""
        return sum(n - 1 for _, n in self.turns)


def settle_committed(
    storage: Storage, job_id: str, fresh: list[PromptPayload], committed: Committed | None
) -> Settled:
    """Which of ``fresh`` to enqueue, and which a committed record already settles. A conversation
    (multi-turn ``all``) counts its committed turns; if it has more and no stop is stored, its next
    turn was lost with Redis (the history a worker builds it from is not stored): it stops there,
    said under ``stopped/`` with the reason ``lost``."""
    if not committed:
        return Settled(enqueue=fresh)
    settled = Settled(enqueue=[])
    for payload in fresh:
        if prompt_key(payload.sample_id, payload.turn, payload.gen) not in committed:
            settled.enqueue.append(payload)
            continue
        turns = 1
        conversation = payload.conversation
        if conversation is not None:
            turns = max(1, committed.turns(payload.sample_id, payload.gen) - payload.turn)
            total = len(conversation.cuts)
            if payload.turn + turns < total and (payload.sample_id, payload.gen) not in committed.stopped:
                storage.write_stopped(
                    job_id, payload.sample_id, payload.gen, _lost_row(payload, turns, total)
                )
        settled.turns.append((payload, turns))
        settled.output_tokens += sum(
            committed.output_tokens[prompt_key(payload.sample_id, payload.turn + t, payload.gen)]
            for t in range(turns)
        )
    return settled


def _lost_row(payload: PromptPayload, turns: int, total: int) -> dict[str, object]:
    turn = payload.turn + turns
    return {
        "sample_id": payload.sample_id,
        "gen": payload.gen,
        "turn": turn,
        "turns": total,
        "reason": StopReason.LOST.value,
        "message": (
            f"turn {turn} was lost with Redis's data before it ran; the job was rebuilt from storage, "
            "which holds the committed turns but not the history built from them. Submit the row again "
            "under a new job id to generate the rest"
        ),
        "partition": payload.partition,
        "inc": payload.incarnation,
    }
