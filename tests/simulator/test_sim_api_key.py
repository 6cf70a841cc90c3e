"""The simulator's --api-key, as SGLang's: a bearer token everywhere but /health* and /metrics*."""

from __future__ import annotations

import pytest

from simulator import SimConfig
from tests.support.sim import SimFactory

KEY = "sk-sim-secret"
GENERATE = {"input_ids": [0, 5, 6], "sampling_params": {"max_new_tokens": 2}}


@pytest.mark.parametrize("path", ["/model_info", "/server_info", "/v1/models", "/get_model_info"])
async def test_protected_paths_want_the_bearer_key(sim: SimFactory, path: str) -> None:
    async with sim(api_key=KEY) as (client, _app):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            response = await client.get(path, headers=headers)
            assert (response.status_code, response.json()) == (401, {"error": "Unauthorized"})
        assert (await client.get(path, headers={"Authorization": f"Bearer {KEY}"})).status_code == 200


async def test_generate_wants_the_key_and_health_and_metrics_stay_open(sim: SimFactory) -> None:
    async with sim(api_key=KEY) as (client, _app):
        assert (await client.post("/generate", json=GENERATE)).status_code == 401
        authorized = await client.post("/generate", json=GENERATE, headers={"Authorization": f"Bearer {KEY}"})
        assert authorized.status_code == 200
        for path in ("/health", "/health_generate", "/metrics"):
            assert (await client.get(path)).status_code == 200


async def test_without_a_key_nothing_is_protected(sim: SimFactory) -> None:
    async with sim() as (client, _app):
        assert (await client.get("/model_info")).status_code == 200


def test_the_key_is_not_in_the_configs_repr() -> None:
    config = SimConfig(api_key=KEY)  # type: ignore[arg-type]
    assert KEY not in repr(config) and KEY not in str(config.model_dump())
