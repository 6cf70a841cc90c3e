"""Job specs are typed strictly and bounded: what is refused, with a message naming the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from datagen.errors import InvalidSpecError
from datagen.spec import (
    MAX_KWARGS_DEPTH,
    SGLANG_TOOL_CALL_PARSERS,
    JobSpec,
    parse_spec_json,
    validate_spec,
)
from datagen_cli.specfile import load_spec_file, merge_spec
from simulator.sglang.function_call import SUPPORTED_PARSERS


def _nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(depth):
        value = {"a": value}
    return value


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"short_max_new_tokens": "100"}, "short_max_new_tokens: Input should be a valid integer"),
        ({"short_max_new_tokens": True}, "short_max_new_tokens: Input should be a valid integer"),
        ({"samples": 2.0}, "samples: Input should be a valid integer"),
        ({"trust_remote_code": "true"}, "trust_remote_code: Input should be a valid boolean"),
        ({"trust_remote_code": 1}, "trust_remote_code: Input should be a valid boolean"),
        ({"sampling": {"temperature": "0.5"}}, "sampling.temperature: Input should be a valid number"),
        ({"sampling": {"top_k": 2**70}}, "sampling.top_k: Input should be less than or equal to"),
        ({"sampling": {"top_k": "5"}}, "sampling.top_k: Input should be a valid integer"),
        ({"sampling": {"sampling_seed": 2**64}}, "sampling.sampling_seed"),
        ({"sampling": {"stop_token_ids": [-1]}}, "sampling.stop_token_ids.0"),
        ({"vocab_size": 10**30}, "vocab_size: Input should be less than or equal to"),
        ({"tokenizer": "/models/x\x00"}, "tokenizer: Value error, must not contain a NUL byte"),
        ({"chat_template": "t.jinja\x00"}, "chat_template: Value error, must not contain a NUL byte"),
        ({"tokenizer": "/models/\ud800"}, "tokenizer"),
        ({"partitions": ["chat", ""]}, "partitions.1"),
        ({"chat_template_kwargs": _nested(500)}, f"nested more than {MAX_KWARGS_DEPTH} levels deep"),
        ({"chat_template_kwargs": {"big": "x" * 70_000}}, "keep the template variables under"),
        ({"chat_template_kwargs": {"n": 10**30}}, "chat_template_kwargs: Value error, n: integers"),
        ({"chat_template_kwargs": {"s": "a\x00b"}}, "NUL byte"),
        ({"chat_template_kwargs": {"f": float("nan")}}, "must be finite"),
    ],
)
def test_strict_fields_refuse_what_they_used_to_coerce(overrides: dict[str, Any], fragment: str) -> None:
    with pytest.raises(InvalidSpecError, match=r"^invalid job spec: ") as info:
        validate_spec({"tokenizer": "/models/x", **overrides})
    assert fragment in str(info.value)


def test_numbers_of_the_right_kind_still_pass() -> None:
    spec = validate_spec(
        {
            "tokenizer": "/models/x",
            "sampling": {"temperature": 1, "top_k": 1_048_576, "sampling_seed": 2**63 - 1},
            "weight": 2,
            "chat_template_kwargs": _nested(MAX_KWARGS_DEPTH - 1) | {"thinking": True},
        }
    )
    assert spec.sampling.temperature == 1.0 and isinstance(spec.sampling.temperature, float)
    assert spec.sampling.top_k == 1_048_576
    # A stored spec reads back as it was validated.
    assert JobSpec.model_validate_json(spec.model_dump_json()) == spec


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        ("[" * 100_000, "nested too deeply"),
        ('{"tokenizer": "x", "vocab_size": 1' + "0" * 5000 + "}", "over 4,300 digits"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "Input should be a valid dictionary"),
    ],
)
def test_spec_text_that_cannot_be_parsed_is_an_invalid_spec(raw: str, fragment: str) -> None:
    with pytest.raises(InvalidSpecError, match=fragment):
        parse_spec_json(raw)


def test_yaml_spec_files_still_give_plain_ints_and_floats(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(
        "tokenizer: /models/x\nshort_max_new_tokens: 100\nsampling: {temperature: 1, top_k: 20}\n"
    )
    merged = merge_spec(load_spec_file(path), {})
    assert JobSpec.model_validate(merged).short_max_new_tokens == 100


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (bytes(range(256)), "is not UTF-8 text (byte 128); give a YAML or JSON spec file"),
        (b"tokenizer: x\nvocab_size: 1" + b"0" * 5000 + b"\n", "keep it to plain fields"),
        (b"[" * 100_000, "cannot read job spec"),
        (
            b"tokenizer: x\nshort_max_new_tokens: '100'\n",
            "short_max_new_tokens: Input should be a valid integer",
        ),
    ],
)
def test_unreadable_spec_files_are_one_line_errors(tmp_path: Path, content: bytes, fragment: str) -> None:
    path = tmp_path / "job.yaml"
    path.write_bytes(content)
    with pytest.raises(InvalidSpecError) as info:
        merge_spec(load_spec_file(path), {})
    assert fragment in str(info.value) and "\n" not in str(info.value).strip()


def test_an_example_spec_field_round_trips_as_json() -> None:
    example = json.loads(JobSpec(tokenizer="/models/x").model_dump_json())
    assert validate_spec(example) == JobSpec(tokenizer="/models/x")


def test_tool_fields_name_a_parser_and_need_all_mode() -> None:
    spec = validate_spec({"tokenizer": "t", "multi_turn": "all", "tool_call_parser": "qwen25"})
    assert (spec.tool_call_parser, spec.tool_mismatch) == ("qwen25", "stop")
    with pytest.raises(
        InvalidSpecError, match=r"tool_call_parser reads regenerated turns.*set multi_turn: all"
    ):
        validate_spec({"tokenizer": "t", "tool_call_parser": "qwen25"})
    with pytest.raises(InvalidSpecError, match="tool_call_parser"):
        validate_spec({"tokenizer": "t", "multi_turn": "all", "tool_call_parser": "qwen 25"})
    with pytest.raises(InvalidSpecError, match="tool_mismatch"):
        validate_spec({"tokenizer": "t", "multi_turn": "all", "tool_mismatch": "ignore"})


@pytest.mark.parametrize("parser", ["nosuchparser", "Qwen25", "qwen25 ", "x" * 5000])
def test_a_tool_call_parser_sglang_does_not_know_is_refused_in_one_line_naming_the_known_ones(
    parser: str,
) -> None:
    # SGLang answers an unknown parser with a 500 at /parse_function_call: every conversation of
    # the job would stop after its first turn, so the submit is refused instead (issue 36).
    with pytest.raises(InvalidSpecError) as refused:
        validate_spec({"tokenizer": "t", "multi_turn": "all", "tool_call_parser": parser})
    message = str(refused.value)
    assert "\n" not in message and len(message) < 1000, message
    assert "tool_call_parser" in message and "is not a tool-call parser SGLang knows" in message
    assert ", ".join(sorted(SGLANG_TOOL_CALL_PARSERS)) in message


def test_every_parser_the_simulator_implements_is_one_sglang_knows() -> None:
    assert set(SUPPORTED_PARSERS) <= SGLANG_TOOL_CALL_PARSERS
    for parser in sorted(SGLANG_TOOL_CALL_PARSERS):
        spec = validate_spec({"tokenizer": "t", "multi_turn": "all", "tool_call_parser": parser})
        assert spec.tool_call_parser == parser


def test_a_spec_without_features_is_stored_as_before_features_existed() -> None:
    """Workers of the previous release forbid unknown spec fields: a job without features must not
    carry the key, so they still run it while a fleet is upgraded."""
    plain = validate_spec({"tokenizer": "t"})
    assert "features" not in json.loads(plain.model_dump_json())
    with_features = validate_spec({"tokenizer": "t", "features": {"layers": [9, 2]}})
    stored = json.loads(with_features.model_dump_json())
    assert stored["features"] == {
        "layers": [2, 9],
        "dtype": "bf16",
        "capture_only": False,
        "retain_bytes": None,
    }
    assert validate_spec(stored) == with_features
