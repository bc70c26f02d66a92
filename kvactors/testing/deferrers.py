"""Where a test tier's later work runs: a :class:`Deferrer`.

On a :class:`~kvactors.testing.SimRuntime` (:class:`SimDeferrer`), deferred work is a task
the scheduler runs at a step of its choosing.
Delays there are virtual time.
On threads (:class:`ThreadDeferrer`), a small fixed pool of worker threads runs it, never a thread per job.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from kvactors.actors import runtime as rt


class Deferrer(Protocol):
    """Runs work "on another thread", now-ish or after a delay."""

    def defer(self, label: str, task: Callable[[], None], delay_s: float = 0.0) -> None: ...

    def hang(self, seconds: float) -> float:
        """Leave the calling tier call stuck for ``seconds``. Returns the delay still
        to add to the work the call schedules (0 where the call really blocked)."""
        ...


@dataclass(frozen=True, slots=True)
class _RunTask:
    label: str
    task: Callable[[], None]


class _TaskActor(rt.Actor):
    name = "sim-tasks"

    @rt.handles(_RunTask)
    def _on_run(self, msg: _RunTask) -> None:
        self.runtime.defer(msg.label, msg.task)  # type: ignore[attr-defined]


class SimDeferrer:
    """Deferred tasks of a :class:`~kvactors.testing.SimRuntime`. Delays are virtual time."""

    def __init__(self, runtime: object) -> None:
        self.runtime = runtime
        self._ref = runtime.spawn(_TaskActor(), "sim-tasks")  # type: ignore[attr-defined]

    def defer(self, label: str, task: Callable[[], None], delay_s: float = 0.0) -> None:
        if delay_s <= 0:
            self.runtime.defer(label, task)  # type: ignore[attr-defined]
        else:
            self.runtime.call_later(delay_s, self._ref, _RunTask(label, task))  # type: ignore[attr-defined]

    def hang(self, seconds: float) -> float:
        """Leave the actor stuck from the moment the call returns.

        What the call started happens after the thaw.
        """
        return seconds if self.runtime.hang_current(seconds) else 0.0  # type: ignore[attr-defined]


class ThreadDeferrer:
    """A fixed pool of worker threads running tasks, each at or after its time."""

    def __init__(self, workers: int = 2, name: str = "kvactors-deferred") -> None:
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self._running = 0
        self.errors: list[str] = []
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
                         for i in range(workers)]
        for thread in self._threads:
            thread.start()

    def defer(self, label: str, task: Callable[[], None], delay_s: float = 0.0) -> None:
        with self._cond:
            if self._closed:
                return
            heapq.heappush(self._heap, (time.monotonic() + max(delay_s, 0.0), next(self._seq), task))
            self._cond.notify()

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (not self._heap or self._heap[0][0] > time.monotonic()):
                    self._cond.wait(None if not self._heap else max(self._heap[0][0] - time.monotonic(), 0.0))
                if self._closed:
                    return
                _, _, task = heapq.heappop(self._heap)
                self._running += 1
            try:
                task()
            except Exception as exc:  # a task's failure is a finding, not a crash
                self.errors.append(f"deferred task raised {exc!r}")
            finally:
                with self._cond:
                    self._running -= 1

    def hang(self, seconds: float) -> float:
        """Block the calling thread for ``seconds`` (or until :meth:`close`)."""
        with self._cond:
            self._cond.wait_for(lambda: self._closed, seconds)
        return 0.0

    def pending(self) -> int:
        """Tasks waiting or running."""
        with self._cond:
            return len(self._heap) + self._running

    def close(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._closed = True
            self._heap.clear()
            self._cond.notify_all()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout)
