"""``datagen submit`` against a fleet that is still starting.

A script that starts the stack and submits at once must work every time, so before uploading,
``submit`` waits (up to ``--wait-for-servers-s``, ``DATAGEN_WAIT_FOR_SERVERS_S``) until the
coordinator answers and, when the spec does not give ``context_len``, until a live worker has
reported a server's context length (``GET /servers``, the same facts the coordinator's pre-flight
checks read). A spinner on a terminal, else one line per reason, says what it waits for. A submit
refused with :class:`~datagen.errors.NoServersYetError` (a worker vanished in between) waits and
tries again within the same time; any other refusal needs a person and is raised at once.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import TracebackType
from typing import Any

from rich.console import Console
from rich.status import Status

from datagen.errors import (
    BackendUnavailableError,
    CoordinatorUnreachableError,
    DatagenError,
    NoServersYetError,
    PreflightError,
)
from datagen.states import ServerState
from datagen_cli.client import CoordinatorClient, DatasetSource

__all__ = ["submit_when_ready"]

POLL_INTERVAL_S = 1.0
# A server in one of these states has a live worker that has not refused it
# (datagen.control.servers.live_servers).
_LIVE_STATES = {ServerState.UP, ServerState.DOWN, ServerState.PAUSED, ServerState.DRAINING}


class _Progress:
    """What the wait is waiting for: a spinner on a terminal, else one line per new reason."""

    def __init__(self, console: Console, wait_s: float) -> None:
        self.console = console
        self.wait_s = wait_s
        self.reason: str | None = None
        self.status: Status | None = None

    def __enter__(self) -> _Progress:
        return self

    def show(self, reason: str) -> None:
        if reason == self.reason:
            return
        self.reason = reason
        text = f"{reason} (up to {self.wait_s:g} s; --wait-for-servers-s)"
        if not self.console.is_terminal:
            self.console.print(text, soft_wrap=True, markup=False, highlight=False)
        elif self.status is None:
            self.status = self.console.status(text)
            self.status.start()
        else:
            self.status.update(text)

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        if self.status is not None:
            self.status.stop()


def _not_ready(client: CoordinatorClient, url: str, need_servers: bool) -> str | None:
    """What the submit would wait for now; None when nothing."""
    try:
        servers = client.servers()
    except CoordinatorUnreachableError:
        return f"waiting for the coordinator at {url}"
    except BackendUnavailableError:
        return f"waiting for the coordinator at {url} to reach Redis"
    if not need_servers or any(s.get("context_len") and s["state"] in _LIVE_STATES for s in servers):
        return None
    return "waiting for a worker to report a server's context length"


def _wait_ready(
    client: CoordinatorClient, url: str, need_servers: bool, deadline: float, progress: _Progress
) -> bool:
    """Until ready (True) or ``deadline`` (False)."""
    while (reason := _not_ready(client, url, need_servers)) is not None:
        if time.monotonic() >= deadline:
            return False
        progress.show(reason)
        time.sleep(min(POLL_INTERVAL_S, max(0.0, deadline - time.monotonic())))
    return True


def submit_when_ready(
    client: CoordinatorClient,
    url: str,
    dataset: Path | DatasetSource,
    spec: dict[str, Any],
    job_id: str | None,
    *,
    wait_s: float,
    console: Console,
) -> dict[str, Any]:
    """``client.submit`` once the fleet can take the job, waiting up to ``wait_s`` (0: no wait)."""
    if wait_s <= 0:
        return client.submit(dataset, spec, job_id)
    need_servers = spec.get("context_len") is None
    deadline = time.monotonic() + wait_s
    with _Progress(console, wait_s) as progress:
        while True:
            ready = _wait_ready(client, url, need_servers, deadline, progress)
            try:
                return client.submit(dataset, spec, job_id)
            except PreflightError as exc:
                if isinstance(exc, NoServersYetError) and time.monotonic() < deadline:
                    need_servers = True  # a worker went away in between: wait for one again
                    time.sleep(POLL_INTERVAL_S)
                    continue
                raise _noting_wait(exc, ready, wait_s, progress.reason) from exc.__cause__
            except CoordinatorUnreachableError as exc:
                raise _noting_wait(exc, ready, wait_s, progress.reason) from exc.__cause__


def _noting_wait(exc: DatagenError, ready: bool, wait_s: float, reason: str | None) -> DatagenError:
    """``exc``, saying what the submit waited for in vain, if it did."""
    if ready or reason is None:
        return exc
    return type(exc)(f"{exc} (after {reason} for {wait_s:g} s; --wait-for-servers-s)")
