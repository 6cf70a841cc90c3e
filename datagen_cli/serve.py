"""Commands that run a long-lived process: ``coordinator``, ``worker`` and ``sim``.

Each imports its process's package (service, workers, simulator) inside the function, so importing
``datagen`` never imports them; pyproject.toml's import-linter contract names exactly these imports.
Each takes ``--config FILE`` (`datagen_cli.configfile`): flags, then the environment, then the file.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import logging
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

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
    FileValues,
    WorkerSettings,
    describe_invalid,
    load,
)
from datagen.states import EngineChoice
from datagen_cli._app import app, examples
from datagen_cli.configfile import ConfigOption, read_config

if TYPE_CHECKING:
    import uvicorn

log = logging.getLogger(__name__)
# How long the API keeps an idle connection open: longer than clients keep one in their pools
# (httpx: 5 s; load balancers: 60 s), so that the client, not the server, closes an idle
# connection. At uvicorn's 5 s a client could send a request on a connection in the instant the
# server closed it, and read a connection reset instead of the answer (a POST is not retried).
API_KEEP_ALIVE_S = 75

# Libraries that log every request at INFO; our own one-line-per-prompt log is enough.
_QUIET_LOGGERS = ("httpx", "rq.worker", "rq.queue")
REDIS_URL_HELP = "Redis URL, redis:// or rediss:// (this or DATAGEN_REDIS_URL is required)"
STORAGE_HELP = f"storage root: a directory or s3:// URL (DATAGEN_STORAGE, default {DEFAULT_STORAGE})"
# simulator.config's defaults, for `sim --help` (the simulator is imported only when it runs).
DEFAULT_SIM_PORT = 30000
DEFAULT_SIM_HOST = "127.0.0.1"
DEFAULT_CAPTURE_NUM_LAYERS = 32
DEFAULT_CAPTURE_HIDDEN_SIZE = 64
DEFAULT_CAPTURE_WRITE_DELAY_MS = 20.0
DEFAULT_CAPTURE_SLOW_WRITE_S = 12.0
# `sim` flags named differently in simulator.config.SimConfig (--max-lag-ms is converted to seconds).
SIM_FIELDS = {"tokenizer": "tokenizer_path", "kv_tokens": "max_total_num_tokens", "max_lag_ms": "max_lag_s"}
MS_PER_S = 1000


def _logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in _QUIET_LOGGERS:
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger().level))


def _url(sock: socket.socket) -> str:
    """``http://host:port`` of a bound socket (the port it got when asked for port 0)."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


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
        "datagen coordinator --config coordinator.yaml",
    )
)
def coordinator(
    ctx: typer.Context,
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
    config: ConfigOption = None,
) -> None:
    """Run the coordinator HTTP API.

    It waits for Redis and storage at startup. Any DATAGEN_* setting may also come from --config
    FILE (YAML); a flag wins over the environment, which wins over the file.
    """
    import uvicorn

    from datagen.control.startup import claim_storage, connect_redis
    from datagen.heap import collect_less_often
    from datagen.records.storage import Storage
    from service.app import create_app

    from_file = read_config(ctx, config, CoordinatorSettings)
    settings = load(
        CoordinatorSettings, from_file.settings, host=host, port=port, redis_url=redis_url, storage=storage
    )
    redis_url = settings.require_redis_url()
    if not _loopback(settings.host) and not settings.api_token and not settings.allow_insecure_bind:
        raise ConfigError(
            f"refusing to listen on {settings.host} without DATAGEN_API_TOKEN; set a token, "
            "or DATAGEN_ALLOW_INSECURE_BIND=1 if a proxy in front does authentication"
        )
    _logging(settings.log_level)
    collect_less_often()
    # The port first: a port in use is one line at once, not after the wait for Redis. Until the
    # server starts, connections to it are refused.
    with _listener(settings.host, settings.port, "--port (DATAGEN_PORT)") as sock:
        # Before the server starts, so that a refusal is one line rather than a failed startup.
        connect_redis(redis_url, settings.startup_timeout_s).close()
        claim_storage(Storage(settings.storage), settings.namespace, settings.startup_timeout_s)
        server_config = uvicorn.Config(
            create_app(settings),
            host=settings.host,
            port=settings.port,
            log_level=settings.log_level.lower(),
            timeout_keep_alive=API_KEEP_ALIVE_S,
        )
        started = _serve(
            server_config, f"coordinator listening on {_url(sock)}: the HTTP API, /healthz and /metrics", sock
        )
    if not started:
        raise ConfigError("the coordinator did not start; its log above says why")


def _serve(
    config: uvicorn.Config, line: str, sock: socket.socket, server_class: type[uvicorn.Server] | None = None
) -> bool:
    """Run uvicorn (``server_class``, default ``uvicorn.Server``) on ``sock`` until stopped, logging
    ``line`` (where it listens, what it serves) once it accepts connections: after the app's
    start-up, which may wait (a coordinator's reconcile). Returns whether it started."""
    import uvicorn

    from datagen.heap import freeze_start_up

    class Announced(server_class or uvicorn.Server):  # type: ignore[misc]  # a base chosen at run time
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            if self.started:
                freeze_start_up()
                log.info("%s", line)

    server = Announced(config)
    server.run(sockets=[sock])
    return server.started


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
        "datagen worker --config worker.yaml --metrics-port 9401",
        "datagen worker --config worker-with-capture.yaml",
    )
)
def worker(
    ctx: typer.Context,
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
    capture_server: Annotated[
        list[str] | None,
        typer.Option(
            metavar="<[name=]url>",
            help="vLLM capture server (extract_hidden_states) for jobs with features, NAME=URL or URL; "
            "repeatable (DATAGEN_CAPTURE_SERVERS, comma-separated); needs --capture-dir",
        ),
    ] = None,
    capture_dir: Annotated[
        Path | None,
        typer.Option(
            help="the capture servers' shared_storage_path as this node sees it (DATAGEN_CAPTURE_DIR); "
            "the worker reads, stores and deletes their files there"
        ),
    ] = None,
    capture_layers: Annotated[
        str | None,
        typer.Option(
            metavar="<ids>",
            help="the layer ids the capture servers were launched with, e.g. 2,16,29,32 "
            "(DATAGEN_CAPTURE_LAYERS); vLLM does not report them, so without it only their count is checked",
        ),
    ] = None,
    burst: Annotated[
        bool,
        typer.Option(show_default=False, help="exit when the queues are empty (default: run until stopped)"),
    ] = False,
    redis_url: Annotated[str | None, typer.Option(help=REDIS_URL_HELP)] = None,
    storage: Annotated[str | None, typer.Option(help=STORAGE_HELP)] = None,
    config: ConfigOption = None,
) -> None:
    """Run a worker: queued prompts to SGLang or vLLM, records to storage.

    It sends the queued prompts to its SGLang or vLLM servers (each server's engine is asked of
    the server unless --engine or its URL names it) and stores the records; it waits for Redis
    and storage at startup. Any DATAGEN_* setting, and `server` and `burst`, may also come from
    --config FILE (YAML); a flag wins over the environment, which wins over the file.
    """
    from datagen.heap import freeze_start_up
    from workers.fleet.servers import ServerSpec, with_api_keys
    from workers.worker import Worker

    from_file = read_config(ctx, config, WorkerSettings)
    burst = from_file.flag(ctx, "burst")
    settings = load(
        WorkerSettings,
        from_file.settings,
        engine=engine,
        short_concurrency=short_concurrency,
        long_concurrency=long_concurrency,
        metrics_port=metrics_port,
        redis_url=redis_url,
        storage=storage,
        capture_dir=capture_dir,
        capture_layers=capture_layers,
    )
    settings.require_redis_url()
    settings.capture_layer_ids()  # a bad list fails here, in one line, not at a probe
    values = list(server or []) or [settings.servers]
    try:
        specs = ServerSpec.parse_many([v for v in values if v])
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if not specs:
        raise ConfigError(
            "no SGLang or vLLM server given: use --server NAME=URL (repeatable) or DATAGEN_SERVERS"
        )
    capture_values = list(capture_server or []) or [settings.capture_servers]
    try:
        capture_specs = ServerSpec.parse_many([v for v in capture_values if v])
    except ValueError as exc:
        raise ConfigError(f"--capture-server: {exc}") from exc
    keys = settings.server_keys()
    specs = with_api_keys(specs, {k: v for k, v in keys.items() if k not in {c.name for c in capture_specs}})
    capture_specs = with_api_keys(
        capture_specs, {k: v for k, v in keys.items() if k not in {c.name for c in specs}}
    )
    _logging(settings.log_level)
    worker = Worker(settings, specs, capture_servers=capture_specs, burst=burst)
    # Its modules imported: what the worker makes from here on is all a full collection walks.
    freeze_start_up()
    asyncio.run(worker.main())


@app.command(
    epilog=examples(
        "datagen sim --port 30000 --tokenizer /models/DeepSeek-R1",
        "datagen sim --time-scale 0.01 --fail-503-rate 0.05",
        "datagen sim --config sim.yaml --port 30001",
        "datagen sim --api vllm --capture-dir /tmp/hs --capture-layers 2,16,29,32",
    )
)
def sim(
    ctx: typer.Context,
    port: Annotated[
        int | None, typer.Option(help=f"port (default {DEFAULT_SIM_PORT}, SGLang's default)")
    ] = None,
    host: Annotated[str | None, typer.Option(help=f"bind address (default {DEFAULT_SIM_HOST})")] = None,
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
    request_log: Annotated[
        str | None,
        typer.Option(
            help="append one JSON line per accepted generation request to this file: its rid, prompt "
            "length, ids' sha256 and the sampling params it carried"
        ),
    ] = None,
    capture_dir: Annotated[
        str | None,
        typer.Option(
            help="with --api vllm: capture hidden states into this directory, as vLLM's "
            "extract_hidden_states with ExampleHiddenStatesConnector (its shared_storage_path)"
        ),
    ] = None,
    capture_layers: Annotated[
        str | None,
        typer.Option(
            help="captured layer ids, comma-separated (eagle_aux_hidden_state_layer_ids; "
            "default speculators' 2,N/2,N-3,N)"
        ),
    ] = None,
    capture_num_layers: Annotated[
        int | None,
        typer.Option(help=f"the captured model's layer count N (default {DEFAULT_CAPTURE_NUM_LAYERS})"),
    ] = None,
    capture_hidden_size: Annotated[
        int | None, typer.Option(help=f"the captured hidden size (default {DEFAULT_CAPTURE_HIDDEN_SIZE})")
    ] = None,
    capture_dtype: Annotated[
        str | None, typer.Option(help="bf16 (default) or fp8 (speculators' FP8HiddenStatesConnector file)")
    ] = None,
    capture_write_delay_ms: Annotated[
        float | None,
        typer.Option(
            help="how long after the response a captured file is written "
            f"(default {DEFAULT_CAPTURE_WRITE_DELAY_MS:g})"
        ),
    ] = None,
    capture_fault_5xx: Annotated[
        float | None, typer.Option(help="fraction of capturing requests answered 500, with no file or lock")
    ] = None,
    capture_fault_nofile: Annotated[
        float | None, typer.Option(help="fraction whose lock is released with no file written (a crash)")
    ] = None,
    capture_fault_truncate: Annotated[
        float | None, typer.Option(help="fraction whose file is cut short (a failed write)")
    ] = None,
    capture_fault_short: Annotated[
        float | None, typer.Option(help="fraction whose hidden_states has fewer rows than token_ids")
    ] = None,
    capture_fault_slow: Annotated[
        float | None, typer.Option(help="fraction whose writer holds the lock --capture-slow-write-s first")
    ] = None,
    capture_slow_write_s: Annotated[
        float | None,
        typer.Option(
            help=f"how long a slow writer holds the lock (default {DEFAULT_CAPTURE_SLOW_WRITE_S:g})"
        ),
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option(
            exists=True,
            dir_okay=False,
            help="YAML file of `flag: value` lines (port, kv_tokens or kv-tokens, ...); a flag given on the "
            "command line wins over the file",
        ),
    ] = None,
) -> None:
    """Run a simulated SGLang or vLLM server.

    The real contract (SGLang's /generate, or vLLM's /v1/completions with --api vllm), a simulated
    GPU. It reads no DATAGEN_* variables; its flags may also come from --config FILE (YAML).
    """
    from simulator.config import SimConfig
    from simulator.server import SimServer, describe, uvicorn_config

    from_file = read_config(ctx, config)
    flags = {SIM_FIELDS.get(n, n): from_file.flag(ctx, n) for n in ctx.params if n != "config"}
    if flags["max_lag_s"] is not None:
        flags["max_lag_s"] /= MS_PER_S
    given = {k: v for k, v in flags.items() if v is not None}
    # A refusal names each value's flag, or its key in the file.
    in_file = {SIM_FIELDS.get(n, n) for n in from_file.used_flags(ctx)}
    file_values = FileValues(from_file.path, {k: str(v) for k, v in given.items() if k in in_file})
    try:
        sim_config = SimConfig(**given)
    except ValidationError as exc:
        problems = describe_invalid(exc, {k: v for k, v in given.items() if k not in in_file}, file_values)
        raise ConfigError(f"invalid simulator options: {problems}") from exc
    _logging("info")
    with _listener(sim_config.host, sim_config.port, "--port") as sock:
        _serve(uvicorn_config(sim_config), describe(sim_config, _url(sock)), sock, SimServer)
