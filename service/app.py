"""HTTP routes of the coordinator. Thin: validation, auth and error translation live here,
everything else in :class:`service.coordinator.Coordinator`."""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

import redis
from fastapi import Depends, FastAPI, File, Form, HTTPException, Query, Request, UploadFile
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from datagen.errors import (
    DatagenError,
    FatalError,
    JobNotFoundError,
    JobStateError,
    PreflightError,
    RetryableError,
)
from datagen.settings import CoordinatorSettings
from datagen.spec import JobSpec
from datagen.states import PromptClass
from service.coordinator import Coordinator, UploadTooLargeError

__all__ = ["create_app"]

log = logging.getLogger(__name__)

MAX_ERRORS_LIMIT = 10_000
DEFAULT_ERRORS_LIMIT = 1000
REDIS_SOCKET_TIMEOUT_S = 10.0


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": message})


def create_app(settings: CoordinatorSettings, *, redis_client: redis.Redis | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = redis_client or redis.Redis.from_url(
            settings.require_redis_url(), socket_timeout=REDIS_SOCKET_TIMEOUT_S, health_check_interval=30
        )
        coordinator = Coordinator(settings, client)
        coordinator.start()
        app.state.coordinator = coordinator
        try:
            yield
        finally:
            coordinator.close()
            if redis_client is None:
                client.close()

    app = FastAPI(title="eagle3-datagen coordinator", version="0.1.0", lifespan=lifespan)
    _install_error_handlers(app)
    app.state.settings = settings
    _install_routes(app)
    return app


def _coordinator(request: Request) -> Coordinator:
    return request.app.state.coordinator


def _authorize(request: Request) -> None:
    token: str | None = request.app.state.settings.api_token
    if not token:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode(), token.encode()):
        raise HTTPException(
            status_code=401,
            detail="missing or wrong bearer token: send 'Authorization: Bearer <DATAGEN_API_TOKEN>'",
            headers={"WWW-Authenticate": "Bearer"},
        )


Coord = Annotated[Coordinator, Depends(_coordinator)]


def _install_routes(app: FastAPI) -> None:
    guarded = [Depends(_authorize)]

    @app.get("/healthz")
    def healthz(coord: Coord) -> dict[str, Any]:
        coord.redis.ping()
        return {"status": "ok"}

    @app.get("/metrics")
    def metrics(coord: Coord) -> Response:
        return Response(generate_latest(coord.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/jobs", status_code=202, dependencies=guarded)
    def submit_job(
        coord: Coord,
        dataset: Annotated[UploadFile, File(description="JSONL dataset, one row per line")],
        spec: Annotated[str, Form(description="job spec as JSON")],
        job_id: Annotated[str | None, Form()] = None,
    ) -> JSONResponse:
        parsed = _parse_spec(spec)
        job, created = coord.submit(parsed, dataset.file, job_id)
        body = coord.jobs.progress(job).to_json()
        body["created"] = created
        return JSONResponse(status_code=202, content=body, headers={"Location": f"/jobs/{job}"})

    @app.post("/jobs/dry-run", dependencies=guarded)
    def dry_run_job(
        coord: Coord,
        dataset: Annotated[UploadFile, File(description="JSONL dataset, one row per line")],
        spec: Annotated[str, Form(description="job spec as JSON")],
    ) -> dict[str, Any]:
        """Render a sample of the rows as ingestion would, and enqueue nothing."""
        return coord.dry_run(_parse_spec(spec), dataset.file)

    @app.get("/jobs", dependencies=guarded)
    def list_jobs(coord: Coord) -> dict[str, Any]:
        jobs = []
        shares = coord.controls.dispatch.shares()
        for job in coord.jobs.list_ids():
            try:
                jobs.append(coord.job_json(job, shares))
            except JobNotFoundError:
                continue
        return {"jobs": jobs}

    @app.get("/jobs/{job_id}", dependencies=guarded)
    def get_job(coord: Coord, job_id: str) -> dict[str, Any]:
        return coord.job_json(job_id)

    _install_job_reads(app, guarded)
    _install_job_controls(app, guarded)
    _install_fleet_routes(app, guarded)


def _install_job_controls(app: FastAPI, guarded: list[Any]) -> None:
    @app.post("/jobs/{job_id}/cancel", dependencies=guarded)
    def cancel_job(
        coord: Coord,
        job_id: str,
        abort_in_flight: Annotated[
            bool, Query(description="abort prompts in flight too (default: let them finish)")
        ] = False,
    ) -> dict[str, Any]:
        """Drop the job's queued prompts; committed records are kept."""
        return coord.controls.cancel(job_id, abort_in_flight=abort_in_flight)

    @app.post("/jobs/{job_id}/pause", dependencies=guarded)
    def pause_job(coord: Coord, job_id: str) -> dict[str, Any]:
        return coord.controls.pause(job_id)

    @app.post("/jobs/{job_id}/resume", dependencies=guarded)
    def resume_job(coord: Coord, job_id: str) -> dict[str, Any]:
        return coord.controls.resume(job_id)

    @app.post("/jobs/{job_id}/retry", dependencies=guarded)
    def retry_job(
        coord: Coord,
        job_id: str,
        reason: Annotated[
            str | None, Query(max_length=200, description="only prompts that failed with this reason")
        ] = None,
    ) -> dict[str, Any]:
        """Re-enqueue the job's failed prompts with fresh attempts."""
        return coord.controls.retry(job_id, reason=reason)

    @app.delete("/jobs/{job_id}", dependencies=guarded)
    def delete_job(
        coord: Coord,
        job_id: str,
        files: Annotated[bool, Query(description="also delete the job's stored data and records")] = False,
    ) -> dict[str, Any]:
        return coord.controls.delete(job_id, files=files)


def _install_job_reads(app: FastAPI, guarded: list[Any]) -> None:
    @app.get("/jobs/{job_id}/errors", dependencies=guarded)
    def job_errors(
        coord: Coord,
        job_id: str,
        kind: Annotated[str, Query(pattern="^(rejected|failed)$")] = "rejected",
        limit: Annotated[int, Query(ge=1, le=MAX_ERRORS_LIMIT)] = DEFAULT_ERRORS_LIMIT,
    ) -> dict[str, Any]:
        if kind == "rejected":
            return {"kind": kind, "errors": coord.rejected(job_id, limit)}
        coord.jobs.progress(job_id)
        return {"kind": kind, "errors": coord.jobs.failed_reports(job_id, limit)}


def _install_fleet_routes(app: FastAPI, guarded: list[Any]) -> None:
    @app.get("/queues", dependencies=guarded)
    def list_queues(coord: Coord) -> dict[str, Any]:
        return {"queues": coord.fleet.queues()}

    @app.post("/queues/{name}/{action}", dependencies=guarded)
    def pause_queue(coord: Coord, name: str, action: str) -> dict[str, Any]:
        if name not in {c.value for c in PromptClass}:
            raise JobNotFoundError(f"no queue {name!r}; the queues are 'short' and 'long'")
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
        raise HTTPException(status_code=404, detail=f"unknown action {action!r}; use pause or resume")
    return action == "pause"


def _parse_spec(raw: str) -> JobSpec:
    try:
        return JobSpec.model_validate(json.loads(raw))
    except json.JSONDecodeError as exc:
        raise HTTPException(status_code=400, detail=f"spec is not valid JSON: {exc}") from exc
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'spec'}: {err['msg']}" for err in exc.errors()
        )
        raise HTTPException(status_code=400, detail=f"invalid job spec: {problems}") from exc


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(DatagenError)
    async def datagen_error(request: Request, exc: DatagenError) -> JSONResponse:
        if isinstance(exc, JobNotFoundError):
            return _error(404, str(exc))
        if isinstance(exc, JobStateError | PreflightError):
            return _error(409, str(exc))
        if isinstance(exc, UploadTooLargeError):
            return _error(413, str(exc))
        if isinstance(exc, FatalError):
            return _error(400, str(exc))
        if isinstance(exc, RetryableError):
            return _error(503, str(exc))
        return _error(500, str(exc))

    @app.exception_handler(redis.exceptions.RedisError)
    async def redis_error(request: Request, exc: redis.exceptions.RedisError) -> JSONResponse:
        log.warning("Redis error on %s %s: %s", request.method, request.url.path, exc)
        return _error(503, "Redis is unavailable; retry shortly")

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse(status_code=exc.status_code, content={"error": exc.detail}, headers=exc.headers)
