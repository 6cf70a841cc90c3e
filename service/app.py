"""HTTP routes of the coordinator. Thin: validation, auth and error translation live here,
everything else in :class:`service.coordinator.Coordinator`."""

from __future__ import annotations

import hmac
import logging
import re
import sys
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Annotated, Any, Literal

import redis
from fastapi import Depends, FastAPI, File, Form, Query, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from datagen.clock import now_ms
from datagen.control.redismemory import health_json, is_out_of_memory, out_of_memory_error, read_memory
from datagen.errors import (
    AuthError,
    BackendUnavailableError,
    DatagenError,
    InvalidRequestError,
    NotFoundError,
    RedisOutOfMemoryError,
    UnknownQueueError,
    http_status,
    status_error_class,
)
from datagen.prompts.inputs import ColumnMap
from datagen.records.layout import validate_job_id
from datagen.settings import CoordinatorSettings
from datagen.spec import parse_spec_json
from datagen.states import JobState, Priority, PromptClass
from service.coordinator import Coordinator, DatasetInput
from service.longpoll import CAPPED_HEADER, LongPolls

__all__ = ["create_app"]

log = logging.getLogger(__name__)

MAX_ERRORS_LIMIT = 10_000
# Names one consume call may carry (`datagen pull` sends 1,000 at a time).
MAX_CONSUMED_FILES = 10_000
DEFAULT_ERRORS_LIMIT = 1000
REDIS_SOCKET_TIMEOUT_S = 10.0
# A validation answer names at most this many problems.
MAX_REPORTED_PROBLEMS = 10
# GET /jobs pages: the default and the largest page.
JOBS_PAGE = 100
MAX_JOBS_PAGE = 1000
# `GET /jobs/{id}?wait_s=`: a long poll answers when the job ends or after at most this; how often
# jobs are looked at and how many polls may wait are in `service.longpoll`.
MAX_JOB_WAIT_S = 30.0
OPENAPI_URL = "/openapi.json"
# Numbers in a query are read as written in ASCII digits: what int() or float() would also accept
# ("１", "1_0", " 10", "10.0" for a count) answers 422 rather than being guessed at.
_QUERY_INT = re.compile(r"[0-9]{1,18}")
_QUERY_NUMBER = re.compile(r"(?:[0-9]{1,18}(?:\.[0-9]{0,18})?|\.[0-9]{1,18})(?:[eE][-+]?[0-9]{1,3})?")
# Redis errors that mean "not reachable now" (a failover makes a replica read-only for a while);
# a refusal at maxmemory is said as such (`datagen.control.redismemory`); any other Redis error is a bug of
# ours and answers 500.
_REDIS_UNAVAILABLE = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.ReadOnlyError,
)
# Retry-After of the 503s that say Redis cannot take a request now: a restart or failover takes
# seconds; memory is freed by an operator (or by workers finishing prompts), which takes longer.
RETRY_AFTER_S: dict[type[DatagenError], int] = {BackendUnavailableError: 5, RedisOutOfMemoryError: 30}
# How often Python hands the GIL between threads (its default is 5 ms). A request makes a dozen Redis
# round trips, and after each one waits for the GIL; while a retry or an ingestion thread parses
# thousands of Redis replies, every wait is a whole switch interval: a cancel then took 0.3-1.5 s
# instead of 50 ms (tests/service/test_cancel_during_retry.py).
GIL_SWITCH_INTERVAL_S = 0.0005


_ROUTING_HINTS = {
    404: "no route {path}; GET /docs lists the API",
    405: "{method} is not allowed on {path}; GET /docs lists the API",
}


def _error(
    status: int, message: str, error_type: str, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    """The one error body of the API; ``type`` lets the client raise the same class."""
    return JSONResponse(status_code=status, content={"error": message, "type": error_type}, headers=headers)


def _dataset_input(
    dataset: Annotated[
        UploadFile | None,
        File(
            description="the dataset file: JSONL (.jsonl, .jsonl.gz, .jsonl.zst) or Parquet (.parquet), "
            "told by its name or `format`; or give `dataset_url`"
        ),
    ] = None,
    dataset_url: Annotated[
        str | None,
        Form(
            description="instead of `dataset`: a URL (any fsspec one, s3:// included) or absolute path "
            "the coordinator reads, under a prefix of DATAGEN_DATASET_ALLOWLIST"
        ),
    ] = None,
    dataset_format: Annotated[
        str | None,
        Form(
            alias="format",
            description="jsonl, jsonl.gz, jsonl.zst, parquet, parquet-dir or hf-dataset "
            "(default: told by the name)",
        ),
    ] = None,
    messages_column: Annotated[
        str | None, Form(description="Parquet/Arrow column read as `messages` (default: messages)")
    ] = None,
    id_column: Annotated[
        str | None, Form(description="Parquet/Arrow column read as `id` (default: id)")
    ] = None,
) -> DatasetInput:
    """The dataset fields of `POST /jobs` and of its dry run, which take the same inputs."""
    return DatasetInput(
        upload=None if dataset is None else dataset.file,
        filename=None if dataset is None else dataset.filename,
        url=dataset_url or None,
        format=dataset_format or None,
        columns=ColumnMap(messages=messages_column or None, id=id_column or None),
    )


def create_app(settings: CoordinatorSettings, *, redis_client: redis.Redis | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = redis_client or redis.Redis.from_url(
            settings.require_redis_url(), socket_timeout=REDIS_SOCKET_TIMEOUT_S, health_check_interval=30
        )
        coordinator = Coordinator(settings, client)
        switch_interval_s = sys.getswitchinterval()
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        coordinator.start()
        app.state.coordinator = coordinator
        app.state.long_polls = LongPolls(coordinator.jobs)
        try:
            yield
        finally:
            coordinator.close()
            sys.setswitchinterval(switch_interval_s)
            if redis_client is None:
                client.close()

    # The schema and its viewers are served by guarded routes below, not FastAPI's open ones.
    app = FastAPI(
        title="eagle3-datagen coordinator",
        version="0.1.0",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    _install_error_handlers(app)
    app.state.settings = settings
    _install_routes(app)
    _install_docs(app)
    return app


def _query_int(value: object) -> object:
    if isinstance(value, str) and not _QUERY_INT.fullmatch(value):
        raise ValueError("write a whole number in ASCII digits (0-9), as 100")
    return value


def _query_number(value: object) -> object:
    if isinstance(value, str) and not _QUERY_NUMBER.fullmatch(value):
        raise ValueError("write a number in ASCII digits (0-9) with an optional '.', as 2.5")
    return value


# After the Query() of an Annotated parameter, so the schema keeps its minimum and maximum.
QueryInt = BeforeValidator(_query_int)
QueryNumber = BeforeValidator(_query_number)


def _coordinator(request: Request) -> Coordinator:
    return request.app.state.coordinator


def _authorize(request: Request) -> None:
    token: str | None = request.app.state.settings.api_token
    if not token:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode(), token.encode()):
        raise AuthError("missing or wrong bearer token: send 'Authorization: Bearer <DATAGEN_API_TOKEN>'")


def _job_id(job_id: str) -> str:
    # Before any key is read: an id with a separator could alias another key of the namespace.
    return validate_job_id(job_id)


Coord = Annotated[Coordinator, Depends(_coordinator)]
JobId = Annotated[str, Depends(_job_id)]


def _install_routes(app: FastAPI) -> None:
    guarded = [Depends(_authorize)]

    @app.get("/healthz")
    def healthz(coord: Coord) -> dict[str, Any]:
        """Liveness (Redis answers), and Redis's memory against its maxmemory, with what an
        operator must change in ``redis.problems`` (``datagen status`` shows them). Out of memory
        also while a write was refused of late (`datagen.control.redismemory.health_json`)."""
        coord.redis.ping()
        memory = read_memory(coord.redis)
        if memory is None:
            return {"status": "ok", "redis": None}
        refused = coord.metrics.redis_oom_refusals.seen
        return {"status": "ok", "redis": health_json(memory, refused, now_ms())}

    @app.get("/metrics")
    def metrics(coord: Coord) -> Response:
        return Response(generate_latest(coord.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/jobs", status_code=202, dependencies=guarded)
    def submit_job(
        coord: Coord,
        spec: Annotated[str, Form(description="job spec as JSON")],
        given: Annotated[DatasetInput, Depends(_dataset_input)],
        job_id: Annotated[
            str | None, Form(description="1-64 letters, digits or underscores; reuse one to append")
        ] = None,
    ) -> JSONResponse:
        if job_id is not None:
            validate_job_id(job_id)
        parsed = parse_spec_json(spec)
        submitted = coord.submit(parsed, given, job_id)
        body = submitted.progress.to_json()
        body["created"] = submitted.created
        headers = {"Location": f"/jobs/{submitted.job_id}"}
        return JSONResponse(status_code=202, content=body, headers=headers)

    @app.post("/jobs/dry-run", dependencies=guarded)
    def dry_run_job(
        coord: Coord,
        spec: Annotated[str, Form(description="job spec as JSON")],
        given: Annotated[DatasetInput, Depends(_dataset_input)],
    ) -> dict[str, Any]:
        """Render the first rows of any input `POST /jobs` takes as ingestion would, reading no
        more of it, and enqueue nothing."""
        return coord.dry_run(parse_spec_json(spec), given)

    @app.get("/jobs", dependencies=guarded)
    def list_jobs(
        coord: Coord,
        limit: Annotated[
            int, Query(ge=1, le=MAX_JOBS_PAGE, description="jobs per page"), QueryInt
        ] = JOBS_PAGE,
        cursor: Annotated[
            str | None, Query(max_length=200, description="the `next` of the previous page")
        ] = None,
        state: Annotated[
            list[JobState] | None, Query(description="only jobs in these states (repeat for more)")
        ] = None,
        priority: Annotated[
            list[Priority] | None, Query(description="only jobs at these priorities (repeat for more)")
        ] = None,
    ) -> dict[str, Any]:
        """Jobs with progress, newest first, a page at a time: ``next`` is the cursor of the next
        page (null on the last), ``count`` how many jobs there are in all. With ``state`` or
        ``priority`` filters a page may hold fewer than ``limit`` jobs (even none) and still have a
        ``next``: a filter that matches few of many jobs answers quickly a page at a time."""
        ids, following = coord.jobs.index.select(limit, cursor, states=state or (), priorities=priority or ())
        return {"jobs": coord.jobs_json(ids), "next": following, "count": coord.jobs.index.count()}

    @app.get("/jobs/{job_id}", dependencies=guarded)
    async def get_job(
        request: Request,
        response: Response,
        coord: Coord,
        job_id: JobId,
        wait_s: Annotated[
            float,
            Query(
                ge=0,
                le=MAX_JOB_WAIT_S,
                description="answer as soon as the job ends, or after this many seconds (a long poll; "
                "beyond the caps on waiting polls it answers at once, with the header X-Long-Poll: capped)",
            ),
            QueryNumber,
        ] = 0.0,
    ) -> dict[str, Any]:
        polls: LongPolls = request.app.state.long_polls
        if not await polls.wait(job_id, wait_s):
            response.headers[CAPPED_HEADER[0]] = CAPPED_HEADER[1]
        job: dict[str, Any] = await run_in_threadpool(coord.job_json, job_id)
        return job

    _install_job_reads(app, guarded)
    _install_job_controls(app, guarded)
    _install_fleet_routes(app, guarded)


class ConsumedFeatures(BaseModel):
    model_config = ConfigDict(extra="forbid")

    files: list[Annotated[str, StringConstraints(min_length=1, max_length=200)]] = Field(
        max_length=MAX_CONSUMED_FILES, description="feature file names, as records name them (features_file)"
    )


def _install_job_controls(app: FastAPI, guarded: list[Any]) -> None:
    @app.post("/jobs/{job_id}/cancel", dependencies=guarded)
    def cancel_job(
        coord: Coord,
        job_id: JobId,
        abort_in_flight: Annotated[
            bool, Query(description="abort prompts in flight too (default: let them finish)")
        ] = False,
    ) -> dict[str, Any]:
        """Drop the job's queued prompts; committed records are kept."""
        return coord.controls.cancel(job_id, abort_in_flight=abort_in_flight)

    @app.post("/jobs/{job_id}/pause", dependencies=guarded)
    def pause_job(coord: Coord, job_id: JobId) -> dict[str, Any]:
        return coord.controls.pause(job_id)

    @app.post("/jobs/{job_id}/resume", dependencies=guarded)
    def resume_job(coord: Coord, job_id: JobId) -> dict[str, Any]:
        return coord.controls.resume(job_id)

    @app.post("/jobs/{job_id}/features/consume", dependencies=guarded)
    def consume_features(coord: Coord, job_id: JobId, body: ConsumedFeatures) -> dict[str, Any]:
        """Delete feature files a pull wrote out (`datagen pull --consume`), freeing the job's
        features budget; a name already deleted counts nothing (safe to send again)."""
        return coord.consume_features(job_id, body.files)

    @app.post("/jobs/{job_id}/retry", dependencies=guarded)
    def retry_job(
        coord: Coord,
        job_id: JobId,
        reason: Annotated[
            str | None, Query(max_length=200, description="only prompts that failed with this reason")
        ] = None,
    ) -> dict[str, Any]:
        """Re-enqueue the job's failed prompts with fresh attempts."""
        return coord.controls.retry(job_id, reason=reason)

    @app.post("/jobs/{job_id}/recover", dependencies=guarded)
    def recover_job(coord: Coord, job_id: JobId) -> dict[str, Any]:
        """Rebuild the job from storage (what Redis holds of it is dropped): prompts with a committed
        record count done, the rest run again. The coordinator does this by itself when Redis loses
        or rolls back its data; this is for a job Redis lost while nothing watched it."""
        return coord.recover(job_id)

    @app.delete("/jobs/{job_id}", dependencies=guarded)
    def delete_job(
        coord: Coord,
        job_id: JobId,
        files: Annotated[bool, Query(description="also delete the job's stored data and records")] = False,
    ) -> dict[str, Any]:
        return coord.controls.delete(job_id, files=files)


def _install_job_reads(app: FastAPI, guarded: list[Any]) -> None:
    @app.get("/jobs/{job_id}/errors", dependencies=guarded)
    def job_errors(
        coord: Coord,
        job_id: JobId,
        kind: Annotated[
            Literal["rejected", "failed", "flagged", "stopped", "capture"],
            Query(
                description="rejected rows, failed prompts, rows accepted with a warning, "
                "conversations (multi_turn all) that stopped before their last turn, or records whose "
                "features (hidden states) were not captured"
            ),
        ] = "rejected",
        limit: Annotated[int, Query(ge=1, le=MAX_ERRORS_LIMIT), QueryInt] = DEFAULT_ERRORS_LIMIT,
    ) -> dict[str, Any]:
        if kind == "rejected":
            return {"kind": kind, "errors": coord.rejected(job_id, limit)}
        if kind == "flagged":
            return {"kind": kind, "errors": coord.flagged(job_id, limit)}
        if kind == "stopped":
            return {"kind": kind, "errors": coord.stopped(job_id, limit)}
        if kind == "capture":
            return {"kind": kind, "errors": coord.capture_errors(job_id, limit)}
        coord.jobs.progress(job_id)
        return {"kind": kind, "errors": coord.jobs.outcomes.failed_reports(job_id, limit)}


def _install_fleet_routes(app: FastAPI, guarded: list[Any]) -> None:
    @app.get("/queues", dependencies=guarded)
    def list_queues(coord: Coord) -> dict[str, Any]:
        return {"queues": coord.fleet.queues()}

    @app.post("/queues/{name}/{action}", dependencies=guarded)
    def pause_queue(coord: Coord, name: str, action: str) -> dict[str, Any]:
        if name not in {c.value for c in PromptClass}:
            raise UnknownQueueError(f"no queue {name!r}; the queues are 'short' and 'long'")
        return coord.fleet.set_queue_paused(name, _pause_action(action))

    @app.get("/servers", dependencies=guarded)
    def list_servers(coord: Coord) -> dict[str, Any]:
        return {"servers": coord.fleet.servers()}

    @app.get("/servers/{name}", dependencies=guarded)
    def get_server(coord: Coord, name: str) -> dict[str, Any]:
        return coord.fleet.server(name)

    @app.post("/servers/{name}/{action}", dependencies=guarded)
    def pause_server(coord: Coord, name: str, action: str) -> dict[str, Any]:
        return coord.fleet.set_server_paused(name, _pause_action(action))


def _pause_action(action: str) -> bool:
    if action not in ("pause", "resume"):
        raise NotFoundError(f"unknown action {action!r}; use pause or resume")
    return action == "pause"


def _install_docs(app: FastAPI) -> None:
    """The schema and its viewers, behind the token like every other route that says what the API is."""
    guarded = [Depends(_authorize)]

    @app.get(OPENAPI_URL, dependencies=guarded, include_in_schema=False)
    def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", dependencies=guarded, include_in_schema=False)
    def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url=OPENAPI_URL, title=f"{app.title} - docs")

    @app.get("/redoc", dependencies=guarded, include_in_schema=False)
    def redoc() -> HTMLResponse:
        return get_redoc_html(openapi_url=OPENAPI_URL, title=f"{app.title} - ReDoc")


def _validation_message(exc: RequestValidationError) -> str:
    errors = list(exc.errors())
    problems = [
        f"{'.'.join(str(p) for p in err.get('loc', ())) or 'request'}: {err.get('msg', 'invalid')}"
        for err in errors[:MAX_REPORTED_PROBLEMS]
    ]
    if len(errors) > MAX_REPORTED_PROBLEMS:
        problems.append(f"and {len(errors) - MAX_REPORTED_PROBLEMS} more")
    return f"invalid request: {'; '.join(problems)}"


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(DatagenError)
    async def datagen_error(request: Request, exc: DatagenError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if isinstance(exc, AuthError) else {}
        if (retry_after_s := RETRY_AFTER_S.get(type(exc))) is not None:
            headers["Retry-After"] = str(retry_after_s)
        return _error(http_status(exc), str(exc), type(exc).__name__, headers)

    @app.exception_handler(redis.exceptions.RedisError)
    async def redis_error(request: Request, exc: redis.exceptions.RedisError) -> JSONResponse:
        # The one place the HTTP layer translates Redis errors.
        if isinstance(exc, _REDIS_UNAVAILABLE):
            log.warning("Redis unavailable on %s %s: %s", request.method, request.url.path, exc)
            translated: DatagenError = BackendUnavailableError("Redis is unavailable; retry shortly")
        elif is_out_of_memory(exc):
            coord: Coordinator = request.app.state.coordinator
            coord.metrics.redis_oom_refusals.inc()
            translated = await run_in_threadpool(out_of_memory_error, coord.redis, exc)
            log.warning("%s %s refused: %s", request.method, request.url.path, translated)
        else:
            log.error("Redis error on %s %s", request.method, request.url.path, exc_info=exc)
            translated = DatagenError(f"internal error ({type(exc).__name__}); see the coordinator's log")
        translated.__cause__ = exc
        return await datagen_error(request, translated)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Routing (404, 405) and multipart limits raise Starlette's exception, not FastAPI's.
        error_type = status_error_class(exc.status_code).__name__
        message = _ROUTING_HINTS.get(exc.status_code, "{detail}").format(
            detail=exc.detail, method=request.method, path=request.url.path
        )
        return _error(exc.status_code, message, error_type, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(422, _validation_message(exc), InvalidRequestError.__name__)

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, exc: Exception) -> JSONResponse:
        # A bug of ours still answers the one error body, not Starlette's plain-text 500; the server
        # logs the traceback (Starlette raises the exception again once this answer is sent).
        message = f"internal error ({type(exc).__name__}); see the coordinator's log"
        return _error(500, message, DatagenError.__name__)
