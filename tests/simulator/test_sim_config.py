from __future__ import annotations

import pytest
from pydantic import ValidationError

from simulator import SimConfig
from simulator.model import DEFAULT_MEAN_ANSWER_TOKENS, DEFAULT_MEAN_REASONING_TOKENS


def test_defaults_describe_an_h100_class_server() -> None:
    config = SimConfig()
    assert (config.host, config.port) == ("127.0.0.1", 30000)
    assert config.served_model_name == "sim/deepseek-r1"
    assert config.context_len == 32768
    assert config.max_total_num_tokens == 200_000
    assert config.reserve_fraction == 1.0
    assert config.time_scale == 1.0
    assert (config.fail_503_rate, config.fail_500_rate, config.abort_rate, config.starting_s) == (0, 0, 0, 0)
    assert config.mean_reasoning_tokens == DEFAULT_MEAN_REASONING_TOKENS
    assert config.mean_answer_tokens == DEFAULT_MEAN_ANSWER_TOKENS
    assert config.tokenizer_path is None


def test_limits_follow_sglang() -> None:
    config = SimConfig(context_len=1000, max_total_num_tokens=500)
    assert config.max_req_len == 499
    assert config.max_req_input_len == 494


def test_unknown_keys_and_bad_values_fail_loudly() -> None:
    with pytest.raises(ValidationError):
        SimConfig(prot=1)  # type: ignore[call-arg]
    with pytest.raises(ValidationError):
        SimConfig(reserve_fraction=1.5)
    with pytest.raises(ValidationError, match="must not exceed"):
        SimConfig(fail_503_rate=0.6, abort_rate=0.6)
