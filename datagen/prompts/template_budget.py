"""A render budget for chat templates: output size and render time.

Jinja's sandbox stops attribute escapes and caps ``range``, but a template can still build a huge
string (``{{ 'a' * 10000000 }}``, a doubling loop) or loop for minutes; the tokenizer then spends
a minute on the text. `BudgetedTemplate` renders a template in a sandbox that refuses, with an
`InvalidRowError` naming the budget:

- results over ``MAX_RENDER_CHARS`` from ``*``, ``+``, ``%``, ``**``, ``~``, calls and filters
  (checked before building the value where its size is known in advance);
- integer arguments over ``MAX_RENDER_CHARS`` to any call or filter (``range(100000000)``,
  ``'x'|center(10**9)``);
- more than ``MAX_RENDER_CHARS`` of streamed output;
- more than ``MAX_RENDER_S`` of rendering, checked at each output chunk, call and loop iteration.

Loops are instrumented by rewriting each ``for``'s iterable (and each ``~``) into a call of a
budget function before compiling, since Jinja offers no hook for them. None of the checks changes
what a template renders within its budget.

A template is compiled either in a sandbox made like the environment transformers compiles chat
templates in (`BudgetedTemplate` with ``like``: its options, filters, globals and extensions, the
budget's checks added), or, where that environment is not one this module can copy, in one of
transformers' documented options and globals.

The budgeted template renders inside transformers' own ``apply_chat_template``, so that a row is
rendered once, not once for the budget and once more by transformers. transformers offers no hook
between choosing a row's template and rendering it: its ``render_jinja_template`` compiles the
text with ``chat_template_utils._compile_jinja_template``, looked up in that module at each call.
`install_hook` wraps that function once per process. While `serving` is active in a thread (a
`PromptRenderer` render), the wrapper answers with the template the renderer's ``lookup`` gives
for the text; everywhere else, and for every other caller, transformers' compile answers as
before. transformers stays the one path from a conversation to text and ids: its input handling,
its choice of template, its tokenizing. A renderer uses this only after a probe showed the wrapper
answered and rendered what transformers renders (`PromptRenderer._renders_once`); where the
function is missing or the probe fails, it renders twice, as before.
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import json
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, ClassVar, cast

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from datagen.errors import InvalidRowError

__all__ = [
    "MAX_RENDER_CHARS",
    "MAX_RENDER_S",
    "BudgetedTemplate",
    "Serving",
    "install_hook",
    "serving",
    "transformers_environment",
]

# About a million tokens of text: far above any context length, far below what hurts a coordinator.
MAX_RENDER_CHARS = 4_000_000
MAX_RENDER_S = 2.0
# Attribute verdicts the sandbox remembers (`_BudgetSandbox.is_safe_attribute`).
MAX_SAFE_ATTRIBUTES = 4096
_LOOP_GUARD = "__datagen_loop_budget"
_CONCAT_GUARD = "__datagen_concat_budget"
_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("render_deadline", default=None)
_SIZED = (str, list, tuple, dict)


def _over_size(what: str) -> InvalidRowError:
    return InvalidRowError(
        f"chat template exceeded its output budget of {MAX_RENDER_CHARS:,} characters ({what}); "
        "fix the template, or shorten the row"
    )


def _check_deadline() -> None:
    deadline = _DEADLINE.get()
    if deadline is not None and time.monotonic() > deadline:
        raise InvalidRowError(
            f"chat template exceeded its render time budget of {MAX_RENDER_S:g} s; fix the template's "
            "loops, or shorten the row"
        )


def _check_result(value: object, what: str) -> object:
    if isinstance(value, _SIZED) and len(value) > MAX_RENDER_CHARS:
        raise _over_size(what)
    return value


def _check_arguments(args: Iterable[object], what: str) -> None:
    for arg in args:
        if isinstance(arg, int) and not isinstance(arg, bool) and abs(arg) > MAX_RENDER_CHARS:
            raise _over_size(f"{what} with argument {arg:,}")


def _binop_size(operator: str, left: object, right: object) -> float:
    """The size of the result, when it is known before computing it (0 otherwise)."""
    if operator == "*":
        for seq, times in ((left, right), (right, left)):
            if isinstance(seq, _SIZED) and isinstance(times, int):
                return len(seq) * times
    if operator == "+" and isinstance(left, _SIZED) and isinstance(right, _SIZED):
        return len(left) + len(right)
    if operator == "**" and isinstance(left, int | float) and isinstance(right, int | float):
        # Decimal digits of the result; a float overflows on its own.
        return max(float(right), 0.0) * math.log10(abs(left)) if abs(left) > 1 else 0.0
    return 0.0


def _loop_budget(iterable: Iterable[Any]) -> Iterator[Any]:
    for item in iterable:
        _check_deadline()
        yield item


def _concat_budget(*parts: object) -> str:
    texts = [str(part) for part in parts]
    if sum(len(text) for text in texts) > MAX_RENDER_CHARS:
        raise _over_size("~ concatenation")
    return "".join(texts)


def _budgeted_filter(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    # The filtered value (after jinja's context, for filters that take one) is not an argument.
    skip = 2 if getattr(fn, "jinja_pass_arg", None) is not None else 1

    @functools.wraps(fn)  # keeps jinja's pass_context/pass_eval_context marks
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _check_deadline()
        _check_arguments([*args[skip:], *kwargs.values()], f"filter {name}")
        return _check_result(fn(*args, **kwargs), f"filter {name}")

    return wrapper


class _Instrument(NodeTransformer):
    """Routes every ``for`` iterable and ``~`` through the budget functions."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = nodes.Call(nodes.Name(_LOOP_GUARD, "load"), [node.iter], [], None, None)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        call = nodes.Call(nodes.Name(_CONCAT_GUARD, "load"), list(node.nodes), [], None, None)
        return call.set_lineno(node.lineno)


class _BudgetSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "+", "%", "**"})
    # The sandbox's verdict on an attribute, by the object's type and the attribute's name: jinja
    # 3.1's own (`ImmutableSandboxedEnvironment.is_safe_attribute`) reads nothing else, but spends
    # a dozen isinstance checks on it, an eighth of a chat row's render. Another jinja is asked
    # every time. Keys are attributes that exist (jinja asks only once getattr found one), so
    # few; the cap bounds them anyway.
    _safe_attributes: ClassVar[dict[tuple[type, str], bool]] = {}
    _remember_verdicts: ClassVar[bool] = jinja2.__version__.startswith("3.1.")

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        if not self._remember_verdicts:
            return super().is_safe_attribute(obj, attr, value)
        key = (type(obj), attr)
        safe = self._safe_attributes.get(key)
        if safe is None:
            safe = super().is_safe_attribute(obj, attr, value)
            if len(self._safe_attributes) < MAX_SAFE_ATTRIBUTES:
                self._safe_attributes[key] = safe
        return safe

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        if _binop_size(operator, left, right) > MAX_RENDER_CHARS:
            raise _over_size(f"operator {operator}")
        return _check_result(super().call_binop(context, operator, left, right), f"operator {operator}")

    def call(self, context: Context, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        _check_deadline()
        if obj is not _loop_budget:
            _check_arguments([*args, *kwargs.values()], "a call")
        return _check_result(super().call(context, obj, *args, **kwargs), "a call")


class _BudgetedJinja(jinja2.Template):
    """A compiled template whose ``render`` keeps the budget: a deadline for the calls and loops
    inside, and a cap on the output as it streams."""

    def render(self, *args: Any, **kwargs: Any) -> str:
        token = _DEADLINE.set(time.monotonic() + MAX_RENDER_S)
        try:
            chunks: list[str] = []
            size = 0
            for chunk in self.generate(*args, **kwargs):
                size += len(chunk)
                if size > MAX_RENDER_CHARS:
                    raise _over_size("streamed output")
                _check_deadline()
                chunks.append(chunk)
            return "".join(chunks)
        finally:
            _DEADLINE.reset(token)


class _GenerationBlock(jinja2.ext.Extension):
    """transformers' ``{% generation %}`` block renders its body unchanged."""

    tags = {"generation"}  # noqa: RUF012 (jinja declares Extension.tags as a plain set)

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _environment() -> _BudgetSandbox:
    # The options and globals transformers gives chat templates, so a template renders here as there.
    env = _BudgetSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.filters = {name: _budgeted_filter(name, fn) for name, fn in env.filters.items()}
    env.globals.update(
        {
            "raise_exception": _raise_exception,
            "strftime_now": _strftime_now,
            "dict": dict,
            _LOOP_GUARD: _loop_budget,
            _CONCAT_GUARD: _concat_budget,
        }
    )
    env.template_class = _BudgetedJinja
    return env


def _environment_like(source: jinja2.Environment) -> _BudgetSandbox | None:
    """A budget sandbox configured as ``source`` (transformers' chat template environment): the
    same options, tests, policies and extensions (bound anew), its filters and globals with the
    budget's. None where ``source`` is not a plain immutable sandbox or escapes its output: the
    budget's class and its ``~`` (a plain join) would then render differently."""
    if type(source) is not ImmutableSandboxedEnvironment or source.autoescape or source.is_async:
        return None
    env = cast("_BudgetSandbox", source.overlay())
    # overlay() keeps the source's class; the budget's class adds only the checks of its calls and
    # operators, so the overlay's state is all it needs. Its dicts are copies: the source's
    # filters and globals stay as they were.
    env.__class__ = _BudgetSandbox
    env.filters = {name: _budgeted_filter(name, fn) for name, fn in source.filters.items()}
    env.globals = {**source.globals, _LOOP_GUARD: _loop_budget, _CONCAT_GUARD: _concat_budget}
    env.template_class = _BudgetedJinja
    return env


class BudgetedTemplate:
    """One chat template compiled into the budget sandbox; ``like``: made like that environment
    where it can be (see `_environment_like`)."""

    def __init__(self, text: str, like: jinja2.Environment | None = None) -> None:
        made_like = _environment_like(like) if like is not None else None
        # Whether it renders as ``like`` would (else in the documented options and globals).
        self.like = made_like is not None
        env = _environment() if made_like is None else made_like
        tree = _Instrument().visit(env.parse(text))
        tree.set_environment(env)
        self.template: jinja2.Template = env.from_string(tree)

    def render(self, variables: Mapping[str, Any]) -> str:
        """The rendered text; `InvalidRowError` when it goes over a budget, the template's own errors
        otherwise."""
        return self.template.render(**variables)


# transformers' template compile, wrapped (see the module's docstring).
_HOOKED_MODULE = "transformers.utils.chat_template_utils"
_HOOKED_FUNCTION = "_compile_jinja_template"

Lookup = Callable[[str], jinja2.Template]


@dataclass
class Serving:
    """One `serving` block: its lookup, and whether transformers asked it for a template."""

    lookup: Lookup
    served: bool = False


_SERVING: contextvars.ContextVar[Serving | None] = contextvars.ContextVar("template_serving", default=None)
_HOOK_LOCK = threading.Lock()
# transformers' own compile, once `install_hook` has found it; None before, or where it is missing.
_original: Callable[[str], Any] | None = None
_installed: bool | None = None


def _hooked(chat_template: str) -> Any:
    current = _SERVING.get()
    if current is None:
        assert _original is not None  # installed before it can be called
        return _original(chat_template)
    current.served = True
    return current.lookup(chat_template)


def install_hook() -> bool:
    """Put the wrapper in transformers' path, once per process (idempotent, thread-safe). False
    where transformers has no such function to wrap."""
    global _original, _installed
    with _HOOK_LOCK:
        if _installed is None:
            module = importlib.import_module(_HOOKED_MODULE)
            original = getattr(module, _HOOKED_FUNCTION, None)
            if callable(original):
                _original = original
                setattr(module, _HOOKED_FUNCTION, _hooked)
                _installed = True
            else:
                _installed = False
        return _installed


def transformers_environment(chat_template: str) -> jinja2.Environment | None:
    """The environment transformers compiles ``chat_template`` in; None before `install_hook` or where
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
