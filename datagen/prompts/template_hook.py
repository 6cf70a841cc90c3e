"""The budgeted chat template rendered inside transformers' own ``apply_chat_template``, so that a
row is rendered once, not once for the budget and once more by transformers.

transformers offers no hook between choosing a row's template and rendering it: its
``render_jinja_template`` compiles the text with ``chat_template_utils._compile_jinja_template``,
looked up in that module at each call. `install` wraps that function once per process. While
`serving` is active in a thread (a `PromptRenderer` render), the wrapper answers with the template
the renderer's ``lookup`` gives for the text (`datagen.prompts.template_budget.BudgetedTemplate`,
compiled like transformers' own environment); everywhere else, and for every other caller,
transformers' compile answers as before. transformers stays the one path from a conversation to
text and ids: its input handling, its choice of template, its tokenizing.

A renderer uses this only after a probe showed the wrapper answered and rendered what transformers
renders (`PromptRenderer._renders_once`); where the function is missing or the probe fails, it
renders twice, as before.
"""

from __future__ import annotations

import contextvars
import importlib
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import jinja2

__all__ = ["Serving", "install", "serving", "transformers_environment"]

_MODULE = "transformers.utils.chat_template_utils"
_FUNCTION = "_compile_jinja_template"

Lookup = Callable[[str], jinja2.Template]


@dataclass
class Serving:
    """One `serving` block: its lookup, and whether transformers asked it for a template."""

    lookup: Lookup
    served: bool = False


_SERVING: contextvars.ContextVar[Serving | None] = contextvars.ContextVar("template_serving", default=None)
_LOCK = threading.Lock()
# transformers' own compile, once `install` has found it; None before, or where it is missing.
_original: Callable[[str], Any] | None = None
_installed: bool | None = None


def _hooked(chat_template: str) -> Any:
    current = _SERVING.get()
    if current is None:
        assert _original is not None  # installed before it can be called
        return _original(chat_template)
    current.served = True
    return current.lookup(chat_template)


def install() -> bool:
    """Put the wrapper in transformers' path, once per process (idempotent, thread-safe). False
    where transformers has no such function to wrap."""
    global _original, _installed
    with _LOCK:
        if _installed is None:
            module = importlib.import_module(_MODULE)
            original = getattr(module, _FUNCTION, None)
            if callable(original):
                _original = original
                setattr(module, _FUNCTION, _hooked)
                _installed = True
            else:
                _installed = False
        return _installed


def transformers_environment(chat_template: str) -> jinja2.Environment | None:
    """The environment transformers compiles ``chat_template`` in; None before `install` or where
    it found nothing to wrap."""
    if _original is None:
        return None
    template = _original(chat_template)
    environment = getattr(template, "environment", None)
    return environment if isinstance(environment, jinja2.Environment) else None


@contextmanager
def serving(lookup: Lookup) -> Iterator[Serving]:
    """transformers' compiles in this block, in this thread, answered by ``lookup``."""
    current = Serving(lookup)
    token = _SERVING.set(current)
    try:
        yield current
    finally:
        _SERVING.reset(token)
