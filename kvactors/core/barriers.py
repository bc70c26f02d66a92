"""The supervisor's barriers: ``wait_idle`` calls waiting for the work before them to end.

The primary takes each barrier with a *snapshot*, the newest work id it had
handed out then. A barrier is **due** once no job or lookup whose origin is at
most its snapshot is left in the supervisor's books. The supervisor then runs
one round through the tiers and the primary for it.
This book hands each due barrier out once. A stop cuts every barrier still waiting short.

No threads, no I/O, no logging. The supervisor's actor owns one book and is its
only caller. ``R`` is the owner's reply type, carried along untouched.
"""

from __future__ import annotations

from typing import Generic, TypeVar

R = TypeVar("R")


class BarrierBook(Generic[R]):
    """Barriers waiting for the work at or before their snapshot (see the module docstring)."""

    __slots__ = ("waiting",)

    def __init__(self) -> None:
        self.waiting: list[tuple[int, R]] = []
        """The barriers not due yet, in arrival order, with their snapshots (read-only outside)."""

    def __len__(self) -> int:
        return len(self.waiting)

    def add(self, snapshot: int, reply: R) -> None:
        """A barrier behind every work id up to ``snapshot``."""
        self.waiting.append((snapshot, reply))

    def due(self, oldest_origin: int | None) -> list[R]:
        """The barriers no work holds any more, in arrival order, forgotten here.

        ``oldest_origin`` is the smallest origin of the work still in the books
        (``None``: no work is left)."""
        if oldest_origin is None:
            due, self.waiting = self.waiting, []
        else:
            due = [b for b in self.waiting if oldest_origin > b[0]]
            if due:
                self.waiting = [b for b in self.waiting if oldest_origin <= b[0]]
        return [reply for _, reply in due]

    def cut_short(self) -> list[R]:
        """Every barrier still waiting, in arrival order, forgotten here (a stop answers them)."""
        replies = [reply for _, reply in self.waiting]
        self.waiting.clear()
        return replies
