"""The private Redis of the demo and the tests (`datagen_cli.local.redis_server`): it is ready only
when the process it started answers, never another Redis that holds the port."""

from __future__ import annotations

import pytest
import redis

from datagen.errors import ConfigError
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
