"""redis-py replies are typed as unions of bytes, str and more; these turn them into text."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

__all__ = ["as_text", "as_texts"]


def as_text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def as_texts(values: Any) -> list[str]:
    return [as_text(v) for v in cast(Iterable[object], values)]
