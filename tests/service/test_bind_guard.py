"""The coordinator refuses to listen beyond loopback without a token unless told so explicitly."""

from __future__ import annotations

import os
import subprocess
import sys


def _coordinator(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("DATAGEN_")}
    environ.update({"DATAGEN_REDIS_URL": "redis://127.0.0.1:1/0", **env})
    command = [sys.executable, "-m", "datagen_cli", "coordinator", "--port", "0", *args]
    return subprocess.run(command, env=environ, capture_output=True, text=True, timeout=60)


def test_non_loopback_bind_without_a_token_is_refused() -> None:
    result = _coordinator("--host", "0.0.0.0")
    assert result.returncode == 3
    assert "DATAGEN_API_TOKEN" in result.stderr and "DATAGEN_ALLOW_INSECURE_BIND" in result.stderr


def test_a_secret_never_appears_in_the_refusal() -> None:
    result = _coordinator("--host", "0.0.0.0", DATAGEN_REDIS_URL="redis://:hunter2@127.0.0.1:1/0")
    assert result.returncode == 3 and "hunter2" not in result.stdout + result.stderr
