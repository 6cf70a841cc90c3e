"""Serve a simulator with uvicorn: ``run`` blocks, ``serve`` is awaitable."""

from __future__ import annotations

import asyncio
import socket
from typing import cast

import uvicorn
from fastapi import FastAPI

from simulator.app import create_app
from simulator.config import SimApi, SimConfig

__all__ = ["SHUTDOWN_GRACE_S", "SimServer", "describe", "run", "serve", "uvicorn_config"]

# How long a stopping simulator waits for its requests' responses before uvicorn cancels what is
# left. `SimServer` aborts every request first, so they answer at once; this bounds the rest (a
# request that came in meanwhile). uvicorn alone would wait for every open request (a long
# generation: minutes), and a simulator restarted on the same port would race the one stopping.
SHUTDOWN_GRACE_S = 1


def uvicorn_config(config: SimConfig) -> uvicorn.Config:
    """The uvicorn settings of one simulator; tests use it to run a server in a thread."""
    return uvicorn.Config(
        create_app(config),
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        access_log=False,
        ws="none",  # no websocket routes; also keeps the websockets package unimported
        # One HTTP/1.1 keep-alive connection per client worker; idle ones are closed late so
        # pooled clients rarely race a server-side close.
        timeout_keep_alive=30,
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
    )


# The route each API generates on (the one line a started simulator logs names it).
_GENERATE_ROUTE = {SimApi.SGLANG: "/generate", SimApi.VLLM: "/v1/completions"}


def describe(config: SimConfig, url: str) -> str:
    """The line a simulator logs once it listens: where, which API, and what it simulates."""
    tokenizer = config.tokenizer_path or "none (DeepSeek's special ids)"
    return (
        f"simulator listening on {url}: the {config.api.value} API ({_GENERATE_ROUTE[config.api]}, "
        f"/health, /metrics), model {config.served_model_name}, context length {config.context_len}, "
        f"KV tokens {config.max_total_num_tokens}, time scale {config.time_scale:g}, tokenizer {tokenizer}"
    )


class SimServer(uvicorn.Server):
    """uvicorn's server for a simulator: stopping, it first aborts every request in flight (each
    answers at once with an abort, as after SGLang's ``/abort_request``), so that the shutdown
    takes a fraction of a second instead of waiting for generations to end."""

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        app = cast(FastAPI, self.config.app)
        app.state.sim.engine.abort("", abort_all=True)
        await super().shutdown(sockets=sockets)


def run(config: SimConfig) -> None:
    """Serve until interrupted (Ctrl-C or SIGTERM)."""
    SimServer(uvicorn_config(config)).run()


async def serve(config: SimConfig) -> None:
    """Serve on the running event loop; cancelling the caller shuts the server down cleanly.

    uvicorn skips its shutdown (closing sockets, the app lifespan) when ``serve`` itself is
    cancelled, so the server runs in its own task and is asked to exit instead.
    """
    server = SimServer(uvicorn_config(config))
    task = asyncio.create_task(server.serve(), name="simulator-uvicorn")
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        server.should_exit = True
        await task
        raise
