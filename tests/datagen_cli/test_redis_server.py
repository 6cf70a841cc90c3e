"""The private Redis of the demo and the tests (`datagen_cli.local.redis_server`): it is ready only
when the process it started answers, never another Redis that holds the port; and the free ports
it hands out, which no two processes get at once."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from datagen.errors import ConfigError
from datagen_cli.local import redis_server
from datagen_cli.local.redis_server import LocalRedis


def test_a_start_on_a_port_another_redis_holds_refuses_instead_of_using_that_one() -> None:
    with LocalRedis() as holder:
        client = redis.Redis(port=holder.port)
        client.set("owner", "the first")
        # Before, a PING answered by the first server made the second look started (3 of 3 tries),
        # and everything after talked to the first one's data.
        for _ in range(3):
            second = LocalRedis(port=holder.port)
            with pytest.raises(ConfigError, match=rf"on port {holder.port} \(is the port taken\?\)"):
                second.start()
            second.stop()
        assert client.get("owner") == b"the first"
        client.close()


def test_a_started_server_answers_with_its_own_process_id() -> None:
    with LocalRedis() as server:
        assert server.process is not None
        info = redis.Redis(port=server.port).info("server")
        assert info["process_id"] == server.process.pid


def test_a_port_handed_out_is_not_handed_out_again_while_its_claim_lasts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(redis_server, "_CLAIMS", tmp_path / "ports")
    # Two processes asking at once (4 test workers, each starting servers) get no port twice.
    claims = str(tmp_path / "ports")
    script = (
        "import pathlib, datagen_cli.local.redis_server as r; "
        f"r._CLAIMS = pathlib.Path({claims!r}); print([r.free_port() for _ in range(300)])"
    )
    other = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    mine = [redis_server.free_port() for _ in range(300)]
    theirs = ast.literal_eval(other.communicate(timeout=60)[0])
    assert len(set(mine) | set(theirs)) == 600
    # A claim lapses: a port whose claim is older than the claim time can be handed out again.
    port = mine[0]
    assert redis_server._claim(port) is False
    stale = time.time() - redis_server._CLAIM_S - 1
    os.utime(tmp_path / "ports" / str(port), (stale, stale))
    assert redis_server._claim(port) is True
