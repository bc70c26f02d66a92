"""``Reply``: the one-shot slot an actor answers a blocking call through."""

from __future__ import annotations

import _thread
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
    """

    __slots__ = ("_error", "_gate", "_set", "_value")

    def __init__(self) -> None:
        self._gate = _thread.allocate_lock()
        self._gate.acquire()
        self._set = False
        self._value: T | None = None
        self._error: BaseException | None = None

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

    def wait(self, timeout: float | None = None) -> bool:
        """Block until set or ``timeout`` passed; return whether it is set."""
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
