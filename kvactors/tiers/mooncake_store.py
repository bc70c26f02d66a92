"""The Mooncake Store client of :class:`~kvactors.tiers.mooncake.MooncakeTier`.

It holds a liveness probe of the master, the connecting, and the *call lane* every store call runs on.

Mooncake's Python API has no per-call timeout.
A call to a frozen segment holder or master blocks 30-40 s.
``setup()`` against a master that does not answer retries for about 90 s, holding the GIL.
Every thread of the process stops meanwhile.
So:

* :func:`master_answers` checks that the master is alive before any ``setup()``.
  It connects to the master's RPC port and sends a few bytes that are not a request.
  A live master closes the connection at once.
  A frozen one, whose kernel still accepts, says nothing until the timeout.
  A dead one refuses.
* :class:`CallLane` runs each store call on one of a fixed number of daemon threads.
  The caller waits at most its own timeout.
  A call that overruns is abandoned to its thread, which returns when Mooncake gives up.
  While no thread of the lane is free, a new call is refused at once (:class:`LaneBusy`), never queued.
  So a store that never answers holds at most ``threads`` threads, whatever the traffic.

Threading: every function and method here may be called from any thread.
"""

from __future__ import annotations

import concurrent.futures
import queue
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

MIN_SEGMENT_BYTES = 16 << 20
"""The smallest segment Mooncake mounts (its default, and its minimum)."""


class LaneBusy(RuntimeError):
    """The call was not made, because every thread of the lane is in a call.

    Some of those calls may be abandoned.
    """


class LaneTimeout(TimeoutError):
    """The call did not return within the caller's timeout. It goes on on its thread."""


def parse_master(master: object) -> tuple[str, int]:
    """``(host, port)`` from ``"host:port"``.

    Raises ``ValueError`` otherwise, or ``TypeError`` for a non-str.
    """
    if not isinstance(master, str):
        raise TypeError(f"master must be a 'host:port' str, got {type(master).__name__}")
    host, sep, port = master.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"master must be 'host:port' with a port in 1..65535, got {master!r}")
    return host.strip("[]"), int(port)


def master_answers(host: str, port: int, timeout_s: float) -> bool:
    """Whether the master at ``host:port`` is alive, within about ``timeout_s`` (see the module)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as conn:
            conn.settimeout(timeout_s)
            conn.sendall(b"\0" * 64)  # not a request: a live master drops the connection
            while True:
                if not conn.recv(4096):
                    return True
    except TimeoutError:
        return False  # accepted by the kernel, never read: frozen
    except OSError:
        return False  # refused, unreachable, reset before our bytes were read...


def connect(host: str, port: int, *, segment_bytes: int, local_buffer_bytes: int, local_host: str,
            timeout_s: float) -> Any:
    """A new ``MooncakeDistributedStore`` set up against the master. Raises ``ConnectionError`` if it cannot.

    It probes the master first (:func:`master_answers`).
    ``setup()`` is only called on a master that answers.
    It blocks, so call it on a lane thread.
    """
    from mooncake.store import MooncakeDistributedStore

    if not master_answers(host, port, timeout_s):
        raise ConnectionError(f"mooncake master {host}:{port} does not answer")
    store = MooncakeDistributedStore()
    code = store.setup(local_host, "P2PHANDSHAKE", segment_bytes, local_buffer_bytes, "tcp", "",
                       f"{host}:{port}")
    if code != 0:
        raise ConnectionError(f"mooncake setup against {host}:{port} failed: code {code}")
    return store


class CallLane:
    """``threads`` daemon threads named ``<thread_name>-N`` that run store calls (see the module).

    ``call(fn, timeout)`` returns ``fn()``'s result or raises what it raised.
    It raises :class:`LaneTimeout` after ``timeout`` seconds.
    It raises :class:`LaneBusy` at once when no thread is free.
    The threads are daemons, so one stuck in Mooncake never holds the interpreter's exit.
    """

    def __init__(self, *, threads: int, thread_name: str) -> None:
        self.threads = threads
        self._lock = threading.Lock()
        self._busy = 0
        self._closed = False
        self._queue: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]] | None] = (
            queue.SimpleQueue())
        self._workers = [threading.Thread(target=self._loop, name=f"{thread_name}-{i}", daemon=True)
                         for i in range(threads)]
        for worker in self._workers:
            worker.start()

    @property
    def in_flight(self) -> int:
        """Calls running now (abandoned ones included), at most ``threads``."""
        with self._lock:
            return self._busy

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Start ``fn`` on a free thread.

        Raises :class:`LaneBusy` if none is free or the lane is closed.
        """
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise LaneBusy("lane closed")
            if self._busy >= self.threads:
                raise LaneBusy(f"all {self.threads} threads of the lane are in calls")
            self._busy += 1
        self._queue.put((fn, future))
        return future

    def call(self, fn: Callable[[], T], timeout: float) -> T:
        """``fn()`` on a lane thread, waited for at most ``timeout`` seconds (see the class)."""
        future = self.submit(fn)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError as exc:
            raise LaneTimeout(f"no answer within {timeout:g} s") from exc

    def close(self, timeout: float) -> int:
        """Refuse new calls and stop the threads. Idempotent.

        It waits up to ``timeout`` seconds for the calls running.
        Returns how many still run, abandoned to their daemon threads.
        """
        with self._lock:
            already, self._closed = self._closed, True
        if not already:
            for _ in self._workers:
                self._queue.put(None)
        deadline = time.monotonic() + timeout
        for worker in self._workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        return sum(worker.is_alive() for worker in self._workers)

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, future = item
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        result = fn()
                    except BaseException as exc:
                        future.set_exception(exc)
                    else:
                        future.set_result(result)
            finally:
                with self._lock:
                    self._busy -= 1
