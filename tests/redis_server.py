"""Run a throwaway ``redis-server`` for tests and benchmarks.

The server binds to 127.0.0.1 on a free port, keeps nothing on disk
(``--save ""``, ``--appendonly no``, its working directory is a temporary
directory) and evicts with ``allkeys-lru`` past ``maxmemory`` (64 MiB by
default), the configuration :class:`kvactors.tiers.redis.RedisTier` documents
for a shared cache.

Usage::

    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        ...
        server.kill()      # SIGKILL, the port stays reserved for restart()
        server.restart()   # same port, empty data

Only the standard library is imported here, so scripts can reuse it by adding
the repository root to ``sys.path``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from types import TracebackType

REDIS_SERVER_BINARY = "redis-server"


def find_redis_server() -> str | None:
    """The path of a ``redis-server`` binary (``$REDIS_SERVER`` first), or None."""
    explicit = os.environ.get("REDIS_SERVER")
    if explicit and os.access(explicit, os.X_OK):
        return explicit
    found = shutil.which(REDIS_SERVER_BINARY)
    if found:
        return found
    for candidate in ("/usr/bin/redis-server", "/usr/local/bin/redis-server"):
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _ping(port: int, timeout: float) -> bool:
    """One raw RESP ``PING`` (no client library needed); True on ``+PONG``."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.sendall(b"*1\r\n$4\r\nPING\r\n")
            reply = b""
            while not reply.endswith(b"\r\n"):
                chunk = sock.recv(64)
                if not chunk:
                    return False
                reply += chunk
            return reply.startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """A ``redis-server`` subprocess on a loopback port.

    Not thread-safe: drive one instance from one thread (the test's).
    ``start()`` returns once the server answers ``PING``; ``kill()`` sends
    SIGKILL and reaps the process; ``restart()`` starts a new, empty server on
    the same port; ``stop()`` ends it for good and removes its directory.
    """

    def __init__(
        self,
        *,
        port: int | None = None,
        maxmemory: str = "64mb",
        binary: str | None = None,
        start_timeout: float = 10.0,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        binary = binary or find_redis_server()
        if binary is None:
            raise FileNotFoundError("no redis-server binary found (install redis-server)")
        self.binary = binary
        self.port = port if port is not None else free_port()
        self.maxmemory = maxmemory
        self.start_timeout = start_timeout
        self.extra_args = tuple(extra_args)
        self._dir = tempfile.mkdtemp(prefix="kvactors-redis-")
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_path = os.path.join(self._dir, "redis.log")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _argv(self) -> list[str]:
        return [
            self.binary,
            "--bind", "127.0.0.1",
            "--port", str(self.port),
            "--save", "",
            "--appendonly", "no",
            "--maxmemory", self.maxmemory,
            "--maxmemory-policy", "allkeys-lru",
            "--dir", self._dir,
            "--logfile", self._log_path,
            "--daemonize", "no",
            "--protected-mode", "yes",
            *self.extra_args,
        ]

    def log_tail(self, n: int = 20) -> str:
        try:
            with open(self._log_path, encoding="utf-8", errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def start(self) -> RedisServer:
        """Start the server and wait (polling, with a deadline) until it answers PING."""
        if self.running:
            return self
        self._proc = subprocess.Popen(
            self._argv(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + self.start_timeout
        delay = 0.005
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"redis-server exited with {self._proc.returncode} on port {self.port}:\n"
                    + self.log_tail()
                )
            if _ping(self.port, timeout=0.5):
                return self
            time.sleep(delay)
            delay = min(delay * 2, 0.1)
        self.kill()
        raise TimeoutError(
            f"redis-server did not answer PING within {self.start_timeout}s:\n" + self.log_tail()
        )

    def kill(self) -> None:
        """SIGKILL the server (no shutdown, no save) and reap it."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)

    def restart(self) -> RedisServer:
        """Kill the server if running, then start a new (empty) one on the same port."""
        self.kill()
        return self.start()

    def stop(self) -> None:
        """Kill the server and remove its directory. Safe to call twice."""
        self.kill()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"RedisServer(port={self.port}, pid={self.pid}, running={self.running})"
