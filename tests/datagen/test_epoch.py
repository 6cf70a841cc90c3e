"""The epoch (`datagen.control.epoch`) against a real Redis: what coordinators and a worker each see
when Redis loses its data or goes back to an older snapshot, and that no interleaving of two
coordinators' ticks looks like either."""

from __future__ import annotations

import random
import threading

import redis

from datagen.control.epoch import SETTLE_JUMP, EpochChange, EpochWatch
from datagen.control.keys import Keys

NS = "epoch"


def _worker_look(worker: EpochWatch, redis_client: redis.Redis, keys: Keys) -> EpochChange:
    raw_id, raw_seq = redis_client.hmget(keys.epoch(), ["id", "seq"])
    return worker.saw(raw_id, raw_seq)


def _started(redis_client: redis.Redis, keys: Keys) -> EpochWatch:
    """A coordinator after its start: first look, then the settle."""
    watch = EpochWatch(redis_client, keys)
    assert watch.look() is EpochChange.FIRST
    watch.settle(rebuilt=watch.found_none)
    return watch


def test_a_worker_that_did_not_look_while_redis_was_empty_still_sees_the_loss(
    redis_client: redis.Redis,
) -> None:
    keys = Keys(NS)
    coordinator, worker = _started(redis_client, keys), EpochWatch(redis_client, keys)
    assert _worker_look(worker, redis_client, keys) is EpochChange.FIRST
    old_id = coordinator.id

    redis_client.flushall()  # Redis restarted empty
    assert coordinator.look() is EpochChange.LOST
    coordinator.settle(rebuilt=True)  # the coordinator rebuilt and settled before the worker's next look

    assert coordinator.id != old_id
    assert _worker_look(worker, redis_client, keys) is EpochChange.LOST
    assert coordinator.look() is EpochChange.SAME
    assert _worker_look(worker, redis_client, keys) is EpochChange.SAME


def test_a_failed_rebuild_is_seen_as_a_loss_again(redis_client: redis.Redis) -> None:
    keys = Keys(NS)
    coordinator = _started(redis_client, keys)
    redis_client.flushall()
    assert coordinator.look() is EpochChange.LOST
    # The rebuild failed (storage away), so no settle: the next look finds the loss again, and a
    # tick writes nothing into the empty Redis meanwhile.
    assert not coordinator.tick()
    assert coordinator.look() is EpochChange.LOST
    coordinator.settle(rebuilt=True)
    assert coordinator.look() is EpochChange.SAME


def test_a_rolled_back_redis_keeps_its_id_and_holds_workers_until_the_settle(
    redis_client: redis.Redis,
) -> None:
    keys = Keys(NS)
    coordinator, worker = _started(redis_client, keys), EpochWatch(redis_client, keys)
    snapshot = redis_client.hgetall(keys.epoch())
    _worker_look(worker, redis_client, keys)
    for _ in range(3):
        assert coordinator.look() is EpochChange.SAME and coordinator.tick()
    assert _worker_look(worker, redis_client, keys) is EpochChange.SAME
    the_id = coordinator.id

    redis_client.hset(keys.epoch(), mapping=snapshot)  # an older snapshot restored
    assert _worker_look(worker, redis_client, keys) is EpochChange.ROLLED_BACK
    assert coordinator.look() is EpochChange.ROLLED_BACK
    assert not coordinator.tick(), "a tick never lifts a rolled-back counter"
    coordinator.settle(rebuilt=True)
    assert coordinator.id == the_id
    assert _worker_look(worker, redis_client, keys) is EpochChange.SAME


def test_two_coordinators_ticking_in_any_order_never_see_a_change(redis_client: redis.Redis) -> None:
    keys = Keys(NS)
    first, second = _started(redis_client, keys), _started(redis_client, keys)
    worker = EpochWatch(redis_client, keys)
    _worker_look(worker, redis_client, keys)
    seen: list[EpochChange] = []

    def run(watch: EpochWatch, seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(400):
            change = watch.look()
            if change is not EpochChange.SAME:
                seen.append(change)
            if rng.random() < 0.5:
                threading.Event().wait(rng.random() / 5000)  # a look and its tick apart
            watch.tick()

    threads = [threading.Thread(target=run, args=(w, n)) for n, w in enumerate((first, second))]
    for thread in threads:
        thread.start()
    while any(t.is_alive() for t in threads):
        assert _worker_look(worker, redis_client, keys) is EpochChange.SAME
    for thread in threads:
        thread.join()
    assert seen == [], "ticks of two coordinators looked like a loss or a rollback"


def test_a_rollback_seen_by_two_coordinators_is_settled_by_one(redis_client: redis.Redis) -> None:
    keys = Keys(NS)
    first, second = _started(redis_client, keys), _started(redis_client, keys)
    assert first.look() is EpochChange.SAME
    snapshot = redis_client.hgetall(keys.epoch())
    for _ in range(5):
        for watch in (first, second):
            watch.look()
            watch.tick()
    redis_client.hset(keys.epoch(), mapping=snapshot)
    assert first.look() is EpochChange.ROLLED_BACK
    assert second.look() is EpochChange.ROLLED_BACK
    first.settle(rebuilt=True)
    # Settled past every floor: the second has nothing left to reconcile, and ticks on.
    assert second.look() is EpochChange.SAME and second.tick()
    assert first.floor >= int(snapshot[b"seq"]) + SETTLE_JUMP


def test_a_new_epoch_settled_by_another_coordinator_is_taken_as_it_is(redis_client: redis.Redis) -> None:
    keys = Keys(NS)
    first, second = _started(redis_client, keys), _started(redis_client, keys)
    redis_client.flushall()
    assert first.look() is EpochChange.LOST
    assert second.look() is EpochChange.LOST
    first.settle(rebuilt=True)  # the first rebuilt what Redis lost
    assert second.look() is EpochChange.SETTLED
    second.adopt()
    assert second.id == first.id
    assert second.look() is EpochChange.SAME and second.tick()
    assert first.look() is EpochChange.SAME


def test_a_new_epoch_written_without_a_rebuild_is_a_loss(redis_client: redis.Redis) -> None:
    keys = Keys(NS)
    running = _started(redis_client, keys)
    redis_client.flushall()
    # A coordinator started on the emptied Redis, found jobs (so judged nothing lost) and settled.
    redis_client.hset(Keys(NS).job("j"), "state", "running")
    starting = EpochWatch(redis_client, keys)
    assert starting.look() is EpochChange.FIRST and starting.found_none
    starting.settle(rebuilt=False)
    assert running.look() is EpochChange.LOST  # it saw its id go: the loss is its to reconcile


def test_a_snapshot_from_before_a_loss_is_a_rollback_to_everyone(redis_client: redis.Redis) -> None:
    keys = Keys(NS)
    coordinator, worker = _started(redis_client, keys), EpochWatch(redis_client, keys)
    _worker_look(worker, redis_client, keys)
    older = redis_client.hgetall(keys.epoch())
    redis_client.flushall()
    coordinator.look()
    coordinator.settle(rebuilt=True)  # a new id after the loss
    assert _worker_look(worker, redis_client, keys) is EpochChange.LOST

    redis_client.delete(keys.epoch())
    redis_client.hset(keys.epoch(), mapping=older)  # back to a snapshot with the id before the loss
    assert coordinator.look() is EpochChange.ROLLED_BACK
    assert _worker_look(worker, redis_client, keys) is EpochChange.ROLLED_BACK
    coordinator.settle(rebuilt=True)
    assert _worker_look(worker, redis_client, keys) is EpochChange.LOST  # its id again: servers republished
    assert coordinator.look() is EpochChange.SAME
