"""Calls with a bound: a call that does not return in time is a *hang*, reported with every thread's stack.

:class:`Watch` runs each call on a thread of its own, and the caller waits at most ``bound_s``.
It keeps the hang reports.
It is for a command's few control calls (``stats()``, ``stop()``), never one per request.
"""

from __future__ import annotations

import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any


def all_stacks() -> str:
    """Every thread's stack, for a hang report."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"--- thread {names.get(ident, '?')} ({ident})\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)


class Watch:
    """Runs calls with a bound.

    A call that does not return in time is a hang.
    """

    def __init__(self, bound_s: float) -> None:
        self.bound_s = bound_s
        self.hangs: list[str] = []
        self.lock = threading.Lock()

    def hang(self, what: str) -> None:
        with self.lock:
            self.hangs.append(f"HANG: {what} did not return within {self.bound_s:.1f} s\n{all_stacks()}")

    def call(self, what: str, fn: Callable[[], Any]) -> tuple[bool, Any]:
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:
                box["error"] = exc

        thread = threading.Thread(target=target, name=f"stress-{what}", daemon=True)
        thread.start()
        thread.join(self.bound_s)
        if thread.is_alive():
            self.hang(what)
            return False, None
        if "error" in box:
            raise box["error"]
        return True, box.get("value")
