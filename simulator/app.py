"""One simulated engine, two HTTP contracts: ``SimConfig.api`` picks the front end that serves it.

A client detects its server's engine from how it answers, so each front end lives apart
(``simulator.sglang``, ``simulator.vllm``) and neither knows the other.
"""

from __future__ import annotations

from fastapi import FastAPI

from simulator.config import SimApi, SimConfig
from simulator.sglang import create_sglang_app
from simulator.vllm import create_vllm_app

__all__ = ["create_app"]


def create_app(config: SimConfig) -> FastAPI:
    """A FastAPI app simulating one server of ``config.api``; its engine runs inside the app lifespan."""
    if config.api is SimApi.VLLM:
        return create_vllm_app(config)
    return create_sglang_app(config)
