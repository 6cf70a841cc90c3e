"""Which servers ``GET /servers`` lists (``service.fleetview``): those some worker publishes a view
of, a dead worker's view aging out after ``VIEWS_TTL_S``; a paused server whatever the workers say.
Real Redis, views written as workers write them."""

from __future__ import annotations

import pytest
import redis

from datagen.clock import now_ms
from datagen.control.keys import Keys
from datagen.control.servers import VIEWS_TTL_S, ServerInfo, ServerView, publish_server
from datagen.errors import UnknownServerError
from datagen.states import ServerState
from service.fleetview import FleetView

KEYS = Keys("fv")
MINUTE_MS = 60_000


def _published(redis_client: redis.Redis, name: str, worker: str, age_ms: int, state: ServerState) -> None:
    publish_server(redis_client, KEYS, name, ServerInfo(context_len=4096, seen_at_ms=now_ms() - age_ms))
    view = ServerView(state=state, seen_at_ms=now_ms() - age_ms)
    redis_client.hset(KEYS.server_workers(name), worker, view.encode())


def test_a_server_no_worker_publishes_any_more_leaves_the_list(redis_client: redis.Redis) -> None:
    _published(redis_client, "s0", "w1", 0, ServerState.UP)
    # A worker that died a minute ago: its view is stale, still shown, and counts for nothing.
    _published(redis_client, "dying", "w2", MINUTE_MS, ServerState.UP)
    # One that died longer ago than VIEWS_TTL_S, under a second name it gave the same server.
    _published(redis_client, "127.0.0.1-30000", "w3", VIEWS_TTL_S * 1000 + MINUTE_MS, ServerState.UP)
    # A name given once, whose worker withdrew its view when it exited.
    publish_server(redis_client, KEYS, "gone", ServerInfo(context_len=4096, seen_at_ms=now_ms()))
    fleet_view = FleetView(redis_client, KEYS)

    shown = {
        s["name"]: (s["state"], [(w["worker"], w["stale"]) for w in s["workers"]])
        for s in fleet_view.servers()
    }
    assert shown == {"s0": ("up", [("w1", False)]), "dying": ("unknown", [("w2", True)])}
    # Asked for by name, a server once reported is shown with the workers that still publish it.
    for name in ("127.0.0.1-30000", "gone"):
        assert (fleet_view.server(name)["state"], fleet_view.server(name)["workers"]) == ("unknown", [])
    with pytest.raises(UnknownServerError) as unknown:
        fleet_view.set_server_paused("nope", True)
    assert str(unknown.value) == "no worker has reported a server named 'nope'; known: dying, s0"


def test_a_dead_workers_old_view_is_not_shown_beside_a_live_one(redis_client: redis.Redis) -> None:
    _published(redis_client, "s0", "old", VIEWS_TTL_S * 1000 + MINUTE_MS, ServerState.DOWN)
    _published(redis_client, "s0", "new", 0, ServerState.UP)
    shown = FleetView(redis_client, KEYS).server("s0")
    assert (shown["state"], [w["worker"] for w in shown["workers"]]) == ("up", ["new"])


def test_a_paused_server_stays_listed_with_no_worker(redis_client: redis.Redis) -> None:
    publish_server(redis_client, KEYS, "s0", ServerInfo(context_len=4096, seen_at_ms=now_ms()))
    redis_client.sadd(KEYS.paused_servers(), "s0")
    fleet_view = FleetView(redis_client, KEYS)
    assert [(s["name"], s["state"]) for s in fleet_view.servers()] == [("s0", "paused")]
    assert fleet_view.set_server_paused("s0", False) == {"name": "s0", "paused": False}
    assert fleet_view.servers() == []
