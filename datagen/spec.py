"""The job spec a user submits with a dataset: tokenizer, template, sampling and class rules."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from datagen.states import MultiTurnMode, Priority, PromptClass, SpecialTextPolicy

__all__ = ["MAX_NEW_TOKENS_LIMIT", "JobSpec", "SamplingParams"]

# Far above any context length in use; it only stops absurd values at the door.
MAX_NEW_TOKENS_LIMIT = 1_048_576
DEFAULT_SHORT_MAX_NEW_TOKENS = 2048
DEFAULT_LONG_MAX_NEW_TOKENS = 16384
DEFAULT_LONG_THRESHOLD_TOKENS = 4096
MAX_SAMPLES = 64
MAX_WEIGHT = 1000.0


class SamplingParams(BaseModel):
    """A subset of SGLang's ``sampling_params`` under SGLang's exact names.

    ``max_new_tokens`` is not here: it is set per request from the prompt's class and the
    server's context length, never left to SGLang's default of 128.
    """

    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(default=0.6, ge=0.0, le=100.0)
    top_p: float = Field(default=0.95, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0)
    sampling_seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stop_token_ids: list[int] | None = Field(
        default=None,
        max_length=64,
        description="extra stop ids, sent with the tokenizer's and generation_config's",
    )

    @field_validator("top_k")
    @classmethod
    def _top_k_not_zero(cls, value: int) -> int:
        if value == 0:
            raise ValueError("top_k must be -1 (all tokens) or at least 1")
        return value

    def to_sglang(self, max_new_tokens: int) -> dict[str, Any]:
        params = self.model_dump(exclude_none=True)
        params["max_new_tokens"] = max_new_tokens
        return params


class JobSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tokenizer: str = Field(min_length=1, max_length=4096, description="local path or hub id")
    chat_template: str | None = Field(default=None, max_length=4096, description="template file path")
    trust_remote_code: bool = False
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    short_max_new_tokens: int = Field(default=DEFAULT_SHORT_MAX_NEW_TOKENS, ge=1, le=MAX_NEW_TOKENS_LIMIT)
    long_max_new_tokens: int = Field(default=DEFAULT_LONG_MAX_NEW_TOKENS, ge=1, le=MAX_NEW_TOKENS_LIMIT)
    long_threshold_tokens: int = Field(default=DEFAULT_LONG_THRESHOLD_TOKENS, ge=1, le=MAX_NEW_TOKENS_LIMIT)
    multi_turn: MultiTurnMode = MultiTurnMode.LAST
    context_len: int | None = Field(default=None, ge=2, le=MAX_NEW_TOKENS_LIMIT * 16)
    partitions: list[str] | None = Field(default=None, description="only these partitions; None = all")
    samples: int = Field(default=1, ge=1, le=MAX_SAMPLES, description="generations per prompt (gen 0..N-1)")
    temperatures: list[float] | None = Field(
        default=None, min_length=1, max_length=MAX_SAMPLES, description="per-gen temperatures, cycled"
    )
    priority: Priority = Field(
        default=Priority.NORMAL, description="high work is dispatched before normal, then low"
    )
    weight: float = Field(
        default=1.0, gt=0.0, le=MAX_WEIGHT, description="share of the fleet among jobs of the same priority"
    )
    model_path: str | None = Field(
        default=None,
        max_length=4096,
        description="refuse the job unless the servers' /model_info has this model_path",
    )
    weight_version: str | None = Field(
        default=None, max_length=256, description="refuse the job unless the servers run this weight_version"
    )
    vocab_size: int | None = Field(
        default=None,
        ge=1,
        description="the model's vocabulary size, when no config.json lies by the tokenizer",
    )

    special_text: SpecialTextPolicy = Field(
        default=SpecialTextPolicy.WARN,
        description="rows whose content spells a special token's text: allow, warn (flag), reject",
    )

    @field_validator("temperatures")
    @classmethod
    def _valid_temperatures(cls, value: list[float] | None) -> list[float] | None:
        if value is not None and any(not 0.0 <= t <= 100.0 for t in value):
            raise ValueError("temperatures must each be between 0 and 100")
        return value

    def sampling_for(self, gen: int, max_new_tokens: int) -> dict[str, Any]:
        """SGLang ``sampling_params`` of sample ``gen``: distinct seeds, the gen's temperature."""
        params = self.sampling.to_sglang(max_new_tokens)
        if self.temperatures:
            params["temperature"] = self.temperatures[gen % len(self.temperatures)]
        if self.samples > 1:
            params["sampling_seed"] = (self.sampling.sampling_seed or 0) + gen
        return params

    def max_new_tokens(self, cls: PromptClass) -> int:
        return self.short_max_new_tokens if cls is PromptClass.SHORT else self.long_max_new_tokens

    def classify(self, prompt_len: int, row_class: PromptClass | None) -> PromptClass:
        if row_class is not None:
            return row_class
        return PromptClass.LONG if prompt_len >= self.long_threshold_tokens else PromptClass.SHORT
