"""What the engine hands to a copier, and what a copier promises back."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from kvactors.transfer.runs import Run
from kvactors.types import OffloadKey, ReqContext

Direction = Literal["offload", "onboard"]
OFFLOAD: Direction = "offload"
ONBOARD: Direction = "onboard"

FaultInjector = Callable[[str, ReqContext, Sequence[OffloadKey]], None]
"""Testing hook: ``(direction, ctx, keys)``, called just before a copy; raising fails that copy."""


class CopyTimeoutError(TimeoutError):
    """A copy ran past the engine's ``copy_timeout_s``."""


@dataclass(eq=False, slots=True)
class CopyJob:
    """One request's copy: ``runs`` from the direction's source to its destination.

    Immutable once handed to a copier, except that the copier owns ``started``.
    """

    job_id: int
    direction: Direction
    ctx: ReqContext
    keys: tuple[OffloadKey, ...]
    runs: tuple[Run, ...]
    nbytes: int
    future: Future[Any]
    deadline: float | None
    timeout_s: float | None

    def check_deadline(self) -> None:
        """Raise :class:`CopyTimeoutError` if the job is past its deadline."""
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise CopyTimeoutError(f"{self.direction} copy of {len(self.keys)} blocks exceeded "
                                   f"copy_timeout_s={self.timeout_s}")


JobDone = Callable[[CopyJob, BaseException | None], None]
"""The engine's completion callback: called exactly once per job, never raises."""


class Copier(Protocol):
    """Moves the bytes of submitted jobs and reports each exactly once to ``done``."""

    def submit(self, job: CopyJob) -> None:
        """Take the job; never raises (a failure is reported through ``done``)."""

    def shutdown(self) -> None:
        """Stop the copier's threads; only called once no job is in flight."""

    def owns_current_thread(self) -> bool:
        """Whether the calling thread is one of the copier's own threads."""
