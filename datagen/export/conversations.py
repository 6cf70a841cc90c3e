"""The ``conversations`` export (trainer-formats §4.1): the original messages plus the generated
assistant turn, for trainers that take text and re-tokenize it.

Records do not hold the messages, so they are read back from the job's uploaded input
(``jobs/<job>/input/*.jsonl``). `InputIndex` makes one pass over the input and keeps, per prompt,
a 16-byte digest of ``(sample_id, turn)`` and the line's file and byte offset (its cost per prompt:
bench/README.md); each record's line is then read again with a seek and parsed with
`datagen.prompts.dataset.iter_prompts`, so no record or message list is held. Where two uploads hold the
same prompt, the first (oldest file) wins, as at ingestion.

The assistant turn is the output decoded with special tokens skipped (EOS dropped), split at the
first think-end token: the text before it is ``reasoning_content``, the text after it ``content``
(whitespace around the split trimmed, as reasoning parsers do). The prompt's trailing ``<think>\\n``
belongs to the prompt, so reasoning starts at the first output token. An output with no think-end
after a prompt that opens a think block (a length-truncated record) is all ``reasoning_content`` with
an empty ``content``; after a prompt that does not open one (thinking off), all ``content``. Each row
carries ``status``: ``success`` for a stop, ``truncated`` for a length finish or a row clipped by
``--max-length`` (SpecForge's validator accepts only ``success``). A record of a job with a recipe
also carries its ``arm`` and ``chat_template_kwargs`` (an object: the template variables its prompt
was rendered with, which a trainer re-rendering the conversation needs, e.g. ``thinking``); rows of a
job without a recipe have neither.

Jobs in multi-turn ``all`` mode are refused (in ``datagen.export.pipeline``): the history of their turn k+1 is
the regenerated turn k, which the input does not hold. Rebuilding it needs the records grouped by
conversation (a bucket pass keyed on ``(sample_id, gen)``), not done yet.
"""

from __future__ import annotations

import hashlib
import io
import os
import tempfile
from collections.abc import Iterator
from typing import Any, BinaryIO, cast

import orjson
import pyarrow as pa

from datagen.errors import StorageError
from datagen.export.formats import JsonTexts
from datagen.export.rows import DropReason, ExportStats
from datagen.export.tokens import JobTokens
from datagen.prompts.dataset import DEFAULT_MAX_LINE_BYTES, Prompt, iter_prompts
from datagen.prompts.inputs import InputFormat, format_for_name
from datagen.records.reader import RowViews
from datagen.records.schema import ARM, TEMPLATE_KWARGS
from datagen.records.storage import Storage
from datagen.states import MultiTurnMode

__all__ = ["ConversationFormatter", "InputIndex"]

_DIGEST_BYTES = 16
_OFFSET_BITS = 40  # byte offsets up to 1 TiB per file; the file number sits above them
_SKIP_CHUNK_BYTES = 64 * 1024
_STATUS_SUCCESS = "success"
_STATUS_TRUNCATED = "truncated"


def _prompt_digest(sample_id: str, turn: int) -> bytes:
    data = sample_id.encode("utf-8") + turn.to_bytes(4, "little", signed=True)
    return hashlib.blake2b(data, digest_size=_DIGEST_BYTES).digest()


def _lines_with_offsets(fh: BinaryIO) -> Iterator[tuple[int, bytes]]:
    """(byte offset, line) per line; a line over the dataset's size cap is skipped (it was rejected)."""
    while True:
        offset = fh.tell()
        line = fh.readline(DEFAULT_MAX_LINE_BYTES + 1)
        if not line:
            return
        if len(line) > DEFAULT_MAX_LINE_BYTES and not line.endswith(b"\n"):
            while line and not line.endswith(b"\n"):
                line = fh.readline(_SKIP_CHUNK_BYTES)
            continue
        yield offset, line


def _seekable_rows(storage: Storage, job_id: str, name: str) -> BinaryIO:
    """An input's rows as JSONL lines that can be sought back to. A plain JSONL upload is read in
    place (many seeks follow, one per record: small cached blocks on an object store); any other
    input (compressed, Parquet, a reference) is read once as rows into a temporary file, since its
    own bytes are no lines to seek to."""
    if format_for_name(name) is InputFormat.JSONL:
        return storage.open_input(job_id, name, random_access=True)
    spool = tempfile.TemporaryFile()  # noqa: SIM115 - handed to the index, which closes it
    try:
        with storage.open_rows(job_id, name) as rows:
            while line := rows.readline(DEFAULT_MAX_LINE_BYTES + 1):
                spool.write(line)
        spool.seek(0)
    except BaseException:
        spool.close()
        raise
    return cast(BinaryIO, spool)


class InputIndex:
    """``(sample_id, turn)`` → where its dataset line is, over every input file of a job."""

    def __init__(self, storage: Storage, job_id: str, multi_turn: MultiTurnMode) -> None:
        self.multi_turn = multi_turn
        self._files: list[BinaryIO] = []
        self._where: dict[bytes, int] = {}
        try:
            for number, name in enumerate(storage.input_names(job_id)):
                fh = _seekable_rows(storage, job_id, name)
                self._files.append(fh)
                self._index(number, fh)
        except OSError as exc:
            self.close()
            where = storage.url(job_id, "input")
            raise StorageError(f"cannot read the input of job {job_id} under {where}: {exc}") from exc
        except BaseException:
            self.close()
            raise

    def _index(self, number: int, fh: BinaryIO) -> None:
        for offset, line in _lines_with_offsets(fh):
            for item in iter_prompts(io.BytesIO(line), multi_turn=self.multi_turn):
                if isinstance(item, Prompt):
                    self._where.setdefault(
                        _prompt_digest(item.sample_id, item.turn), number << _OFFSET_BITS | offset
                    )

    def __len__(self) -> int:
        return len(self._where)

    def prompt(self, sample_id: str, turn: int) -> Prompt | None:
        where = self._where.get(_prompt_digest(sample_id, turn))
        if where is None:
            return None
        fh = self._files[where >> _OFFSET_BITS]
        fh.seek(where & ((1 << _OFFSET_BITS) - 1), os.SEEK_SET)
        line = fh.readline(DEFAULT_MAX_LINE_BYTES + 1)
        for item in iter_prompts(io.BytesIO(line), multi_turn=self.multi_turn):
            if isinstance(item, Prompt) and item.sample_id == sample_id and item.turn == turn:
                return item
        return None

    def close(self) -> None:
        for fh in self._files:
            fh.close()
        self._files.clear()


class ConversationFormatter:
    def __init__(self, tokens: JobTokens, index: InputIndex, stats: ExportStats) -> None:
        self.tokens = tokens
        self.index = index
        self.stats = stats
        self._json = JsonTexts()

    def _split(self, rows: RowViews, i: int, finish: str) -> tuple[list[int], list[int] | None]:
        """Output ids → (content ids, reasoning ids or None when the turn has no reasoning)."""
        output = rows.output(i).tolist()
        if finish == "stop" and output and output[-1] in self.tokens.stop_ids:
            output = output[:-1]
        end = self.tokens.think_end_id
        if end is not None and end in output:
            cut = output.index(end)
            return output[cut + 1 :], output[:cut]
        if self.tokens.opens_think(rows.prompt(i)):
            return [], output
        return output, None

    def lines(self, batch: pa.RecordBatch) -> Iterator[bytes]:
        rows = RowViews(batch)
        sample_ids = batch.column("sample_id").to_pylist()
        turns = batch.column("turn").to_pylist()
        finishes = batch.column("finish_type").to_pylist()
        lengths = batch.column("output_len").to_pylist()
        arms = batch.column(ARM).to_pylist()
        kwargs = batch.column(TEMPLATE_KWARGS).to_pylist()
        kept: list[tuple[int, Prompt]] = []
        for i in range(len(rows)):
            prompt = self.index.prompt(sample_ids[i], turns[i])
            if prompt is None:
                self.stats.dropped[DropReason.NO_INPUT.value] += 1
            else:
                kept.append((i, prompt))
        splits = [self._split(rows, i, finishes[i]) for i, _ in kept]
        contents = self.tokens.decode_many([c for c, _ in splits], skip_special_tokens=True)
        reasonings = self.tokens.decode_many([r or [] for _, r in splits], skip_special_tokens=True)
        for (i, prompt), (_, reasoning_ids), content, reasoning in zip(
            kept, splits, contents, reasonings, strict=True
        ):
            assistant: dict[str, Any] = {"role": "assistant", "content": content.strip()}
            if reasoning_ids is not None:
                assistant["reasoning_content"] = reasoning.strip()
            clipped = len(rows.input_ids(i)) < int(rows.prompt_lens[i]) + lengths[i]
            truncated = finishes[i] == "length" or clipped
            row: dict[str, Any] = {
                "id": rows.ids[i],
                "conversations": [*prompt.messages, assistant],
                "status": _STATUS_TRUNCATED if truncated else _STATUS_SUCCESS,
                "finish_reason": finishes[i],
            }
            if prompt.tools:
                row["tools"] = prompt.tools
            if arms[i] is not None:
                row["arm"] = arms[i]
                row["chat_template_kwargs"] = self._json(kwargs[i])
            yield orjson.dumps(row, option=orjson.OPT_APPEND_NEWLINE)
