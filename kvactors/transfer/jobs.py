"""What a submitter (the engine, the vLLM worker) hands to a copier, and what a copier promises back."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar

from kvactors.transfer.runs import Run
from kvactors.types import OffloadKey, ReqContext

Direction = Literal["offload", "onboard"]
OFFLOAD: Direction = "offload"
ONBOARD: Direction = "onboard"

FaultInjector = Callable[[str, ReqContext, Sequence[OffloadKey]], None]
"""The engine's testing hook: ``(direction, ctx, keys)``, called just before a copy; raising fails that copy."""


class CopyTimeoutError(TimeoutError):
    """A copy ran past the engine's ``copy_timeout_s``."""


@dataclass(eq=False, slots=True)
class CopyJob:
    """What a copier copies: ``runs`` from the direction's source to its destination, by a deadline.

    Whoever submits jobs subclasses it with what its own completion needs (:class:`RequestCopy`
    for the engine, the vLLM worker's job for the worker). A copier reads only these fields.
    Immutable once handed to a copier.
    """

    job_id: int
    direction: Direction
    runs: tuple[Run, ...]
    nbytes: int
    blocks: int
    """The blocks (pool rows) it copies, for messages."""
    deadline: float | None
    timeout_s: float | None

    def check_deadline(self) -> None:
        """Raise :class:`CopyTimeoutError` if the job is past its deadline."""
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise CopyTimeoutError(f"{self.direction} copy of {self.blocks} blocks exceeded "
                                   f"copy_timeout_s={self.timeout_s}")


@dataclass(eq=False, slots=True)
class RequestCopy(CopyJob):
    """The :class:`~kvactors.transfer.engine.TransferEngine`'s job: one request's blocks, by key,
    and the future its caller holds."""

    ctx: ReqContext
    keys: tuple[OffloadKey, ...]
    future: Future[Any]


J = TypeVar("J", bound=CopyJob)
"""The job type a copier is built for (its submitter's)."""
J_contra = TypeVar("J_contra", bound=CopyJob, contravariant=True)

JobDone = Callable[[J, BaseException | None], None]
"""The submitter's completion callback: called exactly once per job, from a copier thread,
with ``None`` (copied) or the error; it never raises."""

JobFault = Callable[[J], None]
"""Testing hook of a copier: called with the job just before its copy; raising fails that copy."""


class Copier(Protocol[J_contra]):
    """Moves the bytes of the jobs its submitter (the :class:`~kvactors.transfer.engine.TransferEngine`,
    the vLLM worker) submits, jobs of type ``J_contra``, a :class:`CopyJob`.

    Preconditions (the submitter guarantees):

    * ``submit`` is called from any thread (the caller's of ``offload``/``onboard``),
      possibly from several at once, and never after ``shutdown``.
    * A job's source and destination rows stay reserved (pinned in the pool, held
      by the caller on the device) until the job is reported to ``done``.
    * ``shutdown`` is called once, from the thread that closes the engine, only once
      no job is in flight; ``owns_current_thread`` from any thread.

    The copier is responsible for:

    * Reporting every submitted job exactly once to the submitter's ``done`` callback
      (:data:`JobDone`), from one of its own threads, with ``None`` or the error
      that failed it, and only once nothing touches the job's rows any more.
    * Honouring ``job.deadline`` (:meth:`CopyJob.check_deadline`) before and between
      runs, and calling the fault injector, if any, just before a copy.
    * Never blocking ``submit`` on a copy, and never raising from it.
    """

    def submit(self, job: J_contra) -> None:
        """Take the job; never raises (a failure is reported through ``done``). Thread-safe."""

    def shutdown(self) -> None:
        """Stop the copier's threads (joining them, except the calling thread if it is one);
        only called once, once no job is in flight."""

    def owns_current_thread(self) -> bool:
        """Whether the calling thread is one of the copier's own threads (the engine then
        never waits on itself). Thread-safe."""
