"""A recipe's arms must render apart: the one rule that submit and the dry run apply
(`datagen.prompts.preflight.preflight_submit`).

Arms exist to run prompts in different modes. Two arms whose template variables differ (the job's
``chat_template_kwargs`` with each arm's over them, `JobSpec.template_kwargs`) but whose prompts
render to the same ids would record two labels for one mode: the chat template ignores the
variables where they differ (a misspelt ``reasoning_effort``, a Qwen3 variable given to an R1
template). That is refused before anything is enqueued, with both arms and those variables named.

Arms with equal variables (differing only in sampling) render alike by design and are not compared.
With one arm, or none, there is nothing to compare.

The renderings compared are of fixed probe conversations, not of the dataset's rows, so a submit
and a dry run of the same spec always agree: a system prompt with a user turn, a multi-turn
conversation, and a user turn with a tool. Arms differ when any probe renders differently; a probe
that one arm's template cannot render counts as a difference, one that no arm renders is skipped.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from datagen.errors import DatagenError, PreflightError
from datagen.prompts.provenance import canonical_kwargs_json
from datagen.prompts.tokenization import PromptRenderer, renderer_for
from datagen.spec import Arm, JobSpec

__all__ = ["PROBES", "Probe", "check_arms_render_apart", "differing_keys"]

Probe = tuple[list[dict[str, Any]], list[dict[str, Any]] | None]

# Conversations (messages, tools) that show what a template does with its variables: where a
# system prompt goes, earlier assistant turns, tool definitions.
PROBES: tuple[Probe, ...] = (
    (
        [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Hello."},
        ],
        None,
    ),
    (
        [
            {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "4."},
            {"role": "user", "content": "And 3 + 3?"},
        ],
        None,
    ),
    (
        [{"role": "user", "content": "What is the weather in Paris?"}],
        [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": "The current weather in a city.",
                    "parameters": {
                        "type": "object",
                        "properties": {"city": {"type": "string"}},
                        "required": ["city"],
                    },
                },
            }
        ],
    ),
)
# A variable's value, as the refusal shows it, is cut at this many characters.
SHOWN_VALUE_CHARS = 40
_UNSET = object()

# What a probe rendered to under one arm: its ids, or None where the template refused it.
Rendering = tuple[tuple[int, ...] | None, ...]


def differing_keys(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    """The variables set to different values in ``a`` and ``b`` (set in one only included)."""
    return sorted(key for key in a.keys() | b.keys() if a.get(key, _UNSET) != b.get(key, _UNSET))


def _rendering(renderer: PromptRenderer, probes: Sequence[Probe]) -> Rendering:
    found: list[tuple[int, ...] | None] = []
    for messages, tools in probes:
        try:
            found.append(tuple(renderer.render(messages, tools)))
        except DatagenError:  # e.g. a template that takes no system prompt, or no tools
            found.append(None)
    return tuple(found)


def _alike(a: Rendering, b: Rendering) -> bool:
    """Whether two arms' renderings show no difference: equal wherever either rendered, and some
    probe rendered (with none rendered, nothing is known)."""
    return any(x is not None for x in a) and a == b


def _shown(kwargs: Mapping[str, Any], key: str) -> str:
    if key not in kwargs:
        return "unset"
    text = json.dumps(kwargs[key], ensure_ascii=False, sort_keys=True)
    return text if len(text) <= SHOWN_VALUE_CHARS else text[: SHOWN_VALUE_CHARS - 1] + "…"


def check_arms_render_apart(
    spec: JobSpec,
    renderers: Callable[[Arm], PromptRenderer] | None = None,
    probes: Sequence[Probe] = PROBES,
) -> None:
    """Refuse (`PreflightError`) two arms whose variables differ but whose prompts render alike.

    ``renderers``: an arm's renderer (`renderer_for` unless given); one render per probe and
    distinct set of variables.
    """
    if spec.recipe is None or len(spec.recipe.arms) < 2:
        return
    render_arm = renderers or (lambda arm: renderer_for(spec, arm))
    # One arm per distinct set of variables, the first of the recipe's order.
    firsts: dict[str, Arm] = {}
    for arm in spec.recipe.arms:
        firsts.setdefault(canonical_kwargs_json(spec.template_kwargs(arm)), arm)
    seen: list[tuple[Arm, Rendering]] = []
    for arm in firsts.values():
        rendering = _rendering(render_arm(arm), probes)
        for other, earlier in seen:
            if _alike(earlier, rendering):
                _refuse(spec, other, arm)
        seen.append((arm, rendering))


def _refuse(spec: JobSpec, first: Arm, second: Arm) -> None:
    a, b = spec.template_kwargs(first), spec.template_kwargs(second)
    keys = ", ".join(f"{key} ({_shown(a, key)} vs {_shown(b, key)})" for key in differing_keys(a, b))
    raise PreflightError(
        f'recipe: arms "{first.name}" and "{second.name}" render the same prompt ids: the chat template '
        f"ignores the difference in {keys}; use the variable the template reads, or drop one arm"
    )
