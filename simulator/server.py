"""Serve a simulator with uvicorn: ``run`` blocks, ``serve`` is awaitable."""

from __future__ import annotations

import asyncio

import uvicorn

from simulator.app import create_app
from simulator.config import SimConfig

__all__ = ["run", "serve", "uvicorn_config"]


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
    )


def run(config: SimConfig) -> None:
    """Serve until interrupted (Ctrl-C or SIGTERM)."""
    uvicorn.Server(uvicorn_config(config)).run()


async def serve(config: SimConfig) -> None:
    """Serve on the running event loop; cancelling the caller shuts the server down cleanly.

    uvicorn skips its shutdown (closing sockets, the app lifespan) when ``serve`` itself is
    cancelled, so the server runs in its own task and is asked to exit instead.
    """
    server = uvicorn.Server(uvicorn_config(config))
    task = asyncio.create_task(server.serve(), name="simulator-uvicorn")
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        server.should_exit = True
        await task
        raise
