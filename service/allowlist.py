"""Which tokenizers, templates and decontamination files a job spec may name.

Loading a tokenizer reads files on the coordinator, and ``trust_remote_code`` runs code from
them, so a client must not be able to point at arbitrary paths: the operator lists what may be
used (``DATAGEN_TOKENIZER_ALLOWLIST``: absolute path prefixes and hub ids, or ``*``), and
``trust_remote_code`` needs ``DATAGEN_ALLOW_TRUST_REMOTE_CODE=1``. The bundled DeepSeek tokenizer
and the shipped templates are always allowed, so the demo and the tests need no configuration.

Names are resolved by `datagen.prompts.sources.resolve_source`, the function the loaders use, so a name
cannot pass the check as one file and be loaded as another. A hub id passes only when listed
verbatim: a prefix of paths says nothing about what the hub may serve.

A dataset given by reference (``dataset_url``) is read by the coordinator with its own credentials,
so it must start with a prefix of ``DATAGEN_DATASET_ALLOWLIST`` (`check_dataset_url`): URL prefixes
match whole path segments (``s3://data`` allows ``s3://data/x``, not ``s3://data-private``), local
paths are resolved (symlinks, ``..``) and must lie under an absolute entry. Empty, it refuses every
reference.
"""

from __future__ import annotations

import os
from pathlib import Path

from datagen.errors import InvalidSpecError
from datagen.prompts.sources import ResolvedSource, SourceKind, local_path, redacted_url, resolve_source
from datagen.prompts.tokenization import bundled_tokenizer_path, default_chat_template_path
from datagen.records.files import is_url
from datagen.settings import CoordinatorSettings
from datagen.spec import BUILTIN_SETS, JobSpec

__all__ = ["check_allowed", "check_dataset_url"]

_LOCAL_SCHEME = "file://"

ANYTHING = "*"


def _inside(real: str, root: str) -> bool:
    return real == root or real.startswith(root.rstrip(os.sep) + os.sep)


def _allowed(source: ResolvedSource, entries: list[str]) -> bool:
    if ANYTHING in entries:
        return True
    if source.hub_id is not None:
        return source.hub_id in entries
    assert source.path is not None
    # Only absolute entries are path prefixes, resolved like the name (symlinks, trailing slashes).
    roots = [local_path(entry) for entry in entries if os.path.isabs(os.path.expanduser(entry))]
    return any(_inside(source.path, root) for root in roots)


def check_allowed(spec: JobSpec, settings: CoordinatorSettings) -> None:
    entries = [
        *settings.allowlist(),
        bundled_tokenizer_path(),
        str(Path(default_chat_template_path()).parent),
    ]
    # One message whatever the name resolved to, so refusals do not tell which paths exist.
    if not _allowed(resolve_source(spec.tokenizer, SourceKind.TOKENIZER), entries):
        raise InvalidSpecError(
            f"tokenizer {spec.tokenizer!r} is not allowed on this coordinator; an operator must add it "
            "(or a directory above it) to DATAGEN_TOKENIZER_ALLOWLIST"
        )
    if spec.chat_template is not None and not _allowed(
        resolve_source(spec.chat_template, SourceKind.TEMPLATE), entries
    ):
        raise InvalidSpecError(
            f"chat template {spec.chat_template!r} is not allowed on this coordinator; an operator must "
            "add it (or its directory) to DATAGEN_TOKENIZER_ALLOWLIST"
        )
    for source in spec.decontaminate:
        # Rejected rows quote the matching benchmark text: an unchecked path would leak any file.
        if source not in BUILTIN_SETS and not _allowed(resolve_source(source, SourceKind.BENCHMARK), entries):
            raise InvalidSpecError(
                f"decontamination set {source!r} is not allowed on this coordinator; use a built-in set "
                f"({', '.join(sorted(BUILTIN_SETS))}) or ask an operator to add the file (or its directory) "
                "to DATAGEN_TOKENIZER_ALLOWLIST"
            )
    if spec.trust_remote_code and not settings.allow_trust_remote_code:
        raise InvalidSpecError(
            "trust_remote_code runs code from the tokenizer's repository on the coordinator and is off; "
            "an operator can allow it with DATAGEN_ALLOW_TRUST_REMOTE_CODE=1"
        )


def check_dataset_url(url: str, settings: CoordinatorSettings) -> str:
    """The reference to read if ``url`` is allowed (a local path resolved), else `InvalidSpecError`."""
    entries = settings.dataset_prefixes()
    if not entries:
        raise InvalidSpecError(
            "datasets by reference are off on this coordinator: an operator must list allowed prefixes in "
            "DATAGEN_DATASET_ALLOWLIST, or upload the file instead of giving dataset_url"
        )
    refused = InvalidSpecError(
        f"dataset_url {redacted_url(url)[:200]!r} is not allowed on this coordinator; an operator must add "
        "it (or a prefix of it) to DATAGEN_DATASET_ALLOWLIST"
    )
    local = url.removeprefix(_LOCAL_SCHEME) if url.startswith(_LOCAL_SCHEME) else url
    if not is_url(local):
        if not os.path.isabs(os.path.expanduser(local)):
            raise InvalidSpecError(f"dataset_url {redacted_url(url)[:200]!r}: give an absolute path or a URL")
        real = local_path(local)
        roots = [
            local_path(e.removeprefix(_LOCAL_SCHEME))
            for e in entries
            if not is_url(e.removeprefix(_LOCAL_SCHEME))
        ]
        if any(_inside(real, root) for root in roots if os.path.isabs(root)):
            return real
        raise refused
    segments = url.split("://", 1)[-1].split("/")
    if "." in segments or ".." in segments:
        raise refused  # an object store takes them literally, a path-like one may not
    if any(url == e or url.startswith(e.rstrip("/") + "/") for e in entries if is_url(e)):
        return url
    raise refused
