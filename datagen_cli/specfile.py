"""Job specs as files: ``datagen submit --spec job.yaml`` and ``datagen spec --example``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from datagen.errors import InvalidSpecError
from datagen.spec import validate_spec

__all__ = ["EXAMPLE_SPEC", "load_spec_file", "merge_spec"]

EXAMPLE_SPEC = """\
# eagle3-datagen job spec (YAML or JSON). Unknown keys are refused.
# Tokenizer: a path on the coordinator or a hub id; must be in DATAGEN_TOKENIZER_ALLOWLIST.
tokenizer: /models/DeepSeek-R1
# A chat template file that replaces the tokenizer's own (optional).
chat_template: null
# Runs code from the tokenizer's repository on the coordinator; needs DATAGEN_ALLOW_TRUST_REMOTE_CODE=1.
trust_remote_code: false
# Passed to the chat template as variables (e.g. thinking / enable_thinking).
chat_template_kwargs: {}
# Sampling parameters under SGLang's names (a vLLM server gets them under its own). max_new_tokens is
# set per class below.
sampling:
  temperature: 0.6
  top_p: 0.95
  top_k: -1
  min_p: 0.0
  repetition_penalty: 1.0
  sampling_seed: null        # a number makes outputs reproducible
  stop_token_ids: null       # extra stop ids, sent with the EOS of the tokenizer and generation_config.json
# Prompts with at least long_threshold_tokens tokens go to the long queue (or a row's "class").
short_max_new_tokens: 2048
long_max_new_tokens: 16384
long_threshold_tokens: 4096
# Context length in tokens; null: learnt from the servers.
context_len: null
# Only these partitions (a row's "partition"); null: all.
partitions: null
# last: regenerate the final assistant turn; all: every assistant turn, on-policy.
multi_turn: last
# all mode, tool calls: the server's SGLang tool-call parser (qwen25, deepseekv3, kimi_k2, ...) reads each
# regenerated turn's calls through POST /parse_function_call; null keeps the dataset's calls.
tool_call_parser: null
# When the model's calls differ from the dataset's (names or count): stop the conversation, or keep going
# with the dataset's tool results.
tool_mismatch: stop
# Generations per prompt (gen 0..N-1), seeds sampling_seed + gen; temperatures cycle over them.
samples: 1
temperatures: null
# Dispatch: all high work goes before normal, normal before low; within a priority, jobs share
# the fleet in proportion to their weights.
priority: normal
weight: 1.0
# Pre-flight: refuse the job unless the servers' /model_info shows this model_path and
# weight_version (null: any, as long as every server runs the same).
model_path: null
weight_version: null
# The model's vocabulary size, when no config.json lies next to the tokenizer (null: read it there).
vocab_size: null
# Rows whose content spells a special token's text (e.g. "<｜User｜>"): allow, warn (flag) or reject.
special_text: warn
# Drop repeated rows before any GPU time: off, exact (normalized prompt text) or near (MinHash of
# the user turns; near counts rows whose word-shingle similarity is at least dedup_threshold).
dedup: exact
dedup_threshold: 0.5
# Benchmark sets to keep out of the data: built-in names (humaneval) or absolute paths of JSONL files
# under DATAGEN_TOKENIZER_ALLOWLIST; a row sharing a run of decontaminate_n words with one is rejected.
decontaminate: []
decontaminate_n: 13
# The target's hidden states for every record, captured on vLLM capture servers (docs/user/features.md):
# null: tokens only. Else layers (vLLM ids, e.g. [2, 16, 29, 32]), dtype (bf16 or fp8), retain_bytes
# (stored features not yet consumed by `datagen pull --consume` at which capture waits; null: no budget)
# and capture_only (rows are token ids, {id, input_ids, loss_mask}: capture them, generate nothing).
features: null
# A mixture of modes in one job (null: one mode, the fields above). Each (prompt, sample) gets one arm:
# assign weighted (drawn by weight from seed and the row) or cycle (arm i mod k over the file's rows and
# samples). An arm's chat_template_kwargs and sampling go over the job's; records carry the arm's name.
# Arms whose variables differ must render different prompts: a variable the template ignores is refused.
# For example, three reasoning efforts (a template that reads reasoning_effort):
#   recipe:
#     assign: weighted
#     seed: 0
#     arms:
#       - name: low
#         weight: 1
#         chat_template_kwargs: {reasoning_effort: low}
#         sampling: {temperature: 0.6}
#       - name: medium
#         weight: 1
#         chat_template_kwargs: {reasoning_effort: medium}
#         sampling: {temperature: 0.8}
#       - name: high
#         weight: 2
#         chat_template_kwargs: {reasoning_effort: high}
#         sampling: {temperature: 1.0}
recipe: null
"""


def load_spec_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidSpecError(
            f"job spec {path} is not UTF-8 text (byte {exc.start}); give a YAML or JSON spec file"
        ) from exc
    except OSError as exc:
        raise InvalidSpecError(f"cannot read job spec {path}: {exc}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise InvalidSpecError(f"cannot read job spec {path}: {exc}") from exc
    except (RecursionError, ValueError) as exc:
        # Deep nesting or an integer too long to convert: PyYAML raises these past its own errors.
        raise InvalidSpecError(
            f"cannot read job spec {path}: {type(exc).__name__}: {str(exc)[:200]}; "
            "keep it to plain fields, numbers and short lists"
        ) from exc
    if not isinstance(data, dict):
        raise InvalidSpecError(f"job spec {path} must be a mapping of fields, not {type(data).__name__}")
    return data


def merge_spec(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """The spec file with command-line flags on top, validated as the coordinator will."""
    merged = dict(base)
    for key, value in overrides.items():
        if key == "sampling":
            merged["sampling"] = {**(merged.get("sampling") or {}), **value}
        else:
            merged[key] = value
    validate_spec(merged)
    return merged
