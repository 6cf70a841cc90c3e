"""Special-token text in content: a row whose user turn spells ``<｜Assistant｜>`` is encoded with the
real special id by the tokenizer, so it could forge turn boundaries. Found here, reported by the dry
run and `datagen report`, and flagged or rejected by ingestion (spec ``special_text``)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["SpecialTextFinder", "special_text_reason"]

SPECIAL_TEXT_SHOWN = 5


class SpecialTextFinder:
    """Finds the texts of a tokenizer's added tokens in any string of a JSON value, in one pass."""

    def __init__(self, added_tokens: Iterable[str]) -> None:
        texts = [text for text in added_tokens if text]
        self._pattern = re.compile(_trie_pattern(texts))
        # The strings are searched as one text, joined by a character no token holds, so no match
        # spans two of them: one regex call a row instead of one per string.
        used = set("".join(texts))
        self._joint = next((c for c in _JOINTS if c not in used), None)

    def find(self, value: object) -> list[str]:
        """The distinct added-token texts spelled in ``value``'s strings (keys included), sorted."""
        strings = _strings(value)
        if self._joint is not None:
            return sorted(set(self._pattern.findall(self._joint.join(strings))))
        found: set[str] = set()
        for text in strings:
            found.update(self._pattern.findall(text))
        return sorted(found)


# Control characters, tried in turn as the joint; a tokenizer whose added tokens hold every one
# is searched string by string.
_JOINTS = tuple(chr(code) for code in (0, 1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 14, 15, 16))


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


def _strings(value: object) -> list[str]:
    """Every string in a JSON value, keys included: all of them can reach the rendered prompt."""
    found: list[str] = []
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            found.append(item)
        elif isinstance(item, list | tuple):
            stack.extend(item)
        # dict before the Mapping ABC: a row's objects are dicts, and the ABC's check costs more
        # than the rest of the walk.
        elif isinstance(item, dict | Mapping):
            for key, inner in item.items():
                stack.append(inner)
                stack.append(key)
    return found


def special_text_reason(found: Sequence[str]) -> str:
    """Why a row whose content spells special tokens is rejected (``special_text: reject``)."""
    shown = ", ".join(found[:SPECIAL_TEXT_SHOWN]) + (", ..." if len(found) > SPECIAL_TEXT_SHOWN else "")
    return (
        f"content spells special tokens {shown} as text, which would encode as real special ids; "
        "clean the row or submit with special_text: allow"
    )
