"""A small HTTP client for the coordinator, used by the CLI and the demo."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from datagen.errors import ConfigError, CoordinatorUnreachableError, error_from_http

__all__ = ["CoordinatorClient", "DatasetSource"]

DEFAULT_TIMEOUT_S = 30.0
UPLOAD_TIMEOUT_S = 3600.0
# Jobs per GET /jobs page when reading them all.
JOBS_PAGE = 500


@dataclass(frozen=True)
class DatasetSource:
    """A dataset for ``POST /jobs``: a file to upload (``path``) or a reference the coordinator reads
    (``url``), with its format (None: told by the name) and the Parquet/Arrow columns it maps."""

    path: Path | None = None
    url: str | None = None
    format: str | None = None
    messages_column: str | None = None
    id_column: str | None = None

    def form(self) -> dict[str, str]:
        fields = {
            "dataset_url": self.url,
            "format": self.format,
            "messages_column": self.messages_column,
            "id_column": self.id_column,
        }
        return {k: v for k, v in fields.items() if v}


class CoordinatorClient:
    def __init__(
        self, base_url: str, *, api_token: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> None:
        headers = {"Authorization": f"Bearer {api_token}"} if api_token else {}
        self._http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> CoordinatorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def submit(
        self, dataset: Path | DatasetSource, spec: dict[str, Any], job_id: str | None = None
    ) -> dict[str, Any]:
        source = dataset if isinstance(dataset, DatasetSource) else DatasetSource(path=dataset)
        data = {"spec": json.dumps(spec), **source.form()}
        if job_id:
            data["job_id"] = job_id
        if source.path is None:  # by reference: nothing uploaded
            return self._request("POST", "/jobs", data=data, timeout=UPLOAD_TIMEOUT_S)
        with open(source.path, "rb") as fh:
            files = {"dataset": (source.path.name, fh, "application/octet-stream")}
            response = self._request("POST", "/jobs", data=data, files=files, timeout=UPLOAD_TIMEOUT_S)
        return response

    def dry_run(self, dataset: Path | DatasetSource, spec: dict[str, Any]) -> dict[str, Any]:
        """``POST /jobs/dry-run`` of any input `submit` takes: the coordinator reads its first rows."""
        source = dataset if isinstance(dataset, DatasetSource) else DatasetSource(path=dataset)
        data = {"spec": json.dumps(spec), **source.form()}
        if source.path is None:  # by reference: nothing uploaded
            return self._request("POST", "/jobs/dry-run", data=data, timeout=UPLOAD_TIMEOUT_S)
        with open(source.path, "rb") as fh:
            files = {"dataset": (source.path.name, fh, "application/octet-stream")}
            return self._request("POST", "/jobs/dry-run", data=data, files=files, timeout=UPLOAD_TIMEOUT_S)

    def job(self, job_id: str, *, wait_s: float = 0.0) -> dict[str, Any]:
        """The job's progress; with ``wait_s``, as soon as it ends or after ``wait_s`` (a long poll)."""
        if not wait_s:
            return self._request("GET", f"/jobs/{job_id}")
        timeout = httpx.Timeout(DEFAULT_TIMEOUT_S, read=wait_s + DEFAULT_TIMEOUT_S)
        return self._request("GET", f"/jobs/{job_id}", params={"wait_s": wait_s}, timeout=timeout)

    def jobs(self) -> list[dict[str, Any]]:
        """Every job, newest first, read a page at a time."""
        jobs: list[dict[str, Any]] = []
        cursor: str | None = None
        while True:
            body = self.jobs_page(JOBS_PAGE, cursor)
            jobs += body["jobs"]
            cursor = body.get("next")
            if cursor is None:
                return jobs

    def jobs_page(
        self,
        limit: int,
        cursor: str | None = None,
        *,
        states: Sequence[str] = (),
        priorities: Sequence[str] = (),
    ) -> dict[str, Any]:
        """One page of ``GET /jobs``: ``jobs``, ``next`` (the following page's cursor, or None) and
        ``count`` (all jobs); only jobs in ``states`` and at ``priorities`` when given."""
        params: dict[str, Any] = {"limit": limit}
        if cursor is not None:
            params["cursor"] = cursor
        if states:
            params["state"] = list(states)
        if priorities:
            params["priority"] = list(priorities)
        return self._request("GET", "/jobs", params=params)

    def errors(self, job_id: str, kind: str, limit: int = 100) -> list[dict[str, Any]]:
        body = self._request("GET", f"/jobs/{job_id}/errors", params={"kind": kind, "limit": limit})
        return body["errors"]

    def queues(self) -> list[dict[str, Any]]:
        return self._request("GET", "/queues")["queues"]

    def servers(self) -> list[dict[str, Any]]:
        return self._request("GET", "/servers")["servers"]

    def health(self) -> dict[str, Any]:
        """``GET /healthz``: liveness, and Redis's memory with what an operator must change."""
        return self._request("GET", "/healthz")

    def set_queue_paused(self, name: str, paused: bool) -> dict[str, Any]:
        return self._request("POST", f"/queues/{name}/{'pause' if paused else 'resume'}")

    def set_server_paused(self, name: str, paused: bool) -> dict[str, Any]:
        return self._request("POST", f"/servers/{name}/{'pause' if paused else 'resume'}")

    def cancel(self, job_id: str, *, abort_in_flight: bool = False) -> dict[str, Any]:
        params = {"abort_in_flight": "true"} if abort_in_flight else {}
        return self._request("POST", f"/jobs/{job_id}/cancel", params=params)

    def set_job_paused(self, job_id: str, paused: bool) -> dict[str, Any]:
        return self._request("POST", f"/jobs/{job_id}/{'pause' if paused else 'resume'}")

    def retry(self, job_id: str, *, reason: str | None = None) -> dict[str, Any]:
        params = {"reason": reason} if reason else {}
        return self._request("POST", f"/jobs/{job_id}/retry", params=params)

    def recover(self, job_id: str) -> dict[str, Any]:
        return self._request("POST", f"/jobs/{job_id}/recover")

    def delete(self, job_id: str, *, files: bool = False) -> dict[str, Any]:
        params = {"files": "true"} if files else {}
        return self._request("DELETE", f"/jobs/{job_id}", params=params)

    def consume_features(self, job_id: str, names: Sequence[str]) -> dict[str, Any]:
        """``POST /jobs/{id}/features/consume``: these features files of the job are pulled, so storage
        may free them; ``removed``, ``bytes`` and ``retained_bytes`` in the answer (a name already
        removed counts 0: the call may be repeated)."""
        return self._request("POST", f"/jobs/{job_id}/features/consume", json={"files": list(names)})

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise CoordinatorUnreachableError(
                f"cannot reach the coordinator at {self._http.base_url}: {exc or type(exc).__name__} "
                "(is `datagen coordinator` running? set --coordinator or DATAGEN_COORDINATOR_URL)"
            ) from exc
        if response.status_code >= 400:
            type_name, message = _error_body(response)
            raise error_from_http(response.status_code, type_name, message)
        try:
            return response.json()
        except ValueError as exc:
            raise ConfigError(
                f"{self._http.base_url}{path} answered {response.status_code} without JSON: is "
                "--coordinator (DATAGEN_COORDINATOR_URL) the URL of `datagen coordinator`?"
            ) from exc


def _error_body(response: httpx.Response) -> tuple[str | None, str]:
    """(error class name, message) of an error answer; a proxy's page has no class name."""
    try:
        body = response.json()
    except ValueError:
        return None, f"coordinator answered {response.status_code}: {response.text[:500]}"
    if isinstance(body, dict) and "error" in body:
        type_name = body.get("type")
        return (type_name if isinstance(type_name, str) else None), str(body["error"])
    return None, f"coordinator answered {response.status_code}: {json.dumps(body)[:500]}"
