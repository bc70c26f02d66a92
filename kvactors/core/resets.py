"""The supervisor's resets: ``reset_cache`` calls waiting for their jobs and one round through the tiers.

A reset zeroes the counts at once.
Its call returns once two things happened.
Every job in flight at its start ended (reported or timed out), and one round
through the tiers (a barrier gather) ended, so the tiers have processed the
finishes the reset sent. A stop stops waiting for the jobs.

No threads, no I/O, no logging. The supervisor's actor owns one book and is its
only caller. ``R`` is the owner's reply type, carried along untouched. Each
operation returns the replies it finished, in the order the resets began, and
the owner answers them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

R = TypeVar("R")


@dataclass(slots=True, eq=False)
class ResetWait(Generic[R]):
    """One reset, from its start until its reply is due."""

    jobs: set[int]
    """The jobs in flight at its start that have not ended yet."""
    reply: R
    gathered: bool = False
    """Its round through the tiers ended."""

    @property
    def done(self) -> bool:
        return self.gathered and not self.jobs


class ResetBook(Generic[R]):
    """Resets waiting for their jobs and their round (see the module docstring)."""

    __slots__ = ("_waits",)

    def __init__(self) -> None:
        self._waits: list[ResetWait[R]] = []  # in the order the resets began

    def __len__(self) -> int:
        return len(self._waits)

    def begin(self, jobs: Iterable[int], reply: R) -> ResetWait[R]:
        """A reset waiting for ``jobs`` (those in flight now) and its round (the owner starts it)."""
        wait = ResetWait(set(jobs), reply)
        self._waits.append(wait)
        return wait

    def job_over(self, job_id: int) -> list[R]:
        """Job ``job_id`` ended: the replies that were waiting only for it."""
        if not self._waits:  # every job's end comes here: the common case costs nothing
            return []
        for wait in self._waits:
            wait.jobs.discard(job_id)
        return self._take_done()

    def gathered(self, wait: ResetWait[R]) -> list[R]:
        """``wait``'s round ended: its reply if its jobs have ended too."""
        wait.gathered = True
        return self._take_done()

    def cut_short(self) -> list[R]:
        """A stop: no job is waited for any more. The replies whose round has ended too."""
        for wait in self._waits:
            wait.jobs.clear()
        return self._take_done()

    def _take_done(self) -> list[R]:
        done = [wait for wait in self._waits if wait.done]
        if done:
            self._waits = [wait for wait in self._waits if not wait.done]
        return [wait.reply for wait in done]
