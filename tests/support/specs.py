"""Job specs as clients submit them: the bundled tokenizer, the shipped R1 template and the
simulator's context length, then a test module's own defaults, then the test's overrides."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from datagen.prompts.tokenization import bundled_tokenizer_path, default_chat_template_path
from datagen.spec import JobSpec

__all__ = ["CLASS_LIMITS", "NO_CONTEXT_LEN", "SIM_CONTEXT_LEN", "job_spec", "make_spec", "spec_json"]

# The simulator's context length: what a job submitted before any worker has reported one gives.
SIM_CONTEXT_LEN = 32768
# No context length in the spec: the pre-flight checks take the servers', or refuse.
NO_CONTEXT_LEN: dict[str, Any] = {"context_len": None}
# Small class limits for the coordinator's API tests, where no worker runs.
CLASS_LIMITS: dict[str, Any] = {
    "short_max_new_tokens": 64,
    "long_max_new_tokens": 256,
    "long_threshold_tokens": 50,
}


def make_spec(*defaults: Mapping[str, Any], **overrides: Any) -> dict[str, Any]:
    """The spec as a dict: the bundled tokenizer, the shipped template and ``SIM_CONTEXT_LEN``
    (``context_len=None`` leaves it to what workers report), each of ``defaults`` on top in
    order, then ``overrides``."""
    values: dict[str, Any] = {
        "tokenizer": bundled_tokenizer_path(),
        "chat_template": str(default_chat_template_path()),
        "context_len": SIM_CONTEXT_LEN,
    }
    for layer in defaults:
        values.update(layer)
    values.update(overrides)
    return values


def job_spec(*defaults: Mapping[str, Any], **overrides: Any) -> JobSpec:
    """:func:`make_spec`, validated."""
    return JobSpec.model_validate(make_spec(*defaults, **overrides))


def spec_json(*defaults: Mapping[str, Any], **overrides: Any) -> str:
    """:func:`make_spec` as JSON: the ``spec`` form field of ``POST /jobs``."""
    return json.dumps(make_spec(*defaults, **overrides))
