"""``Reply``: the one-shot slot an actor answers a blocking call through."""

from __future__ import annotations

import _thread
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Reply(Generic[T]):
    """Set once (by one actor), waited on by any number of threads.

    A lighter ``concurrent.futures.Future`` for the hot path: one lock, held
    until the answer is in, instead of a ``Condition`` and its waiter list.
    It offers the subset of ``Future``'s methods that actors and runtimes use
    (``done``, ``result``, ``exception``, ``set_result``, ``set_exception``),
    so code written against ``Future`` (simulated clients) works with either.

    Thread-safe. Setting it a second time raises ``RuntimeError``.
    :meth:`add_done_callback` lets a waiter that must not block (an asyncio
    loop) be called instead.
    """

    __slots__ = ("_callbacks", "_error", "_gate", "_set", "_value")

    def __init__(self) -> None:
        self._gate = _thread.allocate_lock()
        self._gate.acquire()
        self._set = False
        self._value: T | None = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[Reply[T]], object]] | None = None

    def done(self) -> bool:
        return self._set

    def set_result(self, value: T) -> None:
        self._settle(value, None)

    def set_exception(self, error: BaseException) -> None:
        self._settle(None, error)

    def _settle(self, value: T | None, error: BaseException | None) -> None:
        if self._set:
            raise RuntimeError("a Reply is set once")
        self._value, self._error = value, error
        self._set = True
        self._gate.release()
        if self._callbacks is not None:
            self._run_callbacks()

    def add_done_callback(self, fn: Callable[[Reply[T]], object]) -> None:
        """Call ``fn(self)`` once it is set.

        It runs on the thread that sets it, or here and now if it is set already.
        Each callback runs exactly once, whichever thread wins.
        The thread that runs it pops it from the list, atomically.
        ``fn`` must be short and must not raise.
        Adders of one Reply must not race each other (one waiter adds).
        """
        if self._callbacks is None:
            self._callbacks = []
        self._callbacks.append(fn)
        if self._set:
            self._run_callbacks()

    def _run_callbacks(self) -> None:
        callbacks = self._callbacks
        assert callbacks is not None
        while True:
            try:
                fn = callbacks.pop()
            except IndexError:
                return
            fn(self)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until set or ``timeout`` passed.

        Returns whether it is set.
        """
        if self._set:
            return True
        if self._gate.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
            self._gate.release()  # let the next waiter through
        return self._set

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self.wait(timeout):
            raise TimeoutError("no reply in time")
        return self._error

    def result(self, timeout: float | None = None) -> T:
        error = self.exception(timeout)
        if error is not None:
            raise error
        return self._value  # type: ignore[return-value]
