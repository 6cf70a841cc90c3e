"""Requests on a hung server (issue 28, item 4): abandoned when its probe marks it down, and backed
up once overdue even while the backlog is not empty.

The server's ``/generate`` never answers (``httpx.MockTransport`` with a handler that sleeps); the
end-to-end case over real processes is ``tests/faults/test_fault_hung_server.py``.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from datagen.errors import ServerUnavailableError
from datagen.states import PromptClass
from workers.engines.http import ClientTimeouts
from workers.engines.sglang import SGLangClient
from workers.fleet.servers import Fleet, Server
from workers.metrics import WorkerMetrics
from workers.run.backup import HUNG_MARGIN, Backups
from workers.run.generate import unless_lost

SHORT = PromptClass.SHORT
LIMITS = {PromptClass.SHORT: 2, PromptClass.LONG: 1}
MAX_NEW = 10
S_PER_TOKEN = 0.01


async def _never_answers(request: httpx.Request) -> httpx.Response:
    await asyncio.sleep(3600)
    raise AssertionError("unreachable")


def _server(name: str) -> Server:
    client = SGLangClient(
        name,
        "http://127.0.0.1:1",
        timeouts=ClientTimeouts(),
        max_connections=4,
        transport=httpx.MockTransport(_never_answers),
    )
    server = Server(name, client, max_limits=dict(LIMITS))
    server.latency_ewma_s, server.tokens_ewma = S_PER_TOKEN * 100, 100.0
    return server


async def test_a_request_on_a_server_its_probe_marks_down_is_abandoned_as_a_server_fault() -> None:
    server = _server("a")
    fleet = Fleet([server], WorkerMetrics())
    request = server.client.generate([1, 2, 3], {"max_new_tokens": MAX_NEW}, rid="r1")
    pending = asyncio.ensure_future(unless_lost(server, request))
    await asyncio.sleep(0.05)
    assert not pending.done()
    await fleet.mark_down(server, "3 /health probes timed out in a row", abandon=True)
    with pytest.raises(ServerUnavailableError) as caught:
        await asyncio.wait_for(pending, 1)
    assert caught.value.server_fault  # retried elsewhere, no attempt charged


async def test_a_mark_down_without_abandon_leaves_requests_running() -> None:
    server = _server("a")
    fleet = Fleet([server], WorkerMetrics())
    request = server.client.generate([1, 2, 3], {"max_new_tokens": MAX_NEW}, rid="r1")
    pending = asyncio.ensure_future(unless_lost(server, request))
    await asyncio.sleep(0.05)
    await fleet.mark_down(server, "/health answered 503")
    await asyncio.sleep(0.05)
    assert not pending.done()
    pending.cancel()
    await asyncio.gather(pending, return_exceptions=True)


async def test_an_overdue_request_is_backed_up_on_an_equally_fast_server_while_the_backlog_lasts() -> None:
    a, b = _server("a"), _server("b")
    fleet = Fleet([a, b], WorkerMetrics())
    backups = Backups(fleet, WorkerMetrics(), enabled=True, is_paused=lambda cls: False)
    fresh = backups.track(a, SHORT, max_new=MAX_NEW, fits=lambda s: True, avoid=frozenset())
    overdue = backups.track(a, SHORT, max_new=MAX_NEW, fits=lambda s: True, avoid=frozenset())
    overdue.started -= HUNG_MARGIN * MAX_NEW * S_PER_TOKEN + 0.1
    backups.mark_overdue(overdue)  # as its race's timer does
    # Not draining: only the overdue request gets a backup, on b although b is no faster.
    backups.freed(SHORT)
    assert overdue.backup_server is b
    assert not fresh.offer.done()
    # Draining: the fresh one, on an equally fast server, still could not win.
    backups.on_claim_empty(SHORT)
    assert not fresh.offer.done()
