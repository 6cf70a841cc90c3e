"""The epoch (`datagen.control.epoch`) against a real Redis: what the coordinator and a worker each see
when Redis loses its data or goes back to an older snapshot."""

from __future__ import annotations

import redis

from datagen.control.epoch import EpochChange, EpochWatch
from datagen.control.keys import Keys

NS = "epoch"


def _worker_look(worker: EpochWatch, redis_client: redis.Redis, keys: Keys) -> EpochChange:
    raw_id, raw_seq = redis_client.hmget(keys.epoch(), ["id", "seq"])
    return worker.saw(raw_id, raw_seq)


def test_a_worker_that_did_not_look_while_redis_was_empty_still_sees_the_loss(
    redis_client: redis.Redis,
) -> None:
    keys = Keys(NS)
    coordinator, worker = EpochWatch(redis_client, keys), EpochWatch(redis_client, keys)
    assert coordinator.look() is EpochChange.FIRST
    coordinator.stamp()
    assert _worker_look(worker, redis_client, keys) is EpochChange.FIRST
    old_id = coordinator.id

    redis_client.flushall()  # Redis restarted empty
    assert coordinator.look() is EpochChange.LOST
    coordinator.stamp()  # the coordinator rebuilt and stamped before the worker's next look

    assert coordinator.id != old_id
    assert _worker_look(worker, redis_client, keys) is EpochChange.LOST
    assert coordinator.look() is EpochChange.SAME
    assert _worker_look(worker, redis_client, keys) is EpochChange.SAME


def test_a_failed_rebuild_is_seen_as_a_loss_again(redis_client: redis.Redis) -> None:
    keys = Keys(NS)
    coordinator = EpochWatch(redis_client, keys)
    coordinator.look()
    coordinator.stamp()
    redis_client.flushall()
    assert coordinator.look() is EpochChange.LOST
    # The rebuild failed (storage away), so no stamp: the next look finds the loss again.
    assert coordinator.look() is EpochChange.LOST
    coordinator.stamp()
    assert coordinator.look() is EpochChange.SAME


def test_a_rolled_back_redis_keeps_its_id_and_holds_workers_until_the_next_stamp(
    redis_client: redis.Redis,
) -> None:
    keys = Keys(NS)
    coordinator, worker = EpochWatch(redis_client, keys), EpochWatch(redis_client, keys)
    coordinator.look()
    coordinator.stamp()
    snapshot = redis_client.hgetall(keys.epoch())
    _worker_look(worker, redis_client, keys)
    coordinator.look()
    coordinator.stamp()
    assert _worker_look(worker, redis_client, keys) is EpochChange.SAME
    the_id = coordinator.id

    redis_client.hset(keys.epoch(), mapping=snapshot)  # an older snapshot restored
    assert _worker_look(worker, redis_client, keys) is EpochChange.ROLLED_BACK
    assert coordinator.look() is EpochChange.ROLLED_BACK
    coordinator.stamp()
    assert coordinator.id == the_id
    assert _worker_look(worker, redis_client, keys) is EpochChange.SAME
