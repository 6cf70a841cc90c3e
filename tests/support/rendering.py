"""What the tests ask of a renderer beyond the ids production uses: the prompt as text, rendered by
the same ``apply_chat_template`` call with the same template and kwargs, and forgetting the process's
shared renderers (as a restart would)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from datagen.prompts import tokenization
from datagen.prompts.loaders import read_template
from datagen.prompts.sources import SourceKind, resolve_source
from datagen.prompts.tokenization import PromptRenderer

__all__ = ["clear_renderer_cache", "render_text"]


def render_text(
    renderer: PromptRenderer,
    messages: Sequence[Mapping[str, object]],
    tools: Sequence[Mapping[str, object]] | None = None,
) -> str:
    """The rendered prompt as text, generation prompt included (`PromptRenderer.render` as text)."""
    path = renderer.chat_template_path
    template = read_template(resolve_source(path, SourceKind.TEMPLATE)) if path else None
    return str(
        renderer.tokenizer.apply_chat_template(
            [dict(m) for m in messages],
            tools=None if tools is None else [dict(t) for t in tools],
            add_generation_prompt=True,
            tokenize=False,
            return_dict=False,
            chat_template=template,
            **renderer.chat_template_kwargs,
        )
    )


def clear_renderer_cache() -> None:
    """Forget every cached renderer (`get_renderer`): a changed template file is read again on next
    use, as after a restart."""
    tokenization.forget_renderers()
