"""Commands that run a long-lived process: ``coordinator``, ``worker`` and ``sim``.

Each imports its process's package (service, workers, simulator) inside the function, so importing
``datagen`` never imports them; pyproject.toml's import-linter contract names exactly these imports.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import logging
import socket
from collections.abc import Iterator
from typing import Annotated, Any

import typer
from pydantic import ValidationError

from datagen.errors import ConfigError
from datagen.settings import (
    DEFAULT_COORDINATOR_HOST,
    DEFAULT_COORDINATOR_PORT,
    DEFAULT_LONG_CONCURRENCY,
    DEFAULT_METRICS_PORT,
    DEFAULT_SHORT_CONCURRENCY,
    DEFAULT_STORAGE,
    CoordinatorSettings,
    WorkerSettings,
    describe_invalid,
    load,
)
from datagen.states import EngineChoice
from datagen_cli._app import app, examples

# Libraries that log every request at INFO; our own one-line-per-prompt log is enough.
_QUIET_LOGGERS = ("httpx", "rq.worker", "rq.queue")
REDIS_URL_HELP = "Redis URL, redis:// or rediss:// (this or DATAGEN_REDIS_URL is required)"
STORAGE_HELP = f"storage root: a directory or s3:// URL (DATAGEN_STORAGE, default {DEFAULT_STORAGE})"


def _logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in _QUIET_LOGGERS:
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger().level))


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@app.command(
    epilog=examples(
        "datagen coordinator --redis-url redis://127.0.0.1:6379/0",
        "DATAGEN_REDIS_URL=redis://10.0.0.2:6379/0 datagen coordinator --port 8001",
    )
)
def coordinator(
    host: Annotated[
        str | None,
        typer.Option(
            help=f"bind address (DATAGEN_HOST, default {DEFAULT_COORDINATOR_HOST}); "
            "one not loopback needs DATAGEN_API_TOKEN"
        ),
    ] = None,
    port: Annotated[
        int | None,
        typer.Option(help=f"port (DATAGEN_PORT, default {DEFAULT_COORDINATOR_PORT}; 0 = any free)"),
    ] = None,
    redis_url: Annotated[str | None, typer.Option(help=REDIS_URL_HELP)] = None,
    storage: Annotated[str | None, typer.Option(help=STORAGE_HELP)] = None,
) -> None:
    """Run the coordinator HTTP API.

    It waits for Redis and storage at startup.
    """
    import uvicorn

    from datagen.control.startup import claim_storage, connect_redis
    from datagen.records.storage import Storage
    from service.app import create_app

    settings = load(CoordinatorSettings, host=host, port=port, redis_url=redis_url, storage=storage)
    redis_url = settings.require_redis_url()
    if not _loopback(settings.host) and not settings.api_token and not settings.allow_insecure_bind:
        raise ConfigError(
            f"refusing to listen on {settings.host} without DATAGEN_API_TOKEN; set a token, "
            "or DATAGEN_ALLOW_INSECURE_BIND=1 if a proxy in front does authentication"
        )
    _logging(settings.log_level)
    # The port first: a port in use is one line at once, not after the wait for Redis. Until the
    # server starts, connections to it are refused.
    with _listener(settings.host, settings.port, "--port (DATAGEN_PORT)") as sock:
        # Before the server starts, so that a refusal is one line rather than a failed startup.
        connect_redis(redis_url, settings.startup_timeout_s).close()
        claim_storage(Storage(settings.storage), settings.namespace, settings.startup_timeout_s)
        config = uvicorn.Config(
            create_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level.lower()
        )
        server = uvicorn.Server(config)
        server.run(sockets=[sock])
    if not server.started:
        raise ConfigError("the coordinator did not start; its log above says why")


@contextlib.contextmanager
def _listener(host: str, port: int, option: str) -> Iterator[socket.socket]:
    """A socket bound to ``host:port`` (uvicorn listens on it), or a `ConfigError` naming ``option``."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio turns Nagle off only on connections whose protocol says TCP, and
    # with Nagle on every response over a kept-alive connection waits ~40 ms for a delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"port {port} on {host} is in use (is another one already running?); choose another "
                    f"{option}, or stop the process that listens there"
                ) from exc
            raise ConfigError(
                f"cannot listen on {host}:{port}: {exc.strerror or exc}; check {option}"
            ) from exc
        yield sock
    finally:
        sock.close()


@app.command(
    epilog=examples(
        "datagen worker --server g0=http://gpu0:30000 --server g1=http://gpu1:30000",
        "datagen worker --server http://127.0.0.1:30000 --burst --metrics-port 0",
        "datagen worker --server g0=http://gpu0:30000 --server vllm+http://gpu1:8000",
    )
)
def worker(
    server: Annotated[
        list[str] | None,
        typer.Option(
            metavar="<[name=]url>",
            help="SGLang or vLLM server, NAME=URL or URL; a vllm+http:// or sglang+http:// URL names "
            "its engine; repeatable (DATAGEN_SERVERS, comma-separated). No user:password@, ?query "
            "or #fragment: a server's key goes in DATAGEN_SERVER_API_KEYS",
        ),
    ] = None,
    engine: Annotated[
        EngineChoice | None,
        typer.Option(
            help="the servers' engine: sglang, vllm, or auto = ask each server (DATAGEN_ENGINE, "
            "default auto); a URL's vllm+ or sglang+ prefix wins"
        ),
    ] = None,
    short_concurrency: Annotated[
        int | None,
        typer.Option(
            help=f"in-flight short prompts per server (DATAGEN_SHORT_CONCURRENCY, default "
            f"{DEFAULT_SHORT_CONCURRENCY})"
        ),
    ] = None,
    long_concurrency: Annotated[
        int | None,
        typer.Option(
            help=f"in-flight long prompts per server (DATAGEN_LONG_CONCURRENCY, default "
            f"{DEFAULT_LONG_CONCURRENCY})"
        ),
    ] = None,
    metrics_port: Annotated[
        int | None,
        typer.Option(
            help=f"Prometheus port, 0 = off (DATAGEN_METRICS_PORT; default: the first free one from "
            f"{DEFAULT_METRICS_PORT})"
        ),
    ] = None,
    burst: Annotated[
        bool,
        typer.Option(show_default=False, help="exit when the queues are empty (default: run until stopped)"),
    ] = False,
    redis_url: Annotated[str | None, typer.Option(help=REDIS_URL_HELP)] = None,
    storage: Annotated[str | None, typer.Option(help=STORAGE_HELP)] = None,
) -> None:
    """Run a worker: queued prompts to SGLang or vLLM, records to storage.

    It sends the queued prompts to its SGLang or vLLM servers (each server's engine is asked of
    the server unless --engine or its URL names it) and stores the records; it waits for Redis
    and storage at startup.
    """
    from workers.fleet.servers import ServerSpec, with_api_keys
    from workers.worker import Worker

    settings = load(
        WorkerSettings,
        engine=engine,
        short_concurrency=short_concurrency,
        long_concurrency=long_concurrency,
        metrics_port=metrics_port,
        redis_url=redis_url,
        storage=storage,
    )
    settings.require_redis_url()
    values = list(server or []) or [settings.servers]
    try:
        specs = ServerSpec.parse_many([v for v in values if v])
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if not specs:
        raise ConfigError(
            "no SGLang or vLLM server given: use --server NAME=URL (repeatable) or DATAGEN_SERVERS"
        )
    specs = with_api_keys(specs, settings.server_keys())
    _logging(settings.log_level)
    asyncio.run(Worker(settings, specs, burst=burst).main())


@app.command(
    epilog=examples(
        "datagen sim --port 30000 --tokenizer /models/DeepSeek-R1",
        "datagen sim --time-scale 0.01 --fail-503-rate 0.05",
    )
)
def sim(
    port: Annotated[int, typer.Option(help="port (SGLang's default is 30000)")] = 30000,
    host: Annotated[str, typer.Option(help="bind address")] = "127.0.0.1",
    tokenizer: Annotated[str | None, typer.Option(help="tokenizer path for special ids and text")] = None,
    context_len: Annotated[int | None, typer.Option(help="model context length in tokens")] = None,
    kv_tokens: Annotated[int | None, typer.Option(help="KV-cache capacity (max_total_num_tokens)")] = None,
    time_scale: Annotated[
        float | None, typer.Option(help="multiplies simulated durations; 0 = instant")
    ] = None,
    reserve_fraction: Annotated[
        float | None, typer.Option(help="admission reserve of max_new_tokens")
    ] = None,
    max_lag_ms: Annotated[
        float | None,
        typer.Option(
            help="how far the simulated clock may lag real time, caught up by later steps "
            "(0: never, a late wake-up delays every later step; the benchmarks use 5)"
        ),
    ] = None,
    mean_reasoning_tokens: Annotated[
        float | None, typer.Option(help="mean length of a simulated reasoning part, in tokens")
    ] = None,
    mean_answer_tokens: Annotated[
        float | None, typer.Option(help="mean length of a simulated answer, in tokens")
    ] = None,
    tool_call_format: Annotated[
        str | None,
        typer.Option(help="qwen25 or deepseekv3: prompts offering tools may get a call (needs --tokenizer)"),
    ] = None,
    fail_503_rate: Annotated[float | None, typer.Option(help="fraction of /generate answered 503")] = None,
    fail_500_rate: Annotated[float | None, typer.Option(help="fraction of /generate answered 500")] = None,
    abort_rate: Annotated[float | None, typer.Option(help="fraction of /generate aborted")] = None,
    starting_s: Annotated[float | None, typer.Option(help="seconds /health answers 503 after start")] = None,
    api_key: Annotated[
        str | None, typer.Option(help="like SGLang's --api-key: a bearer token for all but /health, /metrics")
    ] = None,
    api: Annotated[
        str | None, typer.Option(help="sglang (default) or vllm: whose HTTP contract the simulator speaks")
    ] = None,
) -> None:
    """Run a simulated SGLang or vLLM server.

    The real contract (SGLang's /generate, or vLLM's /v1/completions with --api vllm), a simulated
    GPU.
    """
    import uvicorn

    from simulator.config import SimConfig
    from simulator.server import uvicorn_config

    given: dict[str, Any] = {
        "port": port,
        "host": host,
        "tokenizer_path": tokenizer,
        "context_len": context_len,
        "max_total_num_tokens": kv_tokens,
        "time_scale": time_scale,
        "reserve_fraction": reserve_fraction,
        "max_lag_s": None if max_lag_ms is None else max_lag_ms / 1000,
        "mean_reasoning_tokens": mean_reasoning_tokens,
        "mean_answer_tokens": mean_answer_tokens,
        "tool_call_format": tool_call_format,
        "fail_503_rate": fail_503_rate,
        "fail_500_rate": fail_500_rate,
        "abort_rate": abort_rate,
        "starting_s": starting_s,
        "api_key": api_key,
        "api": api,
    }
    try:
        config = SimConfig(**{k: v for k, v in given.items() if v is not None})
    except ValidationError as exc:
        raise ConfigError(f"invalid simulator options: {describe_invalid(exc, given)}") from exc
    with _listener(config.host, config.port, "--port") as sock:
        uvicorn.Server(uvicorn_config(config)).run(sockets=[sock])
