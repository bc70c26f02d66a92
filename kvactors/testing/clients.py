"""Client threads of the seeded scheduler: real threads that run only while they hold the baton.

A client of a :class:`~kvactors.testing.SimRuntime` is a plain function (a
frontend thread's loop: it calls :class:`~kvactors.TieringManager`'s public
methods, blocking ones included). It runs on a thread of its own, but only
between :meth:`ClientThread.resume` (the scheduler hands it the baton) and
its next :meth:`ClientThread.pause` (it hands the baton back): one thread
runs at a time, so the seed still fixes the whole interleaving.

A blocking call waits through :meth:`SimRuntime.wait
<kvactors.testing.SimRuntime.wait>`, which on a client thread pauses it until
the reply is set (or virtual time passes the bound): the public calls work
unchanged on the scheduler.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from kvactors.actors.reply import Reply


class ClientCancelled(BaseException):
    """Raised in a parked client thread that its scheduler gives up on (not an ``Exception``:
    the client's own ``except Exception`` lets it through)."""


class ClientThread:
    """One client: its thread, what it waits for, and the baton hand-over.

    Two locks, both held while nobody hands anything over: ``_go`` (released
    by :meth:`resume`: the client may run) and ``_back`` (released by the
    client when it pauses or ends: whoever resumed it goes on). Each client
    has its own ``_back``, so a client that resumes another (a stop stepping
    the scheduler) gets the baton back, and nobody else.
    """

    __slots__ = ("_back", "_fn", "_go", "_thread", "cancelled", "deadline", "error", "expect", "finished",
                 "name", "running", "waiting")

    def __init__(self, name: str, fn: Callable[[], object]) -> None:
        self.name = name
        self._fn = fn
        self._go = threading.Lock()
        self._go.acquire()
        self._back = threading.Lock()
        self._back.acquire()
        self.running = False
        self._thread: threading.Thread | None = None
        self.waiting: Reply[Any] | Future[Any] | None = None
        self.deadline: float | None = None
        self.expect: tuple[float, str] | None = None
        self.finished = False
        self.cancelled = False
        self.error: BaseException | None = None

    def runnable(self, now: float) -> bool:
        """Whether :meth:`resume` would let it go on (not waiting, or its wait is over)."""
        waiting = self.waiting
        return not self.finished and not self.running and (waiting is None or waiting.done()
                                      or (self.deadline is not None and now >= self.deadline))

    @property
    def thread_id(self) -> int | None:
        """Its thread's ident, once :meth:`start` ran."""
        return None if self._thread is None else self._thread.ident

    def start(self) -> int:
        """Start its thread (parked until :meth:`resume`); returns the thread's ident."""
        assert self._thread is None
        self._thread = threading.Thread(target=self._main, name=f"sim-{self.name}", daemon=True)
        self._thread.start()
        assert self._thread.ident is not None
        return self._thread.ident

    def resume(self) -> None:
        """The scheduler's side: run the client until it pauses or ends (the caller blocked meanwhile)."""
        self.running = True
        self._go.release()
        self._back.acquire()

    def pause(self) -> None:
        """The client's side: hand the baton back and wait for the next :meth:`resume`."""
        self.running = False
        self._back.release()
        self._go.acquire()
        if self.cancelled:
            raise ClientCancelled

    def wait(self, future: Reply[Any] | Future[Any], deadline: float | None) -> bool:
        """The client's side of a blocking wait: paused until ``future`` is done or
        virtual time reaches ``deadline`` (always paused once: a scheduling point)."""
        self.waiting, self.deadline = future, deadline
        try:
            self.pause()
        finally:
            self.waiting = self.deadline = None
        return future.done()

    def cancel(self) -> None:
        """End a parked client: its pause raises :class:`ClientCancelled`, which unwinds it."""
        if self.finished or self._thread is None:
            self.finished = True
            return
        self.cancelled = True
        self.resume()

    def _main(self) -> None:
        self._go.acquire()
        try:
            if not self.cancelled:
                self._fn()
        except ClientCancelled:
            pass
        except BaseException as exc:  # handed to the scheduler, which raises it where the run is driven
            self.error = exc
        finally:
            self.finished = True
            self.running = False
            self._back.release()
