"""Loading what a job spec names: the tokenizer (transformers' ``AutoTokenizer``) and a chat template
file, checked for Jinja syntax, with one-line errors that say what to pass instead. Names arrive
resolved (`datagen.prompts.sources`).

transformers and huggingface_hub are imported lazily (the CLI starts fast without them), but their
lazy modules are not safe to resolve from several threads at once: long-lived processes call
`preload_libraries` at start, before any thread needs them, and the import here holds a lock.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from datagen.errors import InvalidSpecError
from datagen.prompts.sources import ResolvedSource

__all__ = ["check_template_syntax", "load_tokenizer", "preload_libraries", "read_template"]

_IMPORT_LOCK = threading.Lock()


def preload_libraries() -> None:
    """Import what loading and hashing a tokenizer needs, once, from one thread (see above)."""
    with _IMPORT_LOCK:
        import huggingface_hub
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        # Resolve the lazy attributes a first load touches, not just the top-level modules.
        _ = (AutoTokenizer.from_pretrained, PreTrainedTokenizerFast, huggingface_hub.try_to_load_from_cache)


class _GenerationTag(jinja2.ext.Extension):
    """Parses transformers' `{% generation %}…{% endgeneration %}` block so such templates validate."""

    tags = {"generation"}  # noqa: RUF012 (jinja declares Extension.tags as a plain set)

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def check_template_syntax(text: str, source: str) -> None:
    env = ImmutableSandboxedEnvironment(extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    try:
        env.parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise InvalidSpecError(
            f"chat template {source} is not valid Jinja (line {exc.lineno}: {exc.message}); fix the template"
        ) from exc


def read_template(source: ResolvedSource) -> str:
    path = source.location
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise InvalidSpecError(
            f"chat template file {path} does not exist; pass an existing .jinja file to --chat-template"
        ) from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidSpecError(f"cannot read chat template file {path}: {exc}") from exc
    check_template_syntax(text, path)
    return text


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()).rstrip(".")


def load_tokenizer(source: ResolvedSource, trust_remote_code: bool, file_names: Sequence[str]) -> Any:
    name = source.name
    local = None if source.path is None else Path(source.path)
    if local is not None and not local.is_dir():
        raise InvalidSpecError(
            f"tokenizer path {name} is not a directory; pass the directory holding tokenizer.json "
            "and tokenizer_config.json, or a Hugging Face hub id"
        )
    if local is not None and not any((local / f).is_file() for f in file_names):
        raise InvalidSpecError(
            f"tokenizer directory {name} holds no tokenizer files (tokenizer.json, tokenizer_config.json, "
            "...); pass the directory the model's tokenizer was saved to"
        )
    preload_libraries()
    from transformers import AutoTokenizer  # resolved by preload_libraries

    try:
        return AutoTokenizer.from_pretrained(source.location, trust_remote_code=trust_remote_code)
    except Exception as exc:  # the library boundary: any loader failure is a spec problem
        raise InvalidSpecError(
            f"cannot load tokenizer {name!r}: {_one_line(exc)}. Pass a local directory with the tokenizer "
            "files or a hub id available in the local cache (downloads are off when HF_HUB_OFFLINE=1); "
            "set trust_remote_code only for tokenizers that need it"
        ) from exc
