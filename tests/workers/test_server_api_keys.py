"""Per-server API keys: settings, the worker against simulators (SGLang, vLLM) started with --api-key."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest
import redis

from datagen.control.keys import Keys
from datagen.errors import ConfigError
from datagen.records.storage import Storage
from datagen.settings import WorkerSettings, load
from tests.support.ingest import ingest_rows
from tests.support.sim import running_simulator
from tests.support.specs import job_spec
from tests.support.workers import fast_worker_settings
from workers.fleet.servers import ServerSpec, with_api_keys
from workers.worker import Worker

NS = "keys"
KEY_S0 = "sk-s0-7f3a9c"
KEY_S1 = "sk-s1-b21e44"
GLOBAL_KEY = "sk-global-5d0c18"
SECRETS = (KEY_S0, KEY_S1, GLOBAL_KEY)


# -- settings ---------------------------------------------------------------------------------


def test_keys_come_from_the_list_and_the_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text(f"# per-server keys\n\n  s1 = {KEY_S1}\n", "utf-8")
    monkeypatch.setenv("DATAGEN_SERVER_API_KEYS", f"s0={KEY_S0}")
    monkeypatch.setenv("DATAGEN_SERVER_API_KEYS_FILE", str(key_file))
    monkeypatch.setenv("DATAGEN_API_KEY", GLOBAL_KEY)
    settings = load(WorkerSettings)
    keys = settings.server_keys()
    assert {name: key.get_secret_value() for name, key in keys.items()} == {"s0": KEY_S0, "s1": KEY_S1}
    specs = with_api_keys(ServerSpec.parse_many(["s0=http://h:1,s1=http://h:2,s2=http://h:3"]), keys)
    assert [s.api_key.get_secret_value() if s.api_key else None for s in specs] == [KEY_S0, KEY_S1, None]
    shown = repr(settings) + repr(specs) + str(settings.model_dump())
    assert not any(secret in shown for secret in SECRETS)


def test_a_key_for_an_unknown_server_is_refused_at_startup() -> None:
    settings = WorkerSettings(server_api_keys=f"s0={KEY_S0},typo={KEY_S1}")  # type: ignore[arg-type]
    with pytest.raises(ConfigError) as refused:
        with_api_keys(ServerSpec.parse_many(["s0=http://h:1", "s1=http://h:2"]), settings.server_keys())
    message = str(refused.value)
    assert "unknown server(s) typo; this worker's servers are s0, s1" in message
    assert KEY_S1 not in message


@pytest.mark.parametrize(
    ("value", "problem"),
    [(KEY_S0, "entry 1 is not NAME=KEY"), (f"s0={KEY_S0},s0={KEY_S1}", "server s0 already has an API key")],
)
def test_malformed_keys_are_refused_without_showing_them(value: str, problem: str) -> None:
    settings = WorkerSettings(server_api_keys=value)  # type: ignore[arg-type]
    with pytest.raises(ConfigError) as refused:
        settings.server_keys()
    assert problem in str(refused.value)
    assert not any(secret in str(refused.value) for secret in SECRETS)


def test_an_unreadable_key_file_is_refused(tmp_path: Path) -> None:
    settings = WorkerSettings(server_api_keys_file=tmp_path / "missing")
    with pytest.raises(ConfigError, match="cannot read DATAGEN_SERVER_API_KEYS_FILE"):
        settings.server_keys()


# -- a worker against two servers with different keys ----------------------------------------


SPEC_DEFAULTS: dict[str, Any] = {"context_len": None, "short_max_new_tokens": 32, "long_max_new_tokens": 32}


async def _run(settings: WorkerSettings, urls: dict[str, str]) -> Worker:
    specs = with_api_keys([ServerSpec(name, url) for name, url in urls.items()], settings.server_keys())
    worker = Worker(settings, specs, burst=True, install_signal_handlers=False)
    await worker.start()
    try:
        await asyncio.sleep(0.8)  # a few health probes
        if any(server.up for server in worker.fleet.servers):  # else burst would wait forever
            await worker.run()
    finally:
        await worker.drain()
        await worker.close()
    return worker


def _records(storage: Storage, job_id: str) -> list[dict[str, Any]]:
    return [row for batch in storage.iter_record_batches(job_id) for row in batch.to_pylist()]


@pytest.mark.parametrize("s1_api", ["sglang", "vllm"])
async def test_each_server_gets_its_key_and_a_wrong_key_keeps_the_worker_off(
    redis_client: redis.Redis,
    redis_url: str,
    storage: Storage,
    tokenizer_path: str,
    caplog: pytest.LogCaptureFixture,
    s1_api: str,
) -> None:
    caplog.set_level(logging.DEBUG)
    rows = [{"id": f"q{i}", "messages": [{"role": "user", "content": f"Question {i}"}]} for i in range(6)]
    ingest_rows(
        redis_client, storage, Keys(NS), "job1", job_spec(SPEC_DEFAULTS, tokenizer=tokenizer_path), rows
    )
    with (
        running_simulator(tokenizer_path=tokenizer_path, time_scale=0.0, api_key=KEY_S0) as url0,
        running_simulator(api=s1_api, tokenizer_path=tokenizer_path, time_scale=0.0, api_key=KEY_S1) as url1,
    ):
        # s0 has its own key; s1 falls back to the global key, which is not its key.
        settings = fast_worker_settings(
            redis_url, storage, NS, server_api_keys=f"s0={KEY_S0}", api_key=GLOBAL_KEY
        )
        worker = await _run(settings, {"s0": url0, "s1": url1})
        s0, s1 = worker.fleet.servers
        assert (s0.refused, s1.state) == (None, "refused")
        assert "got HTTP 401: Unauthorized" in str(s1.refused)
        assert "Check the API key of server s1" in str(s1.refused)
        assert {r["server"] for r in _records(storage, "job1")} == {"s0"}
        assert len(_records(storage, "job1")) == len(rows)
        refusals = [m for m in caplog.messages if m.startswith("server s1 refused:")]
        assert len(refusals) == 1  # logged once, though probed again and again

        # With the right default key, s1 is used too.
        ingest_rows(
            redis_client, storage, Keys(NS), "job2", job_spec(SPEC_DEFAULTS, tokenizer=tokenizer_path), rows
        )
        settings = fast_worker_settings(
            redis_url, storage, NS, server_api_keys=f"s0={KEY_S0}", api_key=KEY_S1
        )
        worker = await _run(settings, {"s0": url0, "s1": url1})
        assert [(s.refused, s.context_len) for s in worker.fleet.servers] == [(None, 32768), (None, 32768)]
        assert len(_records(storage, "job2")) == len(rows)
    assert not any(secret in caplog.text for secret in SECRETS)
