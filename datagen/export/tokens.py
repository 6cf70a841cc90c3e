"""A job's tokenizer as exports and the report need it: stop ids, think and tool-call ids, decoding.

The tokenizer and template come from the job manifest (``spec.tokenizer``, ``spec.chat_template``,
``spec.chat_template_kwargs``), so a record is read with the tokenizer that made it. A ``tokenizer``
override (the same files at another path, e.g. on a laptop) must hash to the manifest's
``tokenizer_sha256``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from datagen.errors import ConfigError
from datagen.prompts.preflight import GENERATION_CONFIG_NAME, read_stop_ids
from datagen.prompts.provenance import canonical_kwargs_json
from datagen.prompts.tokenization import PromptRenderer, get_renderer
from datagen.records.storage import Storage

__all__ = ["GENERATION_CONFIG_NAME", "TOOL_CALL_TOKENS", "JobTokens", "load_job_tokens", "read_stop_ids"]

# Tokens that open a tool call in the chat formats in use (DeepSeek, Qwen/Hermes, Mistral, Llama 3).
TOOL_CALL_TOKENS = (
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁call▁begin｜>",
    "<tool_call>",
    "[TOOL_CALLS]",
    "<|python_tag|>",
)


@dataclass(frozen=True)
class JobTokens:
    renderer: PromptRenderer
    eos_id: int | None
    think_start_id: int | None
    think_end_id: int | None
    stop_ids: frozenset[int]
    tool_call_ids: frozenset[int]

    @property
    def generation_prompt(self) -> list[int]:
        return self.renderer.generation_prompt_ids()

    def opens_think(self, prompt: np.ndarray) -> bool:
        """Whether the prompt leaves a think block open (R1's ``<think>\\n`` generation prompt), so
        the output starts with reasoning and should close it with the think-end token."""
        if self.think_start_id is None:
            return False
        starts = np.flatnonzero(prompt == self.think_start_id)
        if not starts.size:
            return False
        if self.think_end_id is None:
            return True
        return not bool(np.any(prompt[starts[-1] :] == self.think_end_id))

    def is_tool_call(self, output: np.ndarray) -> bool:
        return bool(self.tool_call_ids) and bool(np.isin(output, list(self.tool_call_ids)).any())

    def decode_many(
        self, sequences: Sequence[Sequence[int] | np.ndarray], *, skip_special_tokens: bool
    ) -> list[str]:
        """Decode a batch at once: the Rust backend decodes in parallel. Falls back to one by one
        where transformers' decode does more than the backend (clean-up of tokenization spaces)."""
        tokenizer: Any = self.renderer.tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        lists = [s.tolist() if isinstance(s, np.ndarray) else list(s) for s in sequences]
        if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
            return list(backend.decode_batch(lists, skip_special_tokens=skip_special_tokens))
        return [self.renderer.decode(s, skip_special_tokens=skip_special_tokens) for s in lists]


def _tool_call_ids(renderer: PromptRenderer) -> frozenset[int]:
    tokenizer: Any = renderer.tokenizer
    vocab_ids = set()
    for token in TOOL_CALL_TOKENS:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if isinstance(token_id, int) and token_id != getattr(tokenizer, "unk_token_id", None):
            vocab_ids.add(token_id)
    return frozenset(vocab_ids)


def load_job_tokens(storage: Storage, job_id: str, tokenizer: str | None = None) -> JobTokens:
    """The job's renderer and token ids, from its manifest; ``tokenizer`` overrides the path."""
    manifest = storage.read_manifest(job_id)
    if manifest is None or not isinstance(manifest.get("spec"), dict):
        raise ConfigError(
            f"job {job_id} has no manifest with a spec under {storage.url(job_id)}; "
            "this format and the report need the job's tokenizer"
        )
    spec = manifest["spec"]
    renderer = get_renderer(
        tokenizer or spec["tokenizer"],
        spec.get("chat_template"),
        bool(spec.get("trust_remote_code", False)),
        canonical_kwargs_json(spec.get("chat_template_kwargs")),
    )
    expected = (manifest.get("tokenizer") or {}).get("tokenizer_sha256")
    actual = renderer.identity()["tokenizer_sha256"]
    if expected and expected != actual:
        raise ConfigError(
            f"the tokenizer at {renderer.tokenizer_name} is not the one job {job_id} was made with "
            f"(sha256 {actual[:12]} != {expected[:12]}); pass --tokenizer with the job's tokenizer files"
        )
    special = renderer.special_ids()
    return JobTokens(
        renderer=renderer,
        eos_id=special.eos_id,
        think_start_id=special.think_start_id,
        think_end_id=special.think_end_id,
        stop_ids=read_stop_ids(renderer.tokenizer_name, special.eos_id),
        tool_call_ids=_tool_call_ids(renderer),
    )
