"""Schemathesis against the coordinator's OpenAPI schema, over real HTTP: no request gets a 5xx."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
import uvicorn
from hypothesis import HealthCheck, settings

from datagen.redis_server import free_port
from datagen.settings import CoordinatorSettings
from service.app import create_app

EXAMPLES_PER_OPERATION = 25


@pytest.fixture
def api_schema(redis_url: str, tmp_path: Path) -> Iterator[schemathesis.BaseSchema]:
    app = create_app(CoordinatorSettings(redis_url=redis_url, storage=str(tmp_path), namespace="fuzz"))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        yield schemathesis.openapi.from_url(f"http://127.0.0.1:{port}/openapi.json")
    finally:
        server.should_exit = True
        thread.join(timeout=10)


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(
    max_examples=EXAMPLES_PER_OPERATION,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
def test_no_request_gets_a_server_error(case: schemathesis.Case) -> None:
    response = case.call(timeout=30)
    assert response.status_code < 500, (
        f"{case.method} {case.formatted_path}: {response.status_code} {response.text}"
    )
