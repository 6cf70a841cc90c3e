"""`build_report`: what a job produced, and whether its records are token-exact training data.

One streaming pass over the committed records (one batch in memory, fixed-bin histograms) gives:

- counts by finish reason, partition (and partition × finish) and class;
- prompt-length and output-length histograms (outputs split by finish reason);
- for a multi-turn ``all`` job, how its conversations went (`datagen.report.conversations`: turns
  reached, conversations stopped before their last turn, the share of records with regenerated history);
- checks, each ``ok``, ``warn`` or ``fail`` (a failure makes the command exit 1):

  ============================  ======  ================================================================
  check                         level   what it flags
  ============================  ======  ================================================================
  ``generation_prompt``         fail    a prompt that does not end with the template's generation prompt
                                        (a recipe's record: with the template variables it was
                                        rendered with, its ``chat_template_kwargs``)
  ``think_end``                 fail    after a prompt that opens a think block, an output without exactly
                                        one think-end token (a length-truncated one may have none);
                                        otherwise an output holding one
  ``stop_id``                   fail    a ``stop`` finish whose last output id is not a stop id (the EOS
                                        plus ``eos_token_id`` of a generation_config.json next to the
                                        tokenizer)
  ``duplicate_sequences``       fail    identical ``input_ids`` under two different keys (exports keep
                                        both): a conversation repeated in the dataset under another
                                        id, with a fixed sampling seed; examples name both rows
  ``duplicate_keys``            warn    a key committed twice (at-least-once processing; exports keep the
                                        first)
  ``truncated``                 warn    ``length`` finishes
  ``rejected_rows``             warn    dataset rows rejected at ingestion (``jobs/<job>/rejected/``;
                                        a job stored before that layout: ``rejected.jsonl``)
  ``flagged_rows``              warn    rows accepted with a warning (``special_text: warn``: content
                                        that spells special tokens, encoded as their ids;
                                        ``jobs/<job>/flagged/``)
  ``features_missing``          warn    a job with features: records committed without them (too long
                                        for every capture server, or every try failed)
  ============================  ======  ================================================================

A job with features gets a section of its own (`datagen.report.features`): records with features
stored, their bytes and bytes per token, and why the others have none. A job with a recipe gets one
too (`datagen.report.arms`): per arm, its records and share, lengths, finishes and truncation, the
think structure of its outputs, and the template variables and sampling its records carry.

Only the first record per key is counted and checked. The duplicate sets hold a 16-byte digest per
record (keys and sequences: about 180 bytes a record together); everything else is fixed-size. When
sequences repeat, a second pass names the earlier row of each example.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np
import pyarrow as pa

from datagen.export.tokens import JobTokens, load_job_tokens
from datagen.prompts.tokenization import get_renderer
from datagen.records.reader import RowViews, SeenKeys, iter_committed_batches
from datagen.records.schema import GIVEN_FINISH, TEMPLATE_KWARGS
from datagen.records.storage import Storage
from datagen.report.arms import ARM_REPORT_COLUMNS, ArmTally, ThinkShape, column_or_null, think_shape
from datagen.report.conversations import ConversationTally
from datagen.report.features import FEATURE_REPORT_COLUMNS, FeatureTally
from datagen.report.stats import LengthHistogram
from datagen.states import FinishType, MultiTurnMode

__all__ = ["Check", "CheckStatus", "JobReport", "build_report"]

MAX_EXAMPLES = 5
_COLUMNS = ["sample_id", "turn", "gen", "partition", "class", "input_ids", "prompt_len", "finish_type"]
_DIGEST_BYTES = 16
_HYGIENE_CLASSES = ("duplicate", "contaminated")
# Where rows the checks count are stored (datagen.records.storage's layout), as the checks name them.
_REJECTED_AT = "jobs/<job>/rejected/"
_FLAGGED_AT = "jobs/<job>/flagged/"


class CheckStatus(StrEnum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"


@dataclass
class Check:
    name: str
    description: str
    level: CheckStatus  # the status when anything is found
    found: int = 0
    examples: list[str] = field(default_factory=list)

    @property
    def status(self) -> CheckStatus:
        return self.level if self.found else CheckStatus.OK

    def flag(self, example: str) -> None:
        self.found += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(example)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status.value,
            "found": self.found,
            "description": self.description,
            "examples": self.examples,
        }


def _checks(tokens: JobTokens) -> dict[str, Check]:
    stops = ", ".join(str(i) for i in sorted(tokens.stop_ids))
    return {
        check.name: check
        for check in (
            Check(
                "generation_prompt",
                f"every prompt ends with the generation prompt {tokens.generation_prompt}",
                CheckStatus.FAIL,
            ),
            Check(
                "think_end",
                f"outputs after an open think block hold exactly one think-end ({tokens.think_end_id}; "
                "length-truncated: at most one), other outputs none",
                CheckStatus.FAIL,
            ),
            Check("stop_id", f"stop finishes end in a stop id ({stops})", CheckStatus.FAIL),
            Check(
                "duplicate_sequences",
                "no two keys with identical input_ids (a conversation repeated under another id?)",
                CheckStatus.FAIL,
            ),
            Check("duplicate_keys", "no key committed twice (exports keep the first)", CheckStatus.WARN),
            Check("truncated", "records that hit max_new_tokens (finish length)", CheckStatus.WARN),
            Check(
                "rejected_rows",
                f"dataset rows rejected at ingestion (stored under {_REJECTED_AT})",
                CheckStatus.WARN,
            ),
            Check(
                "flagged_rows",
                "rows accepted whose content spells special tokens as text (encoded as their ids; "
                f"stored under {_FLAGGED_AT})",
                CheckStatus.WARN,
            ),
        )
    }


@dataclass
class JobReport:
    job_id: str
    records: int = 0
    unique: int = 0
    by_finish: Counter[str] = field(default_factory=Counter)
    by_partition: Counter[str] = field(default_factory=Counter)
    by_partition_finish: Counter[tuple[str, str]] = field(default_factory=Counter)
    by_class: Counter[str] = field(default_factory=Counter)
    prompt_lengths: LengthHistogram = field(default_factory=LengthHistogram)
    output_lengths: dict[str, LengthHistogram] = field(default_factory=dict)
    rejected_reasons: Counter[str] = field(default_factory=Counter)
    # Rejected rows by class (duplicate, contaminated, other) and by (partition, class).
    rejected_by_class: Counter[str] = field(default_factory=Counter)
    rejected_by_partition: Counter[tuple[str, str]] = field(default_factory=Counter)
    checks: dict[str, Check] = field(default_factory=dict)
    # Multi-turn ``all`` jobs only (None otherwise).
    conversation_tally: ConversationTally | None = None
    # Jobs with features only (None otherwise).
    features: FeatureTally | None = None
    # Jobs with a recipe only (None otherwise).
    arm_tally: ArmTally | None = None

    @property
    def conversations(self) -> ConversationTally | None:
        """How the conversations went, when there is anything to say: a record with turn > 0 or a
        conversation stopped before its last turn."""
        tally = self.conversation_tally
        return tally if tally is not None and tally.present else None

    @property
    def arms(self) -> ArmTally | None:
        """The records by arm, when any record names one (a job with a recipe)."""
        tally = self.arm_tally
        return tally if tally is not None and tally.present else None

    @property
    def failed(self) -> bool:
        return any(check.status is CheckStatus.FAIL for check in self.checks.values())

    def to_json(self) -> dict[str, Any]:
        conversations, arms = self.conversations, self.arms
        return {
            "job_id": self.job_id,
            "records": self.records,
            "unique": self.unique,
            "failed": self.failed,
            "by_finish": dict(self.by_finish),
            "by_partition": {
                p: {"total": n, **{f: c for (q, f), c in self.by_partition_finish.items() if q == p}}
                for p, n in self.by_partition.most_common()
            },
            "by_class": dict(self.by_class),
            "prompt_lengths": self.prompt_lengths.to_json(),
            "output_lengths": {f: h.to_json() for f, h in sorted(self.output_lengths.items())},
            "rejected_reasons": dict(self.rejected_reasons.most_common(MAX_EXAMPLES)),
            "rejected_by_class": dict(self.rejected_by_class),
            "rejected_by_partition": {
                p: {c: n for (q, c), n in self.rejected_by_partition.items() if q == p}
                for p in sorted({q for q, _ in self.rejected_by_partition})
            },
            "checks": [check.to_json() for check in self.checks.values()],
            **({"conversations": conversations.to_json()} if conversations is not None else {}),
            **({"features": self.features.to_json()} if self.features is not None else {}),
            **({"arms": arms.to_json()} if arms is not None else {}),
        }


def _sequence_digest(ids: np.ndarray) -> bytes:
    return hashlib.blake2b(ids.tobytes(), digest_size=_DIGEST_BYTES).digest()


def _name_repeats(storage: Storage, job_id: str, repeats: dict[bytes, str], check: Check) -> None:
    """A second pass, only when sequences repeat: find the first holder of each example's ids."""
    first: dict[bytes, str] = {}
    for batch in iter_committed_batches(
        storage, job_id, ["sample_id", "turn", "gen", "input_ids", "prompt_len"]
    ):
        rows = RowViews(batch)
        for i, row_id in enumerate(rows.ids):
            digest = _sequence_digest(rows.input_ids(i))
            if digest in repeats and digest not in first:
                first[digest] = row_id
        if len(first) == len(repeats):
            break
    check.examples = [f"{later} repeats {first.get(d, '?')}" for d, later in repeats.items()]


class _Scanner:
    """Feeds record batches into a report, checking each first record per key."""

    def __init__(self, report: JobReport, tokens: JobTokens, trust_remote_code: bool) -> None:
        self.report = report
        self.tokens = tokens
        self.trust_remote_code = trust_remote_code
        # By the template variables a record's prompt was rendered with (an arm's differ from the
        # job's: thinking off closes the think block in the generation prompt); None: the job's.
        self.generation_prompts: dict[str | None, np.ndarray] = {
            None: np.array(tokens.generation_prompt, dtype=np.int64)
        }
        self.keys = SeenKeys()
        self.sequences: set[bytes] = set()
        # Digests of the first repeated sequences found → the later row's id, to name the earlier one.
        self.repeats: dict[bytes, str] = {}

    def _is_new(self, sample_id: str, turn: int, gen: int, row_id: str) -> bool:
        if self.keys.first(sample_id, turn, gen):
            return True
        self.report.checks["duplicate_keys"].flag(row_id)
        return False

    def _generation_prompt(self, template_kwargs: str | None) -> np.ndarray:
        """The generation prompt of prompts rendered with ``template_kwargs`` (canonical JSON)."""
        ids = self.generation_prompts.get(template_kwargs)
        if ids is None and template_kwargs is not None:
            renderer = self.tokens.renderer
            rendered = get_renderer(
                renderer.tokenizer_name, renderer.chat_template_path, self.trust_remote_code, template_kwargs
            )
            ids = self.generation_prompts[template_kwargs] = np.array(
                rendered.generation_prompt_ids(), dtype=np.int64
            )
        return self.generation_prompts[None] if ids is None else ids

    def _check_tokens(self, rows: RowViews, i: int, finish: str, template_kwargs: str | None) -> ThinkShape:
        checks, tokens = self.report.checks, self.tokens
        prompt, output, row_id = rows.prompt(i), rows.output(i), rows.ids[i]
        generation_prompt = self._generation_prompt(template_kwargs)
        size = generation_prompt.size
        if prompt.size < size or not np.array_equal(prompt[prompt.size - size :], generation_prompt):
            checks["generation_prompt"].flag(row_id)
        think_ends = (
            0 if tokens.think_end_id is None else int(np.count_nonzero(output == tokens.think_end_id))
        )
        # Reasoning closes its think block once; a length-truncated output may stop before it does.
        expected = {0, 1} if finish == FinishType.LENGTH else {1}
        opens_think = tokens.opens_think(prompt)
        allowed = expected if opens_think else {0}
        if think_ends not in allowed:
            checks["think_end"].flag(f"{row_id} ({think_ends} think-end tokens, finish {finish})")
        if finish == FinishType.STOP and (not output.size or int(output[-1]) not in tokens.stop_ids):
            last = int(output[-1]) if output.size else None
            checks["stop_id"].flag(f"{row_id} (last output id {last})")
        if finish == FinishType.LENGTH:
            checks["truncated"].flag(row_id)
        digest = _sequence_digest(rows.input_ids(i))
        if digest in self.sequences:
            check = checks["duplicate_sequences"]
            if len(self.repeats) < MAX_EXAMPLES:
                self.repeats.setdefault(digest, row_id)
            check.found += 1
        self.sequences.add(digest)
        return think_shape(opens_think, think_ends)

    def add(self, batch: pa.RecordBatch) -> None:
        report = self.report
        rows = RowViews(batch)
        columns = {c: batch.column(c).to_pylist() for c in ("sample_id", "turn", "gen", "partition", "class")}
        finishes = batch.column("finish_type").to_pylist()
        # Only a job with a recipe reads the column (its records' template variables differ by arm).
        kwargs = column_or_null(batch, TEMPLATE_KWARGS)
        lengths = np.diff(rows.offsets)
        new = np.zeros(len(rows), dtype=bool)
        shapes: list[ThinkShape | None] = [None] * len(rows)
        for i in range(len(rows)):
            report.records += 1
            if not self._is_new(columns["sample_id"][i], columns["turn"][i], columns["gen"][i], rows.ids[i]):
                continue
            new[i] = True
            report.unique += 1
            partition, finish = columns["partition"][i], finishes[i]
            report.by_finish[finish] += 1
            report.by_partition[partition] += 1
            report.by_partition_finish[(partition, finish)] += 1
            report.by_class[columns["class"][i]] += 1
            if finish != GIVEN_FINISH:  # a capture-only job's rows came as they are
                shapes[i] = self._check_tokens(rows, i, finish, kwargs[i])
        prompt_lens = np.minimum(rows.prompt_lens, lengths)
        report.prompt_lengths.add(prompt_lens[new])
        finish_array = np.array(finishes, dtype=object)
        for finish in set(finishes):
            selected = new & (finish_array == finish)
            histogram = report.output_lengths.setdefault(finish, LengthHistogram())
            histogram.add((lengths - prompt_lens)[selected])
        if report.arm_tally is not None:
            report.arm_tally.add(batch, new, prompt_lens, lengths - prompt_lens, shapes)
        if report.conversation_tally is not None:
            report.conversation_tally.add_rows(columns["sample_id"], columns["turn"], columns["gen"], new)
        if report.features is not None:
            missing_before = report.features.missing
            report.features.add(batch, new, lengths, rows.ids)
            check = report.checks["features_missing"]
            check.found += report.features.missing - missing_before
            check.examples = report.features.examples[:MAX_EXAMPLES]


def _read_rejected(storage: Storage, job_id: str, report: JobReport) -> None:
    check = report.checks["rejected_rows"]
    for row in storage.iter_rejected(job_id):
        reason = str(row.get("reason", ""))
        # Duplicates and contaminated rows (datagen.hygiene.screen) are one class each; other reasons
        # group by their kind: the text before details such as a column number.
        hygiene = row.get("hygiene")
        kind = hygiene if hygiene in _HYGIENE_CLASSES else "other"
        report.rejected_reasons[str(hygiene) if kind != "other" else reason.split(":")[0].split(" (")[0]] += 1
        report.rejected_by_class[kind] += 1
        report.rejected_by_partition[(str(row.get("partition") or "unknown"), kind)] += 1
        check.flag(f"line {row.get('line')}: {reason}")


def _read_flagged(storage: Storage, job_id: str, report: JobReport) -> None:
    check = report.checks["flagged_rows"]
    for row in storage.iter_flagged(job_id):
        tokens = row.get("tokens")
        what = ", ".join(map(str, tokens)) if isinstance(tokens, list) else str(row.get("reason", ""))
        check.flag(f"line {row.get('line')} ({row.get('sample_id')}): {what}")


def build_report(
    storage: Storage,
    job_id: str,
    *,
    tokenizer: str | None = None,
    on_read: Callable[[int], None] | None = None,
) -> JobReport:
    """Scan a job's committed records, rejected and flagged rows; ``tokenizer`` overrides the
    manifest's path."""
    tokens = load_job_tokens(storage, job_id, tokenizer)
    manifest = storage.read_manifest(job_id) or {}
    report = JobReport(job_id=job_id, checks=_checks(tokens))
    spec = manifest.get("spec") or {}
    if spec.get("multi_turn") == MultiTurnMode.ALL:
        report.conversation_tally = ConversationTally(MAX_EXAMPLES)
    columns = list(_COLUMNS)
    features = spec.get("features")
    if isinstance(features, dict):
        report.features = FeatureTally(
            list(features.get("layers") or []), str(features.get("dtype")), MAX_EXAMPLES
        )
        report.checks["features_missing"] = Check(
            "features_missing",
            "records committed without features (GET /jobs/{id}/errors?kind=capture says why)",
            CheckStatus.WARN,
        )
        columns += FEATURE_REPORT_COLUMNS
    recipe = spec.get("recipe")
    if isinstance(recipe, dict):
        report.arm_tally = ArmTally([str(arm.get("name")) for arm in recipe.get("arms") or []])
        report.checks[
            "generation_prompt"
        ].description += " (a recipe's record: its arm's template variables')"
        columns += ARM_REPORT_COLUMNS
    scanner = _Scanner(report, tokens, bool(spec.get("trust_remote_code", False)))
    for batch in iter_committed_batches(storage, job_id, columns):
        scanner.add(batch)
        if on_read is not None:
            on_read(report.records)
    if scanner.repeats:
        _name_repeats(storage, job_id, scanner.repeats, report.checks["duplicate_sequences"])
    _read_rejected(storage, job_id, report)
    _read_flagged(storage, job_id, report)
    if report.conversation_tally is not None:
        report.conversation_tally.add_stopped(storage.iter_stopped(job_id))
    return report
