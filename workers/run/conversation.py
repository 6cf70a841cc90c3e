"""Multi-turn ``all`` mode, once a turn is generated and before its record is committed: build the
conversation's next turn, or say why the conversation stops there. The answer goes into the record
(``next_turn``, `note_of`), so storage holds the next turn's history with the turn's commit.

This step never fails a prompt: whatever it meets, the turn's record is committed and counted
done. It ends in one of three ways:

- the next turn's payload (enqueued with the turn's done count, `workers.run.finish`);
- None: the conversation has no more turns;
- a `ConversationStop` (`datagen.states.StopReason`): the turn was cut at ``max_new_tokens``
  (``truncated``), the model's tool calls differ from the dataset's and the job's ``tool_mismatch``
  is ``stop`` (``tool_mismatch``), or building the next turn kept failing (``error``). A stop is
  stored under ``jobs/<job>/stopped/`` (``GET /jobs/{id}/errors?kind=stopped``, the report).

Building the next turn is retried with backoff (a server that parses tool calls may be restarting;
a bug may be transient, like a race on first load); a template that refuses the history is not
retried: the same text fails the same way.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from datagen.control.payload import PromptPayload
from datagen.control.turns import history_note, stop_note
from datagen.errors import DatagenError, FatalError, InvalidRowError, JobNotFoundError, ServerError
from datagen.prompts.tokenization import PromptRenderer, renderer_for
from datagen.records.schema import Record
from datagen.records.storage import Storage
from datagen.spec import JobSpec
from datagen.states import FinishType, StopReason, ToolMismatch
from workers.engines.base import ParsedCalls, ToolCallParsing
from workers.fleet.servers import Server
from workers.metrics import WorkerMetrics
from workers.run.jobinfo import JobInfo, JobInfos
from workers.run.redisretry import while_redis_down
from workers.run.turns import assistant_turn, dataset_call_names, history_text, next_turn

__all__ = [
    "NEXT_TURN_ATTEMPTS",
    "ConversationStop",
    "Conversations",
    "NextTurn",
    "note_of",
    "tool_call_parsing",
]

log = logging.getLogger(__name__)

NEXT_TURN_ATTEMPTS = 4
NEXT_TURN_BACKOFF_S = (0.5, 2.0, 8.0)
PARSE_TIMEOUT_S = 30.0
STOP_WRITE_ATTEMPTS = 5


@dataclass(frozen=True)
class ConversationStop:
    """The conversation ends before ``turn`` (the first turn not generated) of its ``turns``."""

    turn: int
    turns: int
    reason: StopReason
    message: str


NextTurn = PromptPayload | ConversationStop | None


def note_of(following: NextTurn) -> str | None:
    """What the turn's record says follows it (``next_turn``, `datagen.control.turns`): the turn as
    the next turn's history holds it, or the conversation's stop; None after its last turn."""
    if isinstance(following, ConversationStop):
        return stop_note(following.reason, following.message)
    if following is None or following.conversation is None or not following.conversation.generated:
        return None
    return history_note(following.conversation.generated[-1])


def _turn_text(spec: JobSpec, info: JobInfo, record: Record) -> tuple[PromptRenderer, str]:
    """The job's renderer and the history text of the record's turn (one thread hop for both)."""
    renderer = renderer_for(spec, spec.arm_named(record.arm))
    # The turn's end: the id it matched, and every id that could have ended it.
    stop_ids = set(info.stop_ids)
    matched = record.finish_matched
    ends = (renderer.special_ids().eos_id, int(matched) if matched and matched.isdigit() else None)
    stop_ids.update(i for i in ends if i is not None)
    return renderer, history_text(renderer, record.input_ids[record.prompt_len :], stop_ids)


class Conversations:
    def __init__(
        self,
        job_infos: JobInfos,
        servers: Sequence[Server],
        storage: Storage,
        metrics: WorkerMetrics,
        *,
        backoff_s: Sequence[float] = NEXT_TURN_BACKOFF_S,
    ) -> None:
        self.backoff_s = backoff_s
        self.job_infos = job_infos
        self.servers = servers
        self.storage = storage
        self.metrics = metrics

    async def after(self, payload: PromptPayload, record: Record) -> NextTurn:
        """What follows the committed ``record`` of ``payload``'s turn. Raises only
        JobNotFoundError (its job was deleted) and CancelledError."""
        conversation = payload.conversation
        if conversation is None:
            return None
        turns, turn = len(conversation.cuts), payload.turn
        if turn + 1 >= turns:
            return None
        if record.finish_type != FinishType.STOP.value:
            # A cut turn has no end of reasoning: a history built from it is a state the model
            # never reaches.
            return ConversationStop(
                turn + 1,
                turns,
                StopReason.TRUNCATED,
                f"turn {turn} was cut at max_new_tokens "
                f"({record.output_len} tokens, finish {record.finish_type})",
            )
        info = await while_redis_down(lambda: self.job_infos.get(payload.job, payload.incarnation))
        last: BaseException | None = None
        for attempt in range(NEXT_TURN_ATTEMPTS):
            if attempt:
                await asyncio.sleep(self.backoff_s[min(attempt, len(self.backoff_s)) - 1])
            try:
                return await self._build(payload, record, info, attempt)
            except InvalidRowError as exc:
                return ConversationStop(
                    turn + 1, turns, StopReason.ERROR, f"turn {turn + 1} cannot be rendered: {exc}"
                )
            except (JobNotFoundError, asyncio.CancelledError):
                raise
            except FatalError as exc:
                return ConversationStop(turn + 1, turns, StopReason.ERROR, f"turn {turn + 1}: {exc}")
            except Exception as exc:  # retried: a restarting server, or a bug that may not repeat
                last = exc
                log.warning(
                    "building turn %d of %s (attempt %d of %d) failed: %s: %s",
                    turn + 1,
                    payload.sample_id,
                    attempt + 1,
                    NEXT_TURN_ATTEMPTS,
                    type(exc).__name__,
                    exc,
                    exc_info=not isinstance(exc, DatagenError),
                )
        return ConversationStop(
            turn + 1,
            turns,
            StopReason.ERROR,
            f"building turn {turn + 1} failed {NEXT_TURN_ATTEMPTS} times: {type(last).__name__}: {last}",
        )

    async def _build(self, payload: PromptPayload, record: Record, info: JobInfo, attempt: int) -> NextTurn:
        conversation = payload.conversation
        if conversation is None:  # `after` asks only of a conversation's turns
            return None
        spec = info.spec
        renderer, text = await asyncio.to_thread(_turn_text, spec, info, record)
        regenerated: str | dict[str, Any] = text
        tools = conversation.tools
        if spec.tool_call_parser is not None and tools:
            parsed = await self._parse(record.server, attempt, text, spec.tool_call_parser, tools)
            wanted = dataset_call_names(conversation, payload.turn)
            made = [call.name for call in parsed.calls]
            if made != wanted and spec.tool_mismatch is ToolMismatch.STOP:
                return ConversationStop(
                    payload.turn + 1,
                    len(conversation.cuts),
                    StopReason.TOOL_MISMATCH,
                    f"turn {payload.turn}: the model called {made or 'no tool'}, "
                    f"the dataset {wanted or 'no tool'}",
                )
            regenerated = assistant_turn(conversation, payload.turn, parsed.normal_text, parsed.calls)
        return await asyncio.to_thread(next_turn, payload, spec, renderer, regenerated)

    async def _parse(
        self, server_name: str, attempt: int, text: str, parser: str, tools: list[dict[str, Any]]
    ) -> ParsedCalls:
        """The servers' own parser: first the generating server's, then the others' in turn on
        retries (one may be restarting)."""
        ordered = sorted(self.servers, key=lambda s: (not s.up, s.name != server_name))
        server = ordered[attempt % len(ordered)]
        engine = tool_call_parsing(server)
        return await engine.parse_function_call(text, parser, tools, timeout_s=PARSE_TIMEOUT_S)

    async def record_stop(self, payload: PromptPayload, stop: ConversationStop) -> None:
        """Store the stop (retried; a storage outage costs the note, never the turn) and count it."""
        self.metrics.conversations_stopped.labels(stop.reason.value).inc()
        row = {
            "sample_id": payload.sample_id,
            "gen": payload.gen,
            "turn": stop.turn,
            "turns": stop.turns,
            "reason": stop.reason.value,
            "message": stop.message,
            "partition": payload.partition,
            "inc": payload.incarnation,
        }
        log.info("conversation %s stopped before turn %d: %s", payload.sample_id, stop.turn, stop.message)
        for attempt in range(STOP_WRITE_ATTEMPTS):
            try:
                await asyncio.to_thread(
                    self.storage.write_stopped, payload.job, payload.sample_id, payload.gen, row
                )
                return
            except DatagenError as exc:
                log.warning(
                    "cannot store the stop of %s (attempt %d): %s", payload.sample_id, attempt + 1, exc
                )
                await asyncio.sleep(self.backoff_s[min(attempt, len(self.backoff_s) - 1)])
        log.error("gave up storing the stop of conversation %s: %s", payload.sample_id, stop.message)


def tool_call_parsing(server: Server) -> ToolCallParsing:
    """The engine that parses ``server``'s tool calls: its own, when its engine can. Otherwise a
    ServerError, retryable, so that the next try goes to another server of the fleet."""
    engine = server.client.current()
    if not isinstance(engine, ToolCallParsing):
        raise ServerError(
            f"server {server.name} runs {engine.engine}, which has no tool-call parser route "
            "(SGLang's /parse_function_call): a job with tool_call_parser needs an SGLang server "
            "in the fleet"
        )
    return engine
