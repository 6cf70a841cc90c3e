"""An S3-compatible server for tests (moto's server mode on a loopback port) and the environment that
points s3fs and botocore at it."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import fsspec
import pytest
from moto.server import ThreadedMotoServer
from s3fs import S3FileSystem

from datagen_cli.local.redis_server import free_port

__all__ = ["moto_server", "s3_bucket"]


@contextmanager
def moto_server() -> Iterator[str]:
    """A moto server; yields its endpoint URL."""
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


def s3_bucket(endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh bucket on ``endpoint``; credentials and endpoint in the environment, as s3fs and
    botocore read them. fsspec caches file systems by their arguments, not the environment: a cached
    one would still talk to an earlier test module's server, so the cache is emptied first."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    S3FileSystem.clear_instance_cache()
    bucket = f"b{uuid.uuid4().hex[:16]}"
    fsspec.filesystem("s3").mkdir(bucket)
    return bucket
