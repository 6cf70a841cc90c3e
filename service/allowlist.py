"""Which tokenizers and templates a job spec may name.

Loading a tokenizer reads files on the coordinator, and ``trust_remote_code`` runs code from
them, so a client must not be able to point at arbitrary paths: the operator lists what may be
used (``DATAGEN_TOKENIZER_ALLOWLIST``), and ``trust_remote_code`` needs
``DATAGEN_ALLOW_TRUST_REMOTE_CODE=1``. The bundled DeepSeek tokenizer and the shipped templates
are always allowed, so the demo and the tests need no configuration.
"""

from __future__ import annotations

import os
from pathlib import Path

from datagen.errors import InvalidSpecError
from datagen.settings import CoordinatorSettings
from datagen.spec import JobSpec
from datagen.tokenization import bundled_tokenizer_path, default_chat_template_path

__all__ = ["check_allowed"]

ANYTHING = "*"


def _inside(path: str, prefix: str) -> bool:
    # realpath on both sides: "..", symlinks and trailing slashes cannot escape a prefix.
    real, root = os.path.realpath(path), os.path.realpath(prefix)
    return real == root or real.startswith(root.rstrip(os.sep) + os.sep)


def _allowed(name: str, entries: list[str]) -> bool:
    if ANYTHING in entries or name in entries:
        return True
    return any(_inside(name, entry) for entry in entries if os.path.isabs(entry))


def check_allowed(spec: JobSpec, settings: CoordinatorSettings) -> None:
    entries = [
        *settings.allowlist(),
        bundled_tokenizer_path(),
        str(Path(default_chat_template_path()).parent),
    ]
    if not _allowed(spec.tokenizer, entries):
        raise InvalidSpecError(
            f"tokenizer {spec.tokenizer!r} is not allowed on this coordinator; an operator must add it "
            "(or a directory above it) to DATAGEN_TOKENIZER_ALLOWLIST"
        )
    if spec.chat_template is not None and not _allowed(spec.chat_template, entries):
        raise InvalidSpecError(
            f"chat template {spec.chat_template!r} is not allowed on this coordinator; an operator must "
            "add it (or its directory) to DATAGEN_TOKENIZER_ALLOWLIST"
        )
    if spec.trust_remote_code and not settings.allow_trust_remote_code:
        raise InvalidSpecError(
            "trust_remote_code runs code from the tokenizer's repository on the coordinator and is off; "
            "an operator can allow it with DATAGEN_ALLOW_TRUST_REMOTE_CODE=1"
        )
