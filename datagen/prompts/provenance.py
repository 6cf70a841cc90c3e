"""Which files and which text made a job's prompt ids: the provenance a job's manifest pins and a
later submit to the job is held to (`datagen.prompts.tokenization.PromptRenderer.identity`).

``tokenizer_sha256`` hashes each present tokenizer file (name, then the sha256 of its bytes) in a
fixed order (:data:`TOKENIZER_FILE_NAMES`); a template is pinned by the sha256 of its UTF-8 text, and
``chat_template_kwargs`` by one canonical JSON text (`datagen.spec.canonical_kwargs_json`, re-exported here).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from datagen.prompts.sources import ResolvedSource
from datagen.spec import canonical_kwargs_json

__all__ = ["TOKENIZER_FILE_NAMES", "canonical_kwargs_json", "text_sha256", "tokenizer_sha256"]

# Files that define a tokenizer; the ones present are hashed for the job manifest.
TOKENIZER_FILE_NAMES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _tokenizer_files(source: ResolvedSource) -> list[Path]:
    if source.path is not None:
        local = Path(source.path)
        return [local / name for name in TOKENIZER_FILE_NAMES if (local / name).is_file()]
    from huggingface_hub import try_to_load_from_cache

    found = (try_to_load_from_cache(source.location, name) for name in TOKENIZER_FILE_NAMES)
    return [Path(p) for p in found if isinstance(p, str)]


def tokenizer_sha256(source: ResolvedSource, tokenizer: Any) -> str:
    """The digest of the files ``tokenizer`` was loaded from (a local directory, or the Hub's cache);
    of its vocabulary where no file is found (an unusual loader)."""
    digest = hashlib.sha256()
    files = _tokenizer_files(source)
    for path in files:
        digest.update(path.name.encode("utf-8") + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    if not files:
        digest.update(json.dumps(tokenizer.get_vocab(), sort_keys=True).encode("utf-8"))
    return digest.hexdigest()
