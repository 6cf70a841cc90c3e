"""Loading what a job spec names: the tokenizer (transformers' ``AutoTokenizer``) and a chat template
file, checked for Jinja syntax, with one-line errors that say what to pass instead. Names arrive
resolved (`datagen.sources`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from datagen.errors import InvalidSpecError
from datagen.sources import ResolvedSource

__all__ = ["check_template_syntax", "load_tokenizer", "read_template"]


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
    from transformers import AutoTokenizer  # heavy import, only when a tokenizer is loaded

    try:
        return AutoTokenizer.from_pretrained(source.location, trust_remote_code=trust_remote_code)
    except Exception as exc:  # the library boundary: any loader failure is a spec problem
        raise InvalidSpecError(
            f"cannot load tokenizer {name!r}: {_one_line(exc)}. Pass a local directory with the tokenizer "
            "files or a hub id available in the local cache (downloads are off when HF_HUB_OFFLINE=1); "
            "set trust_remote_code only for tokenizers that need it"
        ) from exc
