"""What storage says a job has done: the prompts of its current incarnation with a committed
record, read when the job is rebuilt (`service.rebuild`), so that its ingestion counts them done
instead of enqueuing them again (`service.ingest`); and, in multi-turn ``all`` mode, what each
committed turn's record says follows it (``next_turn``, `datagen.control.turns`), so that the
ingestion enqueues the next turn of every conversation whose last committed turn is not its last,
as the worker that committed it would have."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from datagen.control.keys import prompt_key
from datagen.control.payload import PromptPayload
from datagen.control.turns import NoteOfTurn, next_turn, read_note
from datagen.errors import CorruptShardError, DatagenError
from datagen.prompts.tokenization import renderer_for
from datagen.records.schema import NEXT_TURN, has_next_turn
from datagen.records.storage import Storage
from datagen.spec import JobSpec
from datagen.states import StopReason

__all__ = ["Committed", "Settled", "read_committed", "settle_committed"]

log = logging.getLogger(__name__)

# ``next_turn`` is left out of a version-1 shard's table (pyarrow reads the names a file has).
KEY_COLUMNS = ["sample_id", "turn", "gen", "output_len", NEXT_TURN]

Conversation = tuple[str, int]  # (sample id, gen)


@dataclass
class Committed:
    """Prompt key (`datagen.control.keys.prompt_key`) -> output tokens of its first committed record; the
    conversations (sample id, gen) whose stop is stored; and, for multi-turn ``all``, what each
    conversation's records say follows their turns (`datagen.control.turns`)."""

    output_tokens: dict[str, int] = field(default_factory=dict)
    stopped: set[Conversation] = field(default_factory=set)
    unreadable_shards: int = 0
    # Per conversation still going on in the records read: turn -> its record's ``next_turn``. A
    # conversation whose record says it ends (its last turn, or a stop) keeps only that stop, so a
    # finished conversation's history is not held.
    notes: dict[Conversation, dict[int, NoteOfTurn]] = field(default_factory=dict)

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

    def note(self, sample_id: str, gen: int, turn: int) -> NoteOfTurn | None:
        """What the record of ``turn`` says follows it; None when unknown (a version-1 record)."""
        return self.notes.get((sample_id, gen), {}).get(turn)

    def keep_note(self, sample_id: str, turn: int, gen: int, raw: str | None) -> None:
        """The ``next_turn`` of a version-2 record, the first of its key."""
        conversation = (sample_id, gen)
        if raw is None:  # the conversation's last turn (or not a conversation): nothing follows
            self.notes.pop(conversation, None)
            return
        try:
            note = read_note(raw)
        except ValueError as exc:
            log.warning(
                "conversation %s: the record of turn %d says nothing usable: %s", sample_id, turn, exc
            )
            return
        if note.stop_reason is not None:
            self.notes[conversation] = {turn: note}
        else:
            self.notes.setdefault(conversation, {})[turn] = note

    def add(self, table: pa.Table) -> None:
        """The records of one shard (its key columns and ``next_turn``, `KEY_COLUMNS`)."""
        samples = table.column("sample_id").to_pylist()
        turns = pc.cast(table.column("turn"), "int64").to_pylist()
        gens = pc.cast(table.column("gen"), "int64").to_pylist()
        outputs = table.column("output_len").to_pylist()
        notes = table.column(NEXT_TURN).to_pylist() if has_next_turn(table.schema) else None
        for i, (sample_id, turn, gen, out) in enumerate(zip(samples, turns, gens, outputs, strict=True)):
            member = prompt_key(sample_id, turn, gen)
            if member in self.output_tokens:
                continue  # the first record of a key counts, as in exports
            self.output_tokens[member] = int(out)
            if notes is not None:
                self.keep_note(sample_id, turn, gen, notes[i])


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
        committed.add(table)
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
    # Multi-turn ``all``: the next turn of each conversation whose last committed turn is not its
    # last, built from the records as the worker would have (enqueued with the ``enqueued`` guard).
    continued: list[PromptPayload] = field(default_factory=list)

    @property
    def done(self) -> int:
        return sum(n for _, n in self.turns)

    @property
    def later_turns(self) -> int:
        """Turns counted beyond the first of each conversation (accepted, as workers add them):
        the committed ones and the next turns enqueued."""
        return sum(n - 1 for _, n in self.turns) + len(self.continued)


def settle_committed(
    storage: Storage,
    job_id: str,
    fresh: list[PromptPayload],
    committed: Committed | None,
    spec: JobSpec,
) -> Settled:
    """Which of ``fresh`` to enqueue, and which a committed record already settles. A conversation
    (multi-turn ``all``) counts its committed turns; if it has more and no stop is stored, its last
    committed record says what follows: its next turn, built from the records' histories and
    enqueued (``continued``), or the stop the worker decided (stored now if it was not). Only a
    conversation whose records predate ``next_turn`` (version 1) stops with the reason ``lost``."""
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
                following = _following(storage, job_id, payload, turns, committed, spec)
                if following is not None:
                    settled.continued.append(following)
        settled.turns.append((payload, turns))
        settled.output_tokens += sum(
            committed.output_tokens[prompt_key(payload.sample_id, payload.turn + t, payload.gen)]
            for t in range(turns)
        )
    return settled


def _following(
    storage: Storage,
    job_id: str,
    payload: PromptPayload,
    turns: int,
    committed: Committed,
    spec: JobSpec,
) -> PromptPayload | None:
    """The next turn of a conversation whose ``turns`` turns from ``payload``'s are committed and
    whose stop is not stored; None when it stops (its stop is stored here)."""
    conversation = payload.conversation
    assert conversation is not None
    last = payload.turn + turns - 1
    total = len(conversation.cuts)
    note = committed.note(payload.sample_id, payload.gen, last)
    if note is not None and note.stop_reason is not None:
        # The worker decided the stop with the turn's commit, but its note under stopped/ is missing.
        _stop(storage, job_id, payload, last + 1, total, note.stop_reason, note.stop_message)
        return None
    generated = list(conversation.generated)
    for turn in range(payload.turn, last + 1):
        earlier = committed.note(payload.sample_id, payload.gen, turn)
        if earlier is None or earlier.history is None:
            _stop(storage, job_id, payload, last + 1, total, StopReason.LOST, _lost(last + 1))
            return None
        generated.append(earlier.history)
    previous = dataclasses.replace(
        payload, turn=last, conversation=dataclasses.replace(conversation, generated=generated[:-1])
    )
    try:
        return next_turn(previous, spec, renderer_for(spec, spec.arm_named(payload.arm)), generated[-1])
    except DatagenError as exc:  # the worker rendered it; a template that refuses it now says so
        message = f"turn {last + 1} cannot be rendered again after the rebuild: {exc}"
        _stop(storage, job_id, payload, last + 1, total, StopReason.ERROR, message)
        return None


def _lost(turn: int) -> str:
    return (
        f"turn {turn} was lost with Redis's data before it ran; the job was rebuilt from storage, whose "
        "records of this conversation predate the next-turn history in records (schema version 1). "
        "Submit the row again under a new job id to generate the rest"
    )


def _stop(
    storage: Storage,
    job_id: str,
    payload: PromptPayload,
    turn: int,
    total: int,
    reason: StopReason,
    message: str,
) -> None:
    row = {
        "sample_id": payload.sample_id,
        "gen": payload.gen,
        "turn": turn,
        "turns": total,
        "reason": reason.value,
        "message": message,
        "partition": payload.partition,
        "inc": payload.incarnation,
    }
    storage.write_stopped(job_id, payload.sample_id, payload.gen, row)
