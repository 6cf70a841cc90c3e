"""A TCP proxy in front of a real Redis that loses chosen replies: the command reaches Redis and
is applied, but its reply never reaches the client, whose connection is closed instead (as a
network cut or a restarted load balancer does). What the client library does next (redis-py sends
the command again on a new connection) is what the tests exercise."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress

__all__ = ["ReplyDropper", "reply_dropper"]

BUFFER_BYTES = 65536


class ReplyDropper:
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._needle: bytes | None = None
        self._left = 0
        self.dropped = 0
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def drop_reply(self, needle: bytes, times: int = 1) -> None:
        """Lose the reply to the next ``times`` client writes that contain ``needle``."""
        with self._lock:
            self._needle, self._left = needle, times

    def close(self) -> None:
        self._closed = True
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            doomed = threading.Event()
            threading.Thread(target=self._to_redis, args=(client, upstream, doomed), daemon=True).start()
            threading.Thread(target=self._to_client, args=(upstream, client, doomed), daemon=True).start()

    def _to_redis(self, client: socket.socket, upstream: socket.socket, doomed: threading.Event) -> None:
        try:
            while data := client.recv(BUFFER_BYTES):
                with self._lock:
                    if self._needle is not None and self._left > 0 and self._needle in data:
                        self._left -= 1
                        doomed.set()
                upstream.sendall(data)
        except OSError:
            pass
        finally:
            _close(upstream)

    def _to_client(self, upstream: socket.socket, client: socket.socket, doomed: threading.Event) -> None:
        try:
            while data := upstream.recv(BUFFER_BYTES):
                if doomed.is_set():
                    # The command was applied: its reply is the first data after it. Lose it.
                    self.dropped += 1
                    break
                client.sendall(data)
        except OSError:
            pass
        finally:
            _close(client)
            _close(upstream)


def _close(sock: socket.socket) -> None:
    with suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


@contextmanager
def reply_dropper(upstream_port: int) -> Iterator[ReplyDropper]:
    proxy = ReplyDropper(upstream_port)
    try:
        yield proxy
    finally:
        proxy.close()
