"""The simulator's one configuration model.

A plain pydantic model rather than settings: the simulator is started by the CLI or by tests,
which build it explicitly; nothing is read from the environment.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationInfo, field_validator, model_validator

from simulator.model import DEFAULT_MEAN_ANSWER_TOKENS, DEFAULT_MEAN_REASONING_TOKENS
from simulator.toolcalls import ToolCallFormat

__all__ = [
    "DEFAULT_CAPTURE_HIDDEN_SIZE",
    "DEFAULT_CAPTURE_NUM_LAYERS",
    "DEFAULT_CAPTURE_SLOW_WRITE_S",
    "DEFAULT_CAPTURE_WRITE_DELAY_MS",
    "DEFAULT_CLIP_MAX_NEW_TOKENS",
    "DEFAULT_CONTEXT_LEN",
    "DEFAULT_DECODE_STEP_BASE_S",
    "DEFAULT_DECODE_STEP_PER_REQ_S",
    "DEFAULT_HOST",
    "DEFAULT_MAX_PREFILL_TOKENS",
    "DEFAULT_MAX_RUNNING_REQUESTS",
    "DEFAULT_MAX_TOTAL_NUM_TOKENS",
    "DEFAULT_PORT",
    "DEFAULT_PREFILL_S_PER_TOKEN",
    "DEFAULT_REPORT_INTERVAL_S",
    "DEFAULT_SERVED_MODEL_NAME",
    "DEFAULT_WEIGHT_VERSION",
    "CaptureDtype",
    "SimApi",
    "SimConfig",
    "default_capture_layers",
]

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 30000  # SGLang's own default port
DEFAULT_SERVED_MODEL_NAME = "sim/deepseek-r1"
DEFAULT_CONTEXT_LEN = 32768
DEFAULT_MAX_TOTAL_NUM_TOKENS = 200_000
DEFAULT_RESERVE_FRACTION = 1.0
# SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION: admission never reserves more than this many output
# tokens per request, so long max_new_tokens do not starve the batch (and can cause retraction).
DEFAULT_CLIP_MAX_NEW_TOKENS = 4096
DEFAULT_MAX_RUNNING_REQUESTS = 256
DEFAULT_MAX_PREFILL_TOKENS = 16384  # SGLang's --max-prefill-tokens default
DEFAULT_TIME_SCALE = 1.0
# Roughly DeepSeek-R1 on 8xH100: ~20k prefill tok/s, ~50 tok/s for a lone decode stream,
# ~2k tok/s aggregate at batch 64.
DEFAULT_PREFILL_S_PER_TOKEN = 5e-5
DEFAULT_DECODE_STEP_BASE_S = 0.02
DEFAULT_DECODE_STEP_PER_REQ_S = 2e-4
DEFAULT_WEIGHT_VERSION = "default"  # SGLang's --weight-version default
DEFAULT_LOG_LEVEL = "warning"
# How often a simulator that served requests logs how many (`simulator.frontend`).
DEFAULT_REPORT_INTERVAL_S = 10.0
# Hidden-state capture (vLLM 0.33.0's extract_hidden_states method and file connector).
DEFAULT_CAPTURE_NUM_LAYERS = 32  # Llama-3.1-8B's layer count
DEFAULT_CAPTURE_HIDDEN_SIZE = 64  # small, so CI files stay a few KiB (a real 8B model has 4096)
# A real server writes on the engine step after the response; 0 would hide a client that skips the lock.
DEFAULT_CAPTURE_WRITE_DELAY_MS = 20.0
# A slow writer outlasts speculators' 10 s lock wait.
DEFAULT_CAPTURE_SLOW_WRITE_S = 12.0


class SimApi(StrEnum):
    """Whose HTTP contract the simulator speaks over its one simulated engine."""

    SGLANG = "sglang"
    VLLM = "vllm"


class CaptureDtype(StrEnum):
    """How a captured file stores ``hidden_states``."""

    BF16 = "bf16"  # vLLM's ExampleHiddenStatesConnector with a bf16 model
    FP8 = "fp8"  # speculators' FP8HiddenStatesConnector: float8_e4m3fn plus per-token scales


def default_capture_layers(num_layers: int) -> tuple[int, ...]:
    """speculators' layer ids for a target of ``num_layers`` layers: ``[2, N//2, N-3, N]``."""
    return (2, num_layers // 2, num_layers - 3, num_layers)


class SimConfig(BaseModel):
    """Everything one simulated server needs, whichever contract it speaks; unknown keys fail loudly."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    api: SimApi = SimApi.SGLANG
    host: str = DEFAULT_HOST
    port: int = Field(default=DEFAULT_PORT, ge=0, le=65535)
    served_model_name: str = DEFAULT_SERVED_MODEL_NAME
    weight_version: str = DEFAULT_WEIGHT_VERSION
    tokenizer_path: str | None = None
    log_level: str = DEFAULT_LOG_LEVEL
    report_interval_s: float = Field(default=DEFAULT_REPORT_INTERVAL_S, gt=0.0)
    # SGLang's --api-key: every path but /health* and /metrics* wants "Authorization: Bearer <key>".
    api_key: SecretStr | None = None
    # Appends one JSON line per accepted generation request (what it asked for); None: no log.
    request_log: Path | None = None

    context_len: int = Field(default=DEFAULT_CONTEXT_LEN, ge=16)
    max_total_num_tokens: int = Field(default=DEFAULT_MAX_TOTAL_NUM_TOKENS, ge=16)
    reserve_fraction: float = Field(default=DEFAULT_RESERVE_FRACTION, ge=0.0, le=1.0)
    clip_max_new_tokens: int = Field(default=DEFAULT_CLIP_MAX_NEW_TOKENS, ge=1)
    max_running_requests: int = Field(default=DEFAULT_MAX_RUNNING_REQUESTS, ge=1)
    max_prefill_tokens: int = Field(default=DEFAULT_MAX_PREFILL_TOKENS, ge=1)

    time_scale: float = Field(default=DEFAULT_TIME_SCALE, ge=0.0)
    prefill_s_per_token: float = Field(default=DEFAULT_PREFILL_S_PER_TOKEN, ge=0.0)
    decode_step_base_s: float = Field(default=DEFAULT_DECODE_STEP_BASE_S, ge=0.0)
    decode_step_per_req_s: float = Field(default=DEFAULT_DECODE_STEP_PER_REQ_S, ge=0.0)
    # How far the simulated clock may fall behind real time, caught up by the next steps: a sleep
    # ends late by the event loop's millisecond timer and the host's scheduling, which at short steps
    # slows the whole simulation unless later steps may catch up (bench/README.md measures it).
    # 0, the default the test suite is timed against: a late wake-up delays every later step.
    max_lag_s: float = Field(default=0.0, ge=0.0, le=1.0)

    mean_reasoning_tokens: float = Field(default=DEFAULT_MEAN_REASONING_TOKENS, ge=0.0)
    mean_answer_tokens: float = Field(default=DEFAULT_MEAN_ANSWER_TOKENS, ge=0.0)
    # Prompts that offer tools may get a call spelled in this format (None: never a call).
    tool_call_format: ToolCallFormat | None = None

    fail_503_rate: float = Field(default=0.0, ge=0.0, le=1.0)
    fail_500_rate: float = Field(default=0.0, ge=0.0, le=1.0)
    abort_rate: float = Field(default=0.0, ge=0.0, le=1.0)
    starting_s: float = Field(default=0.0, ge=0.0)

    # Hidden-state capture, on when capture_dir (the connector's shared_storage_path) is set.
    capture_dir: str | None = None
    capture_num_layers: int = Field(default=DEFAULT_CAPTURE_NUM_LAYERS, ge=1)
    # eagle_aux_hidden_state_layer_ids; None: speculators' default for capture_num_layers.
    capture_layers: tuple[int, ...] | None = None
    capture_hidden_size: int = Field(default=DEFAULT_CAPTURE_HIDDEN_SIZE, ge=1)
    capture_dtype: CaptureDtype = CaptureDtype.BF16
    capture_write_delay_ms: float = Field(default=DEFAULT_CAPTURE_WRITE_DELAY_MS, ge=0.0)
    capture_slow_write_s: float = Field(default=DEFAULT_CAPTURE_SLOW_WRITE_S, ge=0.0)
    # Capture faults: one uniform draw per request, so their bands must fit in [0, 1] together.
    capture_fault_5xx: float = Field(default=0.0, ge=0.0, le=1.0)
    capture_fault_nofile: float = Field(default=0.0, ge=0.0, le=1.0)
    capture_fault_truncate: float = Field(default=0.0, ge=0.0, le=1.0)
    capture_fault_short: float = Field(default=0.0, ge=0.0, le=1.0)
    capture_fault_slow: float = Field(default=0.0, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _check_fault_rates(self) -> Self:
        # The three faults share one uniform draw per request, so their bands must fit in [0, 1].
        if self.fail_503_rate + self.fail_500_rate + self.abort_rate > 1.0:
            raise ValueError("fail_503_rate + fail_500_rate + abort_rate must not exceed 1.0")
        return self

    @model_validator(mode="after")
    def _check_vllm_options(self) -> Self:
        if self.api is not SimApi.VLLM:
            return self
        # Faults and the warmup window are SGLang's shapes (503 bodies, /health 503); not simulated
        # for vLLM, whose port opens only once the engine is up.
        faults = {"fail_503_rate": self.fail_503_rate, "fail_500_rate": self.fail_500_rate}
        faults |= {"abort_rate": self.abort_rate, "starting_s": self.starting_s}
        given = sorted(name for name, value in faults.items() if value)
        if given:
            raise ValueError(f"{', '.join(given)} not simulated with api=vllm; leave them at 0")
        if self.context_len > self.max_total_num_tokens:
            # vLLM refuses to start when one max_model_len sequence does not fit the KV cache.
            raise ValueError("with api=vllm, context_len must not exceed max_total_num_tokens")
        return self

    @model_validator(mode="after")
    def _check_capture(self) -> Self:
        capture_options = sorted(
            name for name in self.model_fields_set if name.startswith("capture_") and name != "capture_dir"
        )
        if self.capture_dir is None:
            if capture_options:
                raise ValueError(f"{', '.join(capture_options)} need capture_dir (--capture-dir)")
            return self
        if self.api is not SimApi.VLLM:
            raise ValueError("hidden-state capture (capture_dir) is simulated only with api=vllm")
        if self.capture_layers is None:
            default = default_capture_layers(self.capture_num_layers)
            problem = _layer_problem(default, self.capture_num_layers)
            if problem:
                raise ValueError(f"the default layers {list(default)}: {problem}; give capture_layers")
        if sum(rate for _, rate in self.capture_fault_rates) > 1.0:
            raise ValueError("the capture_fault_* rates must not add up to more than 1.0")
        return self

    @field_validator("capture_layers", mode="before")
    @classmethod
    def _split_capture_layers(cls, value: Any) -> Any:
        # The command line and the config file spell the ids "2,16,29,32".
        if isinstance(value, str):
            return tuple(part.strip() for part in value.split(",")) if value.strip() else ()
        if isinstance(value, int):
            return (value,)
        return value

    @field_validator("capture_layers")
    @classmethod
    def _check_capture_layers(
        cls, value: tuple[int, ...] | None, info: ValidationInfo
    ) -> tuple[int, ...] | None:
        if value is not None:
            problem = _layer_problem(value, info.data.get("capture_num_layers", DEFAULT_CAPTURE_NUM_LAYERS))
            if problem:
                raise ValueError(problem)
        return value

    @field_validator("request_log")
    @classmethod
    def _check_request_log(cls, value: Path | None) -> Path | None:
        # Refused here, so that the command line says so in one line instead of failing at start.
        if value is None:
            return value
        if value.is_dir():
            raise ValueError(f"{value} is a directory; name a file to append request lines to")
        if not value.parent.is_dir():
            raise ValueError(f"the directory {value.parent} does not exist; create it or name another file")
        return value

    @field_validator("tool_call_format")
    @classmethod
    def _check_tool_calls(cls, value: ToolCallFormat | None, info: ValidationInfo) -> ToolCallFormat | None:
        # A field validator (not a model one) so the error names this field; tokenizer_path is
        # declared earlier, so it is in info.data when valid.
        if value is not None and not info.data.get("tokenizer_path"):
            raise ValueError(
                "needs a tokenizer (tokenizer_path, --tokenizer) to find the tools prompts offer"
            )
        return value

    @property
    def capture_layer_ids(self) -> tuple[int, ...]:
        """The captured layer ids in file order: ascending, each once."""
        given = self.capture_layers or default_capture_layers(self.capture_num_layers)
        return tuple(sorted(set(given)))

    @property
    def capture_fault_rates(self) -> tuple[tuple[str, float], ...]:
        """Each capture fault's name and rate, in the order their bands are laid out."""
        return (
            ("5xx", self.capture_fault_5xx),
            ("nofile", self.capture_fault_nofile),
            ("truncate", self.capture_fault_truncate),
            ("short", self.capture_fault_short),
            ("slow", self.capture_fault_slow),
        )

    @property
    def max_req_len(self) -> int:
        """Longest prompt+output a request may reach (SGLang's scheduler ``max_req_len``)."""
        return min(self.context_len - 1, self.max_total_num_tokens - 1)

    @property
    def max_req_input_len(self) -> int:
        """Longest prompt the scheduler accepts (``get_worker_info`` keeps 5 tokens spare)."""
        return self.max_req_len - 5


def _layer_problem(layer_ids: tuple[int, ...], num_layers: int) -> str | None:
    """Why vLLM would refuse these eagle_aux_hidden_state_layer_ids, or None.

    A real server refuses an empty list at start and fails on the first forward for a duplicate or
    an id past the last layer; the simulator refuses all three at start.
    """
    if not layer_ids:
        return "name at least one layer id (eagle_aux_hidden_state_layer_ids must not be empty)"
    twice = sorted({layer for layer in layer_ids if layer_ids.count(layer) > 1})
    if twice:
        return f"layer id {twice[0]} is given twice; vLLM captures each layer once"
    outside = [layer for layer in layer_ids if not 0 <= layer <= num_layers]
    if outside:
        return (
            f"layer id {outside[0]} is outside 0..{num_layers} (0 is the embeddings, {num_layers} the "
            "last layer; set capture_num_layers for a deeper model)"
        )
    return None
