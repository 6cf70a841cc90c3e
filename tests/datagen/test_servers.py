"""The stored forms of what workers publish about servers (``datagen.control.servers``): written
byte for byte as earlier releases wrote them, read back whatever an older or newer release wrote."""

from __future__ import annotations

import json

from datagen.control.servers import ControllerPhase, ServerControl, ServerInfo, ServerView
from datagen.states import ServerState


def test_a_view_is_written_as_the_sorted_json_earlier_releases_wrote() -> None:
    fields = {
        "state": ServerState.UP,
        "in_flight": {"short": 3, "long": 0},
        "limits": {"short": 8, "long": 2},
        "factor": 0.1235,
        "context_len": 32768,
        "model_path": "deepseek-ai/DeepSeek-R1",
        "weight_version": None,
        "refused": None,
        "metrics": "10.0.0.5:9101",
        "seen_at_ms": 1_700_000_000_000,
    }
    view = ServerView(**fields)
    assert view.encode() == json.dumps(fields, sort_keys=True)
    assert ServerView.decode(view.encode()) == view


def test_a_view_keeps_only_the_fields_its_release_wrote() -> None:
    older = ServerView.decode('{"seen_at_ms": 5, "state": "up", "unknown_field": 1}')
    assert (older.state, older.in_flight, older.metrics) == (ServerState.UP, {}, None)
    assert older.to_json() == {"seen_at_ms": 5, "state": "up"}
    assert ServerView.decode('{"state": "hibernating"}').state is ServerState.UNKNOWN


def test_a_server_refused_before_it_was_read_is_written_by_name_alone() -> None:
    assert ServerInfo(seen_at_ms=3).encode() == '{"seen_at_ms": 3}'
    unread = ServerInfo(context_len=None, model_path=None, weight_version=None, seen_at_ms=3)
    assert json.loads(unread.encode()) == {
        "context_len": None,
        "model_path": None,
        "weight_version": None,
        "seen_at_ms": 3,
    }


def test_the_control_hash_writes_the_fields_given_and_reads_what_it_knows() -> None:
    control = ServerControl(
        target=16,
        ceiling=100,
        factor=0.16,
        phase=ControllerPhase.SLOW_START,
        signals={"num_queue_reqs": 0, "token_usage": 0.5},
        reason=None,
    )
    assert control.encode() == {
        "target": 16,
        "ceiling": 100,
        "factor": 0.16,
        "phase": "slow_start",
        "signals": '{"num_queue_reqs": 0, "token_usage": 0.5}',
    }
    read = ServerControl.decode({k.encode(): str(v).encode() for k, v in control.encode().items()})
    assert read == control
    odd = ServerControl.decode({b"target": b"40", b"phase": b"cruising", b"signals": b"[1]", b"new": b"x"})
    assert (odd.target, odd.phase, odd.signals) == (40, None, None)
