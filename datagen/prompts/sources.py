"""What a tokenizer or chat template name in a job spec refers to: the one resolver.

The allowlist check (`service.allowlist`) and the loaders (`datagen.prompts.tokenization`) both call
`resolve_source`, so the file that is checked is the file that is loaded. A name is resolved as:

- a chat template or a decontamination set's file: always a local file;
- a tokenizer: a local directory when the name is written as a path (``/``, ``./``, ``../``,
  ``~``) or names something that exists relative to the working directory, else a Hugging Face
  hub id (``org/name``), which must be well-formed.

A local name gets ``~`` expanded (the coordinator's ``$HOME``), is made absolute against the
working directory and has its symlinks and ``..`` resolved, so that checking it against an
allowlisted prefix and opening it see the same file. Names with NUL bytes or control characters
are refused before any of this.
"""

from __future__ import annotations

import os
import re
import unicodedata
from dataclasses import dataclass
from enum import StrEnum
from urllib.parse import urlsplit, urlunsplit

from datagen.errors import InvalidSpecError

__all__ = ["ResolvedSource", "SourceKind", "local_path", "redacted_url", "resolve_source", "without_password"]

# A hub repo id: one or two segments of letters, digits, "-", "_", "." (no "..", no leading dot).
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?$")
_PATH_PREFIXES = ("/", "./", "../", "~", ".\\")


class SourceKind(StrEnum):
    TOKENIZER = "tokenizer"
    TEMPLATE = "chat template"
    BENCHMARK = "decontamination set"


@dataclass(frozen=True)
class ResolvedSource:
    """Exactly one of ``path`` (absolute, real) and ``hub_id`` is set."""

    name: str
    kind: SourceKind
    path: str | None = None
    hub_id: str | None = None

    @property
    def location(self) -> str:
        """What the loader opens: the real path, or the hub id."""
        return self.path if self.path is not None else str(self.hub_id)


def _check_characters(name: str, kind: SourceKind) -> None:
    if not name:
        raise InvalidSpecError(f"the {kind} name is empty: pass a local path or a hub id")
    if any(unicodedata.category(c) in ("Cc", "Cf") for c in name):
        raise InvalidSpecError(
            f"the {kind} name {name!r} holds control characters; pass a plain path or hub id"
        )


def local_path(name: str) -> str:
    """``~`` expanded, absolute against the working directory, symlinks and ``..`` resolved."""
    return os.path.realpath(os.path.abspath(os.path.expanduser(name)))


def resolve_source(name: str, kind: SourceKind) -> ResolvedSource:
    """The one decision of what a spec's name loads; does not read the file or reach the hub."""
    _check_characters(name, kind)
    if kind is not SourceKind.TOKENIZER or name.startswith(_PATH_PREFIXES):
        return ResolvedSource(name, kind, path=local_path(name))
    if os.path.lexists(os.path.expanduser(name)):
        return ResolvedSource(name, kind, path=local_path(name))
    if not _HUB_ID.match(name) or ".." in name:
        raise InvalidSpecError(
            f"tokenizer {name!r} is neither an existing local directory nor a hub id (org/name); "
            "pass the directory holding tokenizer.json, or a hub id"
        )
    return ResolvedSource(name, kind, hub_id=name)


def redacted_url(url: str) -> str:
    """``url`` without its password, for logs and messages (a Redis URL, a dataset given by
    reference)."""
    try:
        parts = urlsplit(url)
    except ValueError:  # not a URL urlsplit reads (an unclosed "["): all before an "@" is hidden
        scheme, sep, rest = url.partition("://")
        return f"{scheme}{sep}***@{rest.rsplit('@', 1)[1]}" if "@" in rest else url
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit(parts._replace(netloc=user + netloc))


def without_password(text: str, url: str | None) -> str:
    """``text`` (a lower layer's error message, which may quote the URL whole) with ``url``'s
    password hidden wherever it appears."""
    try:
        password = urlsplit(url).password if url else None
    except ValueError:  # not a URL urlsplit reads: redacted_url hides all before its "@"
        password = url.partition("://")[2].rpartition("@")[0] if url else None
    return text.replace(password, "***") if password else text
