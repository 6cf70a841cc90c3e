"""Statuses and enumerations stored as-is in Redis, Parquet and JSON."""

from __future__ import annotations

import functools
import hashlib
from enum import StrEnum

__all__ = [
    "DedupMode",
    "EngineChoice",
    "ExportFormat",
    "FinishType",
    "JobState",
    "MultiTurnMode",
    "Priority",
    "PromptClass",
    "ServerState",
    "SpecialTextPolicy",
    "StopReason",
    "ToolMismatch",
    "sample_digest",
]


class DedupMode(StrEnum):
    OFF = "off"
    EXACT = "exact"
    NEAR = "near"


class EngineChoice(StrEnum):
    """Which inference engine a worker speaks to a server (``--engine``, ``vllm+http://`` URLs)."""

    AUTO = "auto"  # asked of the server itself when it comes up
    SGLANG = "sglang"
    VLLM = "vllm"


class ExportFormat(StrEnum):
    SPECFORGE = "specforge"
    SPECULATORS = "speculators"
    CONVERSATIONS = "conversations"
    PARQUET = "parquet"
    # A job with features: speculators' offline training layout (a dataset and its hidden states).
    SPECULATORS_OFFLINE = "speculators-offline"

    @property
    def drops_truncated_by_default(self) -> bool:
        return self is ExportFormat.CONVERSATIONS


class JobState(StrEnum):
    INGESTING = "ingesting"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_final(self) -> bool:
        return self in (JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED)


class PromptClass(StrEnum):
    SHORT = "short"
    LONG = "long"


class FinishType(StrEnum):
    """SGLang's ``meta_info.finish_reason.type`` values."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class ServerRole(StrEnum):
    """What a worker sends a server: prompts to generate from, or finished records whose hidden
    states it captures (vLLM ``extract_hidden_states``, jobs with ``features``)."""

    GENERATE = "generate"
    CAPTURE = "capture"


class ServerState(StrEnum):
    """A server's state: as one worker publishes it (``up``, ``down``, ``refused``, ``draining``),
    and as the coordinator shows it over the live workers' views and its own pause set (``paused``;
    ``unknown`` when no live worker lists it)."""

    UP = "up"
    DOWN = "down"
    PAUSED = "paused"
    # A worker keeps off the server after a failed pre-flight check; its view says why.
    REFUSED = "refused"
    # The worker is shutting down and takes no new prompts.
    DRAINING = "draining"
    UNKNOWN = "unknown"


class MultiTurnMode(StrEnum):
    LAST = "last"
    ALL = "all"


class ToolMismatch(StrEnum):
    """Multi-turn ``all`` with a tool-call parser: what a turn whose tool calls differ from the
    dataset's does to its conversation."""

    STOP = "stop"  # end the conversation at that turn (recorded as stopped, not failed)
    KEEP = "keep"  # go on with the model's calls and the dataset's tool results


class StopReason(StrEnum):
    """Why a multi-turn ``all`` conversation ended before its last turn (not a failure: every turn
    before it is recorded and done)."""

    TRUNCATED = "truncated"  # the turn before was cut at max_new_tokens
    TOOL_MISMATCH = "tool_mismatch"  # the model's tool calls differ from the dataset's
    ERROR = "error"  # the next turn could not be built (template refused the history, parser failed)
    # Redis lost the conversation's next turn before it ran, and its job was rebuilt from storage,
    # whose records of it predate ``next_turn`` (schema version 1): the history a worker built the
    # next turn from is not stored. Records since carry it, and a rebuild enqueues the next turn.
    LOST = "lost"


class RebuildReason(StrEnum):
    """Why a job was rebuilt from storage (`service.rebuild`); a metric label."""

    LOST = "lost"  # Redis lost its data (its epoch is gone)
    ROLLED_BACK = "rolled_back"  # Redis went back to an older snapshot
    BEHIND = "behind"  # at coordinator start, Redis counted fewer done prompts than storage holds
    RECOVER = "recover"  # an operator asked (`datagen recover`)


class Priority(StrEnum):
    """A job's dispatch priority: work of a higher level always goes first."""

    HIGH = "high"
    NORMAL = "normal"
    LOW = "low"

    @property
    def rank(self) -> int:
        return {Priority.HIGH: 0, Priority.NORMAL: 1, Priority.LOW: 2}[self]


class SpecialTextPolicy(StrEnum):
    """What ingestion does with a row whose content spells a special token's text (``<｜Assistant｜>``):
    the tokenizer would encode it as the real special id, so the row could forge turn boundaries."""

    ALLOW = "allow"
    WARN = "warn"
    REJECT = "reject"


# Ingestion digests each prompt's id three times (its row's id, its guard member, its RQ id) within
# a chunk; kept for about a chunk's prompts.
@functools.lru_cache(maxsize=4096)
def sample_digest(sample_id: str) -> str:
    """A sample id as 16 hex characters: safe in RQ ids, Redis members and stored names, whatever
    the id holds."""
    return hashlib.sha1(sample_id.encode("utf-8")).hexdigest()[:16]
