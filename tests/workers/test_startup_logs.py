"""What a worker says when it starts: a server's first contact and a new Redis's first epoch are
news, not alarms. Real Redis, a simulator over real HTTP, the worker's own loop (caplog)."""

from __future__ import annotations

import logging
import re

import pytest
import redis

from datagen.control.epoch import EpochWatch
from datagen.control.servers import read_servers
from datagen.records.storage import Storage
from tests.support.sim import running_simulator
from tests.support.workers import KEYS, settings, start, stop


def _messages(caplog: pytest.LogCaptureFixture, logger: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger]


async def test_first_contact_says_up_with_what_the_server_runs(
    redis_client: redis.Redis,
    redis_url: str,
    storage: Storage,
    tokenizer_path: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    with running_simulator(tokenizer_path=tokenizer_path) as url:
        worker = await start(settings(redis_url, storage), {"sim": url})
        await stop(worker)
    said = _messages(caplog, "workers.fleet.servers")
    assert not [m for m in said if "healthy again" in m]
    ups = [m for m in said if m.startswith("server sim is up")]
    assert len(ups) == 1
    assert re.fullmatch(
        rf"server sim is up: sglang at {re.escape(url)}, model \S+, context length \d+", ups[0]
    ), ups[0]


async def test_a_new_redis_getting_its_epoch_is_no_loss_but_a_later_loss_is(
    redis_client: redis.Redis,
    redis_url: str,
    storage: Storage,
    tokenizer_path: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    coordinator = EpochWatch(redis_client, KEYS)
    with running_simulator(tokenizer_path=tokenizer_path) as url:
        worker = await start(settings(redis_url, storage), {"sim": url})
        try:
            assert redis_client.exists(KEYS.epoch()) == 0  # a brand-new Redis: no coordinator yet
            coordinator.look()
            coordinator.settle(rebuilt=True)  # what a coordinator starting on it does
            worker.sync.sync_once()
            said = _messages(caplog, "workers.fleet.sync")
            assert "Redis has an epoch now (a coordinator set it); publishing this worker's servers" in said
            assert not [m for m in said if "lost its data" in m]
            assert not [r for r in caplog.records if r.levelno >= logging.WARNING]

            # Now a real loss: the epoch and what the worker published are gone.
            redis_client.delete(KEYS.epoch(), KEYS.servers_index())
            coordinator.look()
            coordinator.settle(rebuilt=True)
            worker.sync.sync_once()
            said = _messages(caplog, "workers.fleet.sync")
            assert "Redis lost its data (its epoch changed); publishing this worker's servers again" in said
            assert set(read_servers(redis_client, KEYS)) == {"sim"}
        finally:
            await stop(worker)
