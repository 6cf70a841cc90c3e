"""Waking idle claim loops when prompts arrive, instead of polling Redis all the time.

Whatever puts prompts where a claim finds them (a job's backlog, RQ's queue: ingestion, next turns,
resume, retry, the reaper, a hand-back) publishes the class on the namespace's wake channel
(`datagen.control.keys.Keys.wake_channel`). A worker subscribes on its own connection and sets the class's
event; an idle claim loop waits on it, with a slow poll as the safety net for a message missed
while Redis was away. An idle worker therefore costs Redis a few commands per second, and a warm
one starts a new job's first prompts within a round trip of their enqueue.

Wake-ups coalesce, so that no number of messages costs more than a few claims a second:

- each read takes every message already there and hands their classes to the event loop in one
  call (a message is a flag, not a task);
- a claim loop whose wake-up found nothing claims again on a wake-up no sooner than
  ``WAKE_COALESCE_S`` later (:meth:`Wakeups.wait`'s ``hold_until``), and every message meanwhile
  counts with that one wake-up; a claim that found work claims again at once, and an idle poll
  that found nothing holds no wake-up back;
- more than ``WAKE_FLOOD_MESSAGES`` messages in one window is a flood: the listener unsubscribes
  for a window (Redis then sends it nothing, so reading costs nothing either), subscribes again and
  wakes every class once, which covers whatever it did not hear.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Collection

import redis
from redis import RedisError
from redis.client import PubSub

from datagen.backoff import Backoff
from datagen.control.redistext import as_text
from datagen.settings import OUTAGE_RETRY_FIRST_S, OUTAGE_RETRY_MAX_S
from datagen.states import PromptClass

__all__ = ["WAKE_COALESCE_S", "WAKE_FLOOD_MESSAGES", "Wakeups"]

log = logging.getLogger(__name__)

# The subscription's read timeout: how often the listener checks that it should still run (a
# worker's close waits for it).
LISTEN_TIMEOUT_S = 0.25
# The subscription's own Redis connection: its connect and socket timeouts, and the longest wait for
# Redis to confirm an UNSUBSCRIBE (a Redis timeout, not an SGLang one).
SUBSCRIPTION_TIMEOUT_S = 10.0
# The wake-up window: a class whose wake-up found nothing is claimed for again on a wake-up at most
# once per window (at most 2 wake-driven claims a second per class), however many messages arrive.
# A new job's first prompts wait at most this long on a worker woken in vain just before (during a
# flood, up to two windows: one not listening, one held).
WAKE_COALESCE_S = 0.5
# More messages than this within one window is a flood (ingestion publishes one per chunk, a
# hand-back one per prompt): the listener stops listening for a window.
WAKE_FLOOD_MESSAGES = 64


class Wakeups:
    def __init__(self, redis_url: str, channel: str) -> None:
        self.redis_url = redis_url
        self.channel = channel
        self.events = {cls: asyncio.Event() for cls in PromptClass}

    def wake_all(self) -> None:
        for event in self.events.values():
            event.set()

    def answered(self, cls: PromptClass) -> None:
        """A claim of ``cls`` is about to run: it finds every prompt the wake-ups so far told of,
        so they need no claim of their own (a message that lands after this sets the event again)."""
        self.events[cls].clear()

    async def wait(self, cls: PromptClass, timeout_s: float, *, hold_until: float = 0.0) -> bool:
        """Wait up to ``timeout_s`` for prompts of ``cls``; True if woken.

        A wake-up before ``hold_until`` (the event loop's clock) is held until then, and the
        messages that arrive meanwhile count with it: they told of prompts the next claim finds.
        """
        event = self.events[cls]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout=timeout_s)
        woken = event.is_set()
        if woken and (hold_s := hold_until - asyncio.get_running_loop().time()) > 0:
            await asyncio.sleep(hold_s)
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
        backoff = Backoff(OUTAGE_RETRY_FIRST_S, OUTAGE_RETRY_MAX_S)
        while not stop.is_set():
            client = redis.Redis.from_url(
                self.redis_url,
                socket_connect_timeout=SUBSCRIPTION_TIMEOUT_S,
                socket_timeout=SUBSCRIPTION_TIMEOUT_S,
            )
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            pause_s = 0.0
            try:
                pubsub.subscribe(self.channel)
                self._call(loop, self.wake_all)
                backoff.reset()
                self._read(loop, stop, pubsub)
            except (RedisError, OSError) as exc:
                pause_s = backoff.next_s()
                log.debug("wake-up channel lost (%s); resubscribing in %.1f s", exc, pause_s)
            finally:
                with contextlib.suppress(Exception):
                    pubsub.close()
                    client.close()
            stop.wait(pause_s)

    def _read(self, loop: asyncio.AbstractEventLoop, stop: threading.Event, pubsub: PubSub) -> None:
        """Hand wake-ups to the loop until stopped: each read takes the messages already there
        and passes their classes in one call; a flood makes the listener sit out a window."""
        window_end = 0.0
        heard = 0
        while not stop.is_set():
            message = pubsub.get_message(timeout=LISTEN_TIMEOUT_S)
            if message is None:
                continue
            now = time.monotonic()
            if now >= window_end:
                window_end, heard = now + WAKE_COALESCE_S, 0
            payloads: set[object] = set()
            while message is not None and heard <= WAKE_FLOOD_MESSAGES:
                payloads.add(message.get("data"))
                heard += 1
                message = pubsub.get_message(timeout=0.0)
            if message is not None:
                payloads.add(message.get("data"))
            self._call(loop, self._on_messages, payloads)
            if heard > WAKE_FLOOD_MESSAGES:
                self._sit_out(loop, stop, pubsub)
                window_end = 0.0

    def _sit_out(self, loop: asyncio.AbstractEventLoop, stop: threading.Event, pubsub: PubSub) -> None:
        """Unsubscribe for one window, then subscribe again and wake every class (a message may
        have come meanwhile). Redis sends nothing after the UNSUBSCRIBE; the few messages it sent
        before are read up to its confirmation and dropped (this window's wake-up covers them)."""
        log.debug("wake-up flood: not listening for %.2f s", WAKE_COALESCE_S)
        pubsub.unsubscribe(self.channel)
        deadline = time.monotonic() + SUBSCRIPTION_TIMEOUT_S
        while pubsub.subscribed:
            if time.monotonic() > deadline:
                raise redis.TimeoutError("no confirmation of UNSUBSCRIBE from the wake-up channel")
            pubsub.get_message(timeout=LISTEN_TIMEOUT_S)
        if stop.wait(WAKE_COALESCE_S):
            return
        pubsub.subscribe(self.channel)
        self._call(loop, self.wake_all)

    @staticmethod
    def _call(loop: asyncio.AbstractEventLoop, callback: Callable[..., None], *args: object) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed while the thread stopped
            loop.call_soon_threadsafe(callback, *args)

    def _on_messages(self, payloads: Collection[object]) -> None:
        for data in payloads:
            try:
                cls = PromptClass(as_text(data)) if isinstance(data, (bytes, str)) else None
            except ValueError:
                cls = None
            if cls is None:
                self.wake_all()
                return
            self.events[cls].set()
