"""Waking idle claim loops when prompts arrive, instead of polling Redis all the time.

Whatever puts prompts where a claim finds them (a job's backlog, RQ's queue: ingestion, next turns,
resume, retry, the reaper, a hand-back) publishes the class on the namespace's wake channel
(`datagen.keys.Keys.wake_channel`). A worker subscribes on its own connection and sets the class's
event; an idle claim loop waits on it, with a slow poll as the safety net for a message missed
while Redis was away. An idle worker therefore costs Redis a few commands per second, and a warm
one starts a new job's first prompts within a round trip of their enqueue.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable

import redis
from redis import RedisError

from datagen.redistext import as_text
from datagen.states import PromptClass
from workers.redisretry import REDIS_RETRY_MAX_S, REDIS_RETRY_MIN_S

__all__ = ["Wakeups"]

log = logging.getLogger(__name__)

# The subscription's read timeout: how often the listener checks that it should still run (a
# worker's close waits for it).
LISTEN_TIMEOUT_S = 0.25
CONNECT_TIMEOUT_S = 10.0


class Wakeups:
    def __init__(self, redis_url: str, channel: str) -> None:
        self.redis_url = redis_url
        self.channel = channel
        self.events = {cls: asyncio.Event() for cls in PromptClass}

    def wake_all(self) -> None:
        for event in self.events.values():
            event.set()

    async def wait(self, cls: PromptClass, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for prompts of ``cls``; True if woken."""
        event = self.events[cls]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout=timeout_s)
        woken = event.is_set()
        event.clear()
        return woken

    async def run(self) -> None:
        """Listen until cancelled. The subscription lives on a thread with its own connection (a
        blocking read there costs the event loop nothing); a message wakes the loop's events."""
        loop = asyncio.get_running_loop()
        stop = threading.Event()
        thread = threading.Thread(target=self._listen, args=(loop, stop), name="wake-listener", daemon=True)
        thread.start()
        try:
            await asyncio.Event().wait()
        finally:
            stop.set()
            await asyncio.to_thread(thread.join, LISTEN_TIMEOUT_S * 4)

    def _listen(self, loop: asyncio.AbstractEventLoop, stop: threading.Event) -> None:
        """Resubscribe after a Redis outage, and wake every loop then: a message may be lost."""
        delay_s = REDIS_RETRY_MIN_S
        while not stop.is_set():
            client = redis.Redis.from_url(
                self.redis_url, socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=CONNECT_TIMEOUT_S
            )
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(self.channel)
                self._call(loop, self.wake_all)
                delay_s = REDIS_RETRY_MIN_S
                while not stop.is_set():
                    message = pubsub.get_message(timeout=LISTEN_TIMEOUT_S)
                    if message is not None:
                        self._call(loop, self._on_message, message.get("data"))
            except (RedisError, OSError) as exc:
                log.debug("wake-up channel lost (%s); resubscribing in %.1f s", exc, delay_s)
                stop.wait(delay_s)
                delay_s = min(REDIS_RETRY_MAX_S, delay_s * 2)
            finally:
                with contextlib.suppress(Exception):
                    pubsub.close()
                    client.close()

    @staticmethod
    def _call(loop: asyncio.AbstractEventLoop, callback: Callable[..., None], *args: object) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed while the thread stopped
            loop.call_soon_threadsafe(callback, *args)

    def _on_message(self, data: object) -> None:
        try:
            cls = PromptClass(as_text(data)) if isinstance(data, (bytes, str)) else None
        except ValueError:
            cls = None
        if cls is None:
            self.wake_all()
        else:
            self.events[cls].set()
