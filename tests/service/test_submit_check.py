"""The servers a submit's pre-flight reads (`service.submit_check`): a read that let a submit
through serves the submits of the next second, so a burst of small jobs reads the fleet about once
a second, not twice a job; a read a submit was refused with serves no other, and an older read
none. Real Redis, servers published as workers publish them, the real tokenizer and template."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from datagen.clock import now_ms
from datagen.control.keys import Keys
from datagen.control.servers import ServerInfo, ServerView, publish_server
from datagen.errors import DatagenError
from datagen.settings import CoordinatorSettings
from datagen.spec import JobSpec
from datagen.states import ServerState
from service import submit_check
from service.submit_check import SubmitCheck
from tests.support.specs import make_spec

KEYS = Keys("sc")


def _publish(redis_client: redis.Redis, context_len: int | None) -> None:
    publish_server(redis_client, KEYS, "s0", ServerInfo(context_len=context_len, seen_at_ms=now_ms()))
    view = ServerView(state=ServerState.UP, seen_at_ms=now_ms())
    redis_client.hset(KEYS.server_workers("s0"), "w1", view.encode())


def _hgetalls(redis_client: redis.Redis) -> int:
    return int(redis_client.info("commandstats").get("cmdstat_hgetall", {}).get("calls", 0))


def test_a_passed_read_serves_the_next_second_and_a_refused_one_none(
    redis_client: redis.Redis, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    check = SubmitCheck(CoordinatorSettings(redis_url=redis_url, storage=str(tmp_path)), redis_client, KEYS)
    spec = JobSpec.model_validate(make_spec(context_len=None))  # the servers must say it
    _publish(redis_client, None)  # a worker that does not know the server's length yet
    redis_client.config_resetstat()
    with pytest.raises(DatagenError, match="the context length is unknown"):
        check(spec, None)
    _publish(redis_client, 4096)
    # Read afresh (the refused read serves no other): the servers index and the server's views.
    assert check(spec, None).preflight.context_len == 4096
    assert _hgetalls(redis_client) == 4
    for _ in range(20):
        check(spec, None)
    assert _hgetalls(redis_client) == 4
    # A second later the fleet is read again.
    monkeypatch.setattr(submit_check, "SERVERS_REUSE_S", 0.0)
    check(spec, None)
    assert _hgetalls(redis_client) == 6
