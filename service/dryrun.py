"""``POST /jobs/dry-run``: what a dataset would become, without enqueueing anything.

The input is any that ``POST /jobs`` takes (an upload of JSONL, compressed JSONL or Parquet, or a
reference), read as a `datagen.prompts.inputs.RowStream`: only its first ``DRY_RUN_ROWS`` rows are
read, then parsed and admitted by ingestion's own rule (`service.admit`: partitions, special text,
rendering, context length, class), then their ids checked (`service.rowids`). The rest is never read:
the input's row total is what the format knows cheaply (Parquet footers, a saved dataset's info;
all of it when the sample reached the end), and totals are extrapolated from the sample by rows, or
for plain JSONL by bytes; else they are unknown (null).

Contaminated and duplicate rows (``hygiene``: counts and examples, each beside the benchmark prompt
or the row it repeats) are judged as ingestion judges a new job's rows: after every other check.

Rows whose content spells special tokens as text are counted under ``special_text`` whatever the
spec's policy, and are rejected, as ingestion would, when the policy is ``reject``.

In a job with a recipe, each sample is counted under its arm's rendering (`service.admit.admit_row`),
and ``arms`` shows the first admitted row rendered under every arm, beside the arm's share, template
variables and sampling; without a recipe it is empty.
"""

from __future__ import annotations

import contextlib
import gzip
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO, cast

import pyarrow as pa
import zstandard

from datagen.errors import DatagenError, InvalidSpecError, StorageError
from datagen.hygiene.screen import Hygiene, HygieneRow
from datagen.prompts.dataset import Prompt, iter_prompts
from datagen.prompts.inputs import InputFormat, RowStream
from datagen.prompts.recipes import arm_shares
from datagen.prompts.sources import without_password
from datagen.spec import Arm, JobSpec
from service.admit import Admitted, AdmittedRow, ArmRenderers, Refused, admit, admit_row
from service.rowids import RowId, check_row_ids, repeated_lines, row_id

__all__ = ["DRY_RUN_EXAMPLES", "DRY_RUN_ROWS", "DryRunInput", "dry_run", "reading"]

DRY_RUN_ROWS = 1000
DRY_RUN_EXAMPLES = 5
# The upload name the dry run judges its sample under (every row is of this one upload).
DRY_RUN_UPLOAD = "dry-run"


@dataclass(frozen=True)
class DryRunInput:
    """An opened input: its ``rows``, its ``name`` in messages (the upload's file name, or the
    reference's URL without its password: ``url``), and ``count_rows``, which says how many rows it
    holds where the stream does not know (a directory's footers); asked only when the sample did
    not reach the end."""

    rows: RowStream
    name: str
    url: str | None = None
    count_rows: Callable[[], int | None] = lambda: None


def dry_run(
    spec: JobSpec, renderers: ArmRenderers, dataset: DryRunInput, context_len: int | None
) -> dict[str, Any]:
    """The preview of ``dataset``'s first rows; ``renderers``: each arm's renderer
    (`service.admit.arm_renderers`)."""
    hygiene = Hygiene.for_spec(spec)  # a set over the limits is refused before the input is read
    sample = _FirstRows(dataset, DRY_RUN_ROWS)
    rejected: dict[int, dict[str, Any]] = {}  # line → why; one entry per row, as ingestion writes
    accepted: list[tuple[Prompt, AdmittedRow]] = []
    rows: set[int] = set()
    special: dict[int, list[str]] = {}  # line → the special tokens its content spells
    token_rows = spec.features is not None and spec.features.capture_only
    for item in iter_prompts(cast(BinaryIO, sample), multi_turn=spec.multi_turn, token_rows=token_rows):
        rows.add(item.line)
        verdict = admit_row(item, spec, renderers, context_len, scan_special_text=True)
        if verdict is None:
            continue
        if verdict.special_text:  # multi-turn rows give one item per turn
            special.setdefault(item.line, verdict.special_text)
        if isinstance(verdict, Refused):
            rejected.setdefault(item.line, {"line": item.line, "reason": verdict.reason})
            continue
        assert isinstance(item, Prompt)  # a RowError is always refused
        accepted.append((item, verdict))
    accepted, report = _judge(hygiene, accepted, rejected)
    # Every sample as ingestion enqueues it: under its arm, with that arm's tokens and class.
    samples = [admitted for _, row in accepted for _, admitted in row.samples]
    classes = {"short": 0, "long": 0}
    for admitted in samples:
        classes[admitted.cls.value] += 1
    prompt_tokens = sum(len(admitted.prompt_ids) for admitted in samples)
    size = _size(dataset, sample, len(rows))
    return {
        "format": dataset.rows.format.value,
        "rows_sampled": len(rows),
        "rows_total": size.rows_total,
        "bytes_sampled": size.bytes_sampled,
        "bytes_total": size.bytes_total,
        "prompts": len(samples),
        "classes": classes,
        "rejected": [rejected[line] for line in sorted(rejected)],
        "prompt_tokens_sampled": prompt_tokens,
        "estimated_rows": size.scaled(len(rows)) if size.rows_total is None else size.rows_total,
        "estimated_prompts": size.scaled(len(samples)),
        "estimated_prompt_tokens": size.scaled(prompt_tokens),
        "examples": [_example(item, row, renderers) for item, row in accepted[:DRY_RUN_EXAMPLES]],
        "arms": _arms(spec, renderers, accepted[0][0] if accepted else None, context_len),
        "special_text": {
            "policy": spec.special_text.value,
            "rows": len(special),
            "examples": [
                {"line": line, "tokens": tokens} for line, tokens in list(special.items())[:DRY_RUN_EXAMPLES]
            ],
        },
        "hygiene": report,
    }


def _judge(
    hygiene: Hygiene, accepted: list[tuple[Prompt, AdmittedRow]], rejected: dict[int, dict[str, Any]]
) -> tuple[list[tuple[Prompt, AdmittedRow]], dict[str, Any]]:
    """Check ids, then decontaminate and deduplicate the accepted rows as ingestion would (one row
    per line: its last item holds the whole conversation); returns the prompts ingestion would
    enqueue (an exact repeat of an earlier row is skipped) and the dry run's hygiene summary."""
    rows: dict[int, HygieneRow] = {}
    ids: dict[int, RowId] = {}
    for item, _ in accepted:
        rows[item.line] = HygieneRow(item.line, item.messages, item.tools)
        ids.setdefault(item.line, row_id(item))
    _, refused = check_row_ids(ids, {}, upload=DRY_RUN_UPLOAD)
    for line, reason in refused.items():
        rejected.setdefault(line, {"line": line, "reason": reason})
    repeats = frozenset(repeated_lines(ids, {}))  # the same id and content again: skipped
    judging = [row for line, row in rows.items() if line not in refused]
    verdicts = hygiene.judge(judging, DRY_RUN_UPLOAD, repeats=repeats) if hygiene.active else None
    judged = verdicts.rejected if verdicts is not None else {}
    for line, fields in judged.items():
        rejected.setdefault(line, {"line": line, **fields})
    report: dict[str, Any] = {
        "dedup": hygiene.dedup.value,
        "benchmark_prompts": len(hygiene.benchmarks) if hygiene.benchmarks is not None else 0,
        "duplicates": sum(1 for f in judged.values() if f["hygiene"] == "duplicate"),
        "contaminated": sum(1 for f in judged.values() if f["hygiene"] == "contaminated"),
        "examples": [],
    }
    shown = {"duplicate": 0, "contaminated": 0}  # the first few of each kind
    for line, fields in sorted(judged.items()):
        if shown[fields["hygiene"]] >= DRY_RUN_EXAMPLES:
            continue
        shown[fields["hygiene"]] += 1
        example = {"line": line, "text": rows[line].preview(), **fields}
        if fields["hygiene"] == "duplicate":
            example["kept_text"] = rows[fields["duplicate_of"]].preview()
        report["examples"].append(example)
    dropped = refused.keys() | judged.keys() | repeats
    return [a for a in accepted if a[0].line not in dropped], report


def _example(item: Prompt, row: AdmittedRow, renderers: ArmRenderers) -> dict[str, Any]:
    """A row as its first sample (gen 0) is enqueued: under its arm (None without a recipe)."""
    arm, admitted = row.samples[0]
    return {
        "line": item.line,
        "sample_id": item.sample_id,
        "turn": item.turn,
        "arm": None if arm is None else arm.name,
        "class": admitted.cls.value,
        "prompt_tokens": len(admitted.prompt_ids),
        "prompt": renderers(arm).decode(admitted.prompt_ids, skip_special_tokens=False),
    }


def _arms(
    spec: JobSpec, renderers: ArmRenderers, item: Prompt | None, context_len: int | None
) -> list[dict[str, Any]]:
    """Every arm of the recipe with ``item`` (the first admitted row; None: no row was) rendered under
    it, whichever arms the row's own samples draw: what each mode makes of the same prompt."""
    if spec.recipe is None:
        return []
    shares = arm_shares(spec.recipe)
    return [
        {
            "name": arm.name,
            "share": shares[arm.name],
            "chat_template_kwargs": spec.template_kwargs(arm),
            # The arm's sampling over the job's (a temperatures list still varies the temperature
            # by gen where the arm sets none).
            "sampling": spec.arm_sampling(arm).model_dump(mode="json"),
            **_arm_rendering(spec, renderers, arm, item, context_len),
        }
        for arm in spec.recipe.arms
    ]


def _arm_rendering(
    spec: JobSpec, renderers: ArmRenderers, arm: Arm, item: Prompt | None, context_len: int | None
) -> dict[str, Any]:
    shown: dict[str, Any] = {
        "line": None,
        "class": None,
        "prompt_tokens": None,
        "prompt": None,
        "refused": None,
    }
    if item is None:
        return shown
    shown["line"] = item.line
    renderer = renderers(arm)
    # The row was admitted, so its special text was judged already.
    verdict = admit(item, spec, renderer, context_len, scan=False)
    if isinstance(verdict, Admitted):
        shown["class"] = verdict.cls.value
        shown["prompt_tokens"] = len(verdict.prompt_ids)
        shown["prompt"] = renderer.decode(verdict.prompt_ids, skip_special_tokens=False)
    elif isinstance(verdict, Refused):  # an arm the row's samples do not use may refuse it
        shown["refused"] = verdict.reason
    return shown


class _FirstRows:
    """The first ``rows`` lines of an input, read by ``readline`` as `iter_prompts` reads (a line
    over its cap is read in pieces and counts once); what the sample held, in lines and bytes."""

    def __init__(self, dataset: DryRunInput, rows: int) -> None:
        self._dataset = dataset
        self._rows = rows
        self.lines = 0
        self.bytes = 0
        self.ended = False  # the input has no more rows

    def readline(self, size: int = -1) -> bytes:
        if self.lines >= self._rows:
            return b""
        piece = self._read(size)
        self.bytes += len(piece)
        if piece.endswith(b"\n"):
            self.lines += 1
        elif not piece or size < 0 or len(piece) < size:  # the last line, without its newline
            self.lines += bool(piece)
            self.ended = True
        return piece

    def at_end(self) -> bool:
        """Whether the sample is the whole input: one more byte is read to tell, no more."""
        if not self.ended and self.lines >= self._rows:
            self.ended = not self._read(1)
        return self.ended

    def _read(self, size: int) -> bytes:
        dataset = self._dataset
        with reading(dataset.name, dataset.rows.format, dataset.url):
            return dataset.rows.readline(size)


@dataclass(frozen=True)
class _Size:
    """What is known of the whole input, and the factor from the sample to it (None: unknown)."""

    rows_total: int | None
    scale: float | None
    bytes_sampled: int | None
    bytes_total: int | None

    def scaled(self, sampled: int) -> int | None:
        return None if self.scale is None else round(sampled * self.scale)


def _size(dataset: DryRunInput, sample: _FirstRows, rows_sampled: int) -> _Size:
    """All of it when the sample reached the end; else the input's rows where the format knows them
    cheaply (`RowStream.progress`, or ``count_rows``), plain JSONL scaled by bytes, and the rest
    unknown. Nothing past the sample is read."""
    progress = dataset.rows.progress()
    plain = dataset.rows.format is InputFormat.JSONL and progress["bytes_total"] is not None
    bytes_sampled, bytes_total = (sample.bytes, int(progress["bytes_total"])) if plain else (None, None)
    if sample.at_end():
        return _Size(rows_sampled, 1.0, bytes_sampled, bytes_total)
    total = progress["rows_total"]
    if total is None:
        total = dataset.count_rows()
    scale = None
    if total is not None:
        scale = total / max(sample.lines, 1)
    elif bytes_total is not None and bytes_sampled:
        scale = bytes_total / bytes_sampled
    return _Size(total, scale, bytes_sampled, bytes_total)


# What reading a compressed or Parquet input raises when it is not what its format says.
_UNREADABLE = (gzip.BadGzipFile, EOFError, zstandard.ZstdError, pa.ArrowException)


@contextlib.contextmanager
def reading(name: str, fmt: InputFormat | None, url: str | None = None) -> Iterator[None]:
    """Errors of opening or reading the input ``name`` (as ``fmt``) in one line: an input that is
    not what its format says is the user's to fix (400), another read error the store's (503). A
    password in ``url`` is never shown, whatever a lower layer put in its message."""
    try:
        try:
            yield
        except _UNREADABLE as exc:
            what = f" as {fmt.value}" if fmt is not None else ""
            raise InvalidSpecError(f"cannot read {name}{what}: {exc}") from exc
        except OSError as exc:
            raise StorageError(f"cannot read {name}: {exc}") from exc
    except DatagenError as exc:
        shown = without_password(str(exc), url)
        if shown == str(exc):
            raise
        # Not chained: the cause's message holds the password too.
        raise type(exc)(shown) from None
