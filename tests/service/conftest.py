"""The coordinator app in process, for the tests of this package: each test module defines the
``settings`` it runs with (its own namespace, storage and allowlist)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from datagen.settings import CoordinatorSettings
from service.app import create_app


@pytest.fixture
def client(settings: CoordinatorSettings) -> Iterator[TestClient]:
    with TestClient(create_app(settings)) as test_client:
        yield test_client
