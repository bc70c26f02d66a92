"""Clients of the seeded scheduler: frontend loops that run only while the scheduler lets them.

A client of a :class:`~kvactors.testing.SimRuntime` is a plain function, a frontend thread's loop.
It calls :class:`~kvactors.TieringManager`'s public methods, blocking ones included.
It runs from :meth:`resume`, where the scheduler hands it the baton,
to its next :meth:`pause`, where it hands the baton back.
One client runs at a time, so the seed still fixes the whole interleaving.

A blocking call waits through :meth:`SimRuntime.wait <kvactors.testing.SimRuntime.wait>`.
On a client, that pauses it until the reply is set, or until virtual time passes the bound.
So the public calls work unchanged on the scheduler.

Two carriers give one behaviour, as a seed gives the same run on either.

* :class:`GreenletClient` is a greenlet on the scheduler's thread, where a switch costs about a microsecond.
  It is used where ``greenlet`` is installed (the ``test`` extra).
* :class:`ThreadClient` is used otherwise.
  It is a real thread and two locks.
  A switch is a thread hand-off, tens of microseconds on a loaded machine.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from kvactors.actors.reply import Reply

try:
    import greenlet
except ImportError:  # pragma: no cover - the test extra installs it
    greenlet = None


class ClientCancelled(BaseException):
    """Raised in a parked client that its scheduler gives up on.

    It is not an ``Exception``, so the client's own ``except Exception`` lets it through.
    """


class Client:
    """What the scheduler knows of one client.

    Subclasses carry it, on a thread or a greenlet.
    """

    __slots__ = ("_fn", "cancelled", "credit", "deadline", "error", "expect", "finished", "key", "name",
                 "running", "waiting")

    def __init__(self, name: str, fn: Callable[[], object]) -> None:
        self.name = name
        self._fn = fn
        self.waiting: Reply[Any] | Future[Any] | None = None
        self.deadline: float | None = None
        self.credit = 0.0  # slow-machine stalls the current wait may still be credited (its bound, at most)
        self.expect: tuple[float, str] | None = None
        self.running = False
        self.finished = False
        self.cancelled = False
        self.error: BaseException | None = None
        self.key: object = None
        """What :meth:`start` returned (the scheduler finds the running client by it)."""

    def runnable(self, now: float) -> bool:
        """Whether :meth:`resume` would let it go on (not waiting, or its wait is over)."""
        waiting = self.waiting
        return not self.finished and not self.running and (waiting is None or waiting.done()
                                                           or (self.deadline is not None and now >= self.deadline))

    def wait(self, future: Reply[Any] | Future[Any], deadline: float | None, credit: float = 0.0) -> bool:
        """The client's side of a blocking wait.

        The client is paused until ``future`` is done or virtual time reaches ``deadline``.
        It is always paused once, as the wait is a scheduling point.
        ``credit`` is how much slow-machine stall may push ``deadline`` back, its bound.
        """
        self.waiting, self.deadline, self.credit = future, deadline, credit
        try:
            self.pause()
        finally:
            self.waiting = self.deadline = None
        return future.done()

    def start(self) -> object:
        """Create the client's carrier, parked until :meth:`resume`.

        Returns the key that :func:`current` gives in it.
        """
        raise NotImplementedError

    def resume(self) -> None:
        """The scheduler's side: run the client until it pauses or ends."""
        raise NotImplementedError

    def pause(self) -> None:
        """The client's side: hand the baton back until the next :meth:`resume`."""
        raise NotImplementedError

    def cancel(self) -> None:
        """End a parked client.

        Its pause raises :class:`ClientCancelled`, which unwinds it.
        """
        if self.finished or not self.started:
            self.finished = True
            return
        self.cancelled = True
        self.resume()

    @property
    def started(self) -> bool:
        raise NotImplementedError

    @staticmethod
    def current() -> object:
        """The key of whatever runs now, as :meth:`start` returned it for a client of this carrier."""
        raise NotImplementedError

    def _main(self) -> None:
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


class ThreadClient(Client):
    """A client on a real thread.

    It has two locks, both held while nothing is handed over.
    :meth:`resume` releases ``_go``, and the client may then run.
    The client releases ``_back`` when it pauses or ends, and whoever resumed it then goes on.
    Each client has its own ``_back``, so one that resumes another gets the baton back itself.
    """

    __slots__ = ("_back", "_go", "_thread")

    def __init__(self, name: str, fn: Callable[[], object]) -> None:
        super().__init__(name, fn)
        self._go = threading.Lock()
        self._go.acquire()
        self._back = threading.Lock()
        self._back.acquire()
        self._thread: threading.Thread | None = None

    @property
    def started(self) -> bool:
        return self._thread is not None

    current = staticmethod(threading.get_ident)

    def start(self) -> object:
        assert self._thread is None
        self._thread = threading.Thread(target=self._run, name=f"sim-{self.name}", daemon=True)
        self._thread.start()
        return self._thread.ident

    def resume(self) -> None:
        self.running = True
        self._go.release()
        self._back.acquire()

    def pause(self) -> None:
        self.running = False
        self._back.release()
        self._go.acquire()
        if self.cancelled:
            raise ClientCancelled

    def _run(self) -> None:
        self._go.acquire()
        try:
            self._main()
        finally:
            self._back.release()


class GreenletClient(Client):
    """A client as a greenlet on the scheduler's thread.

    It pauses into whoever resumed it.
    """

    __slots__ = ("_glet",)

    def __init__(self, name: str, fn: Callable[[], object]) -> None:
        super().__init__(name, fn)
        self._glet: Any = None

    @property
    def started(self) -> bool:
        return self._glet is not None

    @staticmethod
    def current() -> object:
        assert greenlet is not None
        return greenlet.getcurrent()

    def start(self) -> object:
        assert self._glet is None and greenlet is not None
        self._glet = greenlet.greenlet(self._main)
        return self._glet

    def resume(self) -> None:
        assert greenlet is not None
        self.running = True
        self._glet.parent = greenlet.getcurrent()  # where it returns: its pause, or its end
        self._glet.switch()

    def pause(self) -> None:
        self.running = False
        self._glet.parent.switch()
        if self.cancelled:
            raise ClientCancelled


ClientThread: type[Client] = GreenletClient if greenlet is not None else ThreadClient
"""The carrier the scheduler uses (see the module docstring)."""
