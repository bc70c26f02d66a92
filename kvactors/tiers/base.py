"""The ``SecondaryTier`` plugin interface."""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, ClassVar

from kvactors.types import JobResult, LookupResult, OffloadingEvent, OffloadKey, ReqContext, TransferJob

if TYPE_CHECKING:
    import torch

INLINE_CALLS = frozenset(("lookup", "submit_store", "submit_load", "on_new_request", "on_request_finished", "touch"))
"""The methods a tier may name in :attr:`SecondaryTier.inline_calls`."""

ReportFn = Callable[[JobResult], None]
"""Reports that a job ended. Thread-safe: may be called from any thread, once per job."""


class SecondaryTier(abc.ABC):
    """A storage tier below the primary (CPU) pool: local disk, Redis, ...

    Threading: each tier instance is owned by one actor, and every method below
    is called on that actor's thread, one call at a time, never concurrently.
    The only exception is the ``report`` callable given to :meth:`attach`, which
    the tier may call from any thread (its own I/O workers, typically), and
    the methods named in :attr:`inline_calls`, which may also be called on
    the thread that sends them (still one call at a time, in order).

    Lifecycle contract: after ``on_request_finished(ctx)`` the tier receives no
    ``submit_store``/``submit_load`` for ``ctx``; reports of jobs submitted
    before it may still be made. ``on_request_finished`` does not mean that the
    request's data is persisted.

    Failure: an exception raised by any method is this tier's failure, not the
    runtime's. The job it concerned is reported failed, the request lifecycle
    still completes, and other tiers and requests are unaffected. A job must be
    reported exactly once; a job reported twice, or after its deadline, is
    logged and ignored.
    """

    max_inflight_jobs: ClassVar[int] = 16
    """Jobs submitted to this tier and not yet reported, at most. Further jobs
    wait in the supervisor's queue (they still hold their request open)."""

    inline_calls: ClassVar[frozenset[str]] = frozenset()
    """The methods of this tier that return promptly: no I/O and no waiting
    on the calling thread (work handed to the tier's own threads is fine).
    Any of ``INLINE_CALLS``. While this tier's actor is idle, the runtime
    may call them on the thread that sends them (the supervisor's) instead
    of handing them to the actor's thread: still one call at a time with
    every other method, after every call sent before. A hook the tier does
    not override counts as inline. Leave out whatever can block (a network
    round trip, a blocking write): it would stall the primary tier."""

    def __init__(self, *, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"tier name must be a non-empty str, got {name!r}")
        self.name = name
        self.pool: torch.Tensor | None = None
        self._report: ReportFn | None = None

    def attach(self, pool: torch.Tensor, report: ReportFn) -> None:
        """Called once, before anything else.

        ``pool`` is the primary pool, ``uint8`` rows ``(num_blocks, block_bytes)``;
        ``report(JobResult)`` may be called from any thread.
        """
        self.pool = pool
        self._report = report

    @property
    def block_bytes(self) -> int:
        """The size of one block, known once attached."""
        if self.pool is None:
            raise RuntimeError(f"tier {self.name!r} is not attached")
        return int(self.pool.shape[1])

    def report(self, result: JobResult) -> None:
        """Report that a job ended; thread-safe."""
        if self._report is None:
            raise RuntimeError(f"tier {self.name!r} is not attached")
        self._report(result)

    @abc.abstractmethod
    def lookup(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[LookupResult]:
        """One result per key: ``HIT`` if the tier can load it, else ``MISS``
        (or ``RETRY`` when it cannot tell now)."""

    @abc.abstractmethod
    def submit_store(self, job: TransferJob) -> None:
        """Copy ``pool[job.block_ids]`` into the tier under ``job.keys``; report when done.

        The rows stay pinned (unchanged) until the job is reported.
        """

    @abc.abstractmethod
    def submit_load(self, job: TransferJob) -> None:
        """Copy the tier's data for ``job.keys`` into ``pool[job.block_ids]``; report when done.

        Report ``success=False`` if any key is missing or fails verification:
        the rows are then discarded, never served. A job may end per key:
        ``JobResult(..., successful_keys=(...))`` makes only those keys' rows
        ready; the others are discarded. A tier should also forget a key it
        cannot load (a later ``lookup`` then says ``MISS``); the runtime backs
        off promoting it from this tier meanwhile.
        """

    def on_new_request(self, ctx: ReqContext) -> None:  # noqa: B027 - optional hook
        """First sight of a request attempt."""

    def on_request_finished(self, ctx: ReqContext) -> None:  # noqa: B027 - optional hook
        """No submit for ``ctx`` follows; reports of earlier jobs still may."""

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:  # noqa: B027
        """Recency hint: ``keys`` were used."""

    def take_events(self) -> list[OffloadingEvent]:
        """Blocks stored or removed at this tier since the last call."""
        return []

    def drain(self, timeout: float | None) -> None:  # noqa: B027
        """Return when every submitted job has been reported, or ``timeout`` passed.

        Jobs still queued may be reported as failed.
        """

    def shutdown(self) -> None:  # noqa: B027
        """Release resources. Called once, last."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


_HOOKS = ("on_new_request", "on_request_finished", "touch")


def overrides(tier: SecondaryTier, method: str) -> bool:
    """Whether ``tier``'s class replaces the base class's ``method``."""
    return getattr(type(tier), method) is not getattr(SecondaryTier, method)


def inline_calls_of(tier: SecondaryTier) -> frozenset[str]:
    """``tier.inline_calls`` and the hooks it leaves to the base class (no-ops).

    ``ValueError`` if it names a method outside :data:`INLINE_CALLS`."""
    declared = frozenset(tier.inline_calls)
    unknown = declared - INLINE_CALLS
    if unknown:
        raise ValueError(f"tier {tier.name!r}: inline_calls names {sorted(unknown)}; "
                         f"choose from {sorted(INLINE_CALLS)}")
    inherited = {hook for hook in _HOOKS if not overrides(tier, hook)}
    return declared | inherited
