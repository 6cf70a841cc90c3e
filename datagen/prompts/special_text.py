"""Special-token text in content: a row whose user turn spells ``<｜Assistant｜>`` is encoded with the
real special id by the tokenizer, so it could forge turn boundaries. Found here, reported by the dry
run and `datagen report`, and flagged or rejected by ingestion (spec ``special_text``)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

__all__ = ["SpecialTextFinder", "special_text_reason"]

SPECIAL_TEXT_SHOWN = 5


class SpecialTextFinder:
    """Finds the texts of a tokenizer's added tokens in any string of a JSON value, in one pass."""

    def __init__(self, added_tokens: Iterable[str]) -> None:
        self._pattern = re.compile(_trie_pattern(text for text in added_tokens if text))

    def find(self, value: object) -> list[str]:
        """The distinct added-token texts spelled in ``value``'s strings (keys included), sorted."""
        found: set[str] = set()
        for text in _strings(value):
            found.update(self._pattern.findall(text))
        return sorted(found)


def _trie_pattern(texts: Iterable[str]) -> str:
    """A regex for any of ``texts``, built as a trie: each position is tried once per character
    instead of once per text (the DeepSeek tokenizer has 1,283 added tokens), longest match first."""
    trie: dict[str, Any] = {}
    for text in texts:
        node = trie
        for char in text:
            node = node.setdefault(char, {})
        node[""] = {}

    def emit(node: dict[str, Any]) -> str:
        branches = [re.escape(char) + emit(child) for char, child in sorted(node.items()) if char]
        if "" in node:
            return "(?:" + "|".join(branches) + ")?" if branches else ""
        return branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"

    return emit(trie) if trie else "(?!)"


def _strings(value: object) -> Iterator[str]:
    """Every string in a JSON value, keys included: all of them can reach the rendered prompt."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _strings(key)
            yield from _strings(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _strings(item)


def special_text_reason(found: Sequence[str]) -> str:
    """Why a row whose content spells special tokens is rejected (``special_text: reject``)."""
    shown = ", ".join(found[:SPECIAL_TEXT_SHOWN]) + (", ..." if len(found) > SPECIAL_TEXT_SHOWN else "")
    return (
        f"content spells special tokens {shown} as text, which would encode as real special ids; "
        "clean the row or submit with special_text: allow"
    )
