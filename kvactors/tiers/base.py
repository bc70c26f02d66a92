"""The ``SecondaryTier`` plugin interface."""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, ClassVar, Literal, TypeAlias, get_args

from kvactors.types import JobResult, LookupResult, OffloadingEvent, OffloadKey, ReqContext, TransferJob

if TYPE_CHECKING:
    import torch

InlineCall: TypeAlias = Literal["lookup", "submit_store", "submit_load", "on_new_request", "on_request_finished",
                                "touch"]
"""The name of a tier method the runtime may run on the sender's thread (:attr:`SecondaryTier.inline_calls`)."""

INLINE_CALLS: frozenset[InlineCall] = frozenset(get_args(InlineCall))
"""The methods a tier may name in :attr:`SecondaryTier.inline_calls`."""

Hook: TypeAlias = Literal["on_new_request", "on_request_finished", "touch"]
"""The name of an optional hook of a tier (:attr:`SecondaryTier.hooks`)."""

HOOKS: frozenset[Hook] = frozenset(get_args(Hook))
"""The optional hooks a tier may declare in :attr:`SecondaryTier.hooks`."""

ReportFn = Callable[[JobResult], None]
"""Reports that a job ended, once per job. Thread-safe: it may be called from any thread."""


class SecondaryTier(abc.ABC):
    """A storage tier below the primary (CPU) pool, such as local disk or Redis.

    Preconditions (the runtime guarantees):

    * Each tier instance is owned by one actor. Every method is called on that
      actor's thread, one call at a time, never concurrently, in the order sent.
      The exception: the methods named in :attr:`inline_calls` may instead run on
      the thread that sends them (the supervisor's, or a caller's that claimed it).
      They still run one call at a time with every other method, after every call
      sent before.
    * :meth:`attach` comes first, once.
    * :meth:`drain` then :meth:`shutdown` come last, once.
    * After ``on_request_finished(ctx)`` no ``submit_store``/``submit_load`` for
      ``ctx`` follows.
    * At most :attr:`max_inflight_jobs` jobs are submitted and not yet reported.
    * A job's pool rows are not reused before the job is reported (or, if its
      deadline passed, before its late report).

    The tier is responsible for:

    * Reporting every submitted job exactly once, through :meth:`report`.
      :meth:`report` may be called from any thread (typically the tier's own I/O
      workers). A job reported twice, or after its deadline, is logged and ignored.
    * Never touching a job's pool rows after reporting it.
    * Its own threads, and their safety. Anything they share with the methods
      above is the tier's to lock. :meth:`take_events` may be called while the
      tier's workers run.
    * Its failures. An exception raised by any method is this tier's failure, not
      the runtime's. The job it concerned is reported failed, and the request
      lifecycle still completes. Other tiers and requests are unaffected.

    ``on_request_finished`` does not mean that the request's data is persisted.
    Reports of jobs submitted before it may still be made.
    """

    medium: ClassVar[str] = "STORAGE"
    """Where this tier keeps its blocks, in vLLM's words (``"CPU"`` or ``"STORAGE"``).

    A request's ``kv_load_tiers`` loads only from tiers it matches (:mod:`kvactors.core.request_params`).
    """

    locality: ClassVar[str] = "LOCAL"
    """``"LOCAL"`` (this machine) or ``"REMOTE"`` (shared over the network), as :attr:`medium`."""

    max_inflight_jobs: ClassVar[int] = 16
    """Jobs submitted to this tier and not yet reported, at most. Further jobs
    wait in the supervisor's queue (they still hold their request open)."""

    inline_calls: ClassVar[frozenset[str]] = frozenset()
    """The methods of this tier that return promptly, any of ``INLINE_CALLS``.

    Such a method does no I/O and does not wait on the calling thread.
    Work handed to the tier's own threads is fine.
    While this tier's actor is idle, the runtime may call them on the thread that sends them
    instead of handing them to the actor's thread.
    That thread is the supervisor's, which may be a caller's that claimed it (a serving frontend,
    vLLM's scheduler).
    An inline call is still one call at a time with every other method, after every call sent before.
    A hook the tier does not declare in :attr:`hooks` counts as inline.
    Leave out whatever can block (a network round trip, a blocking write).
    It would stall that thread and the primary tier.
    That happens once at most, as a call that took longer than 0.25 s is never run inline again.
    """

    hooks: ClassVar[frozenset[str]] = frozenset()
    """The optional hooks this tier implements: any of ``HOOKS``.

    The runtime sends ``on_new_request`` and ``touch`` only to a tier that declares them.
    It always sends ``on_request_finished``.
    A hook not declared is a no-op, so it counts as inline (:attr:`inline_calls`).
    A class that does not set ``hooks`` declares its bases' hooks and those its own body defines.
    A wrapper declares its inner tier's (:class:`~kvactors.tiers.wrapper.DelegatingTier`).
    """

    def __init_subclass__(cls, **kwargs: object) -> None:
        """Give a class that does not set :attr:`hooks` its default declaration."""
        super().__init_subclass__(**kwargs)
        if "hooks" in cls.__dict__:
            return
        inherited: frozenset[str] = frozenset()
        for base in cls.__bases__:
            if issubclass(base, SecondaryTier):
                inherited |= base.hooks
            else:  # a mixin: the hooks it defines
                inherited |= {hook for hook in HOOKS if callable(getattr(base, hook, None))}
        cls.hooks = inherited | {hook for hook in HOOKS if hook in cls.__dict__}

    def __init__(self, *, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"tier name must be a non-empty str, got {name!r}")
        self.name = name
        self.pool: torch.Tensor | None = None
        self._report: ReportFn | None = None

    def attach(self, pool: torch.Tensor, report: ReportFn) -> None:
        """Receive the primary pool and the report function.

        Preconditions: called once, before any other method, on the thread that
        calls ``TieringManager.start`` (before the tier's actor exists). ``pool`` is
        the primary pool, ``uint8`` rows ``(num_blocks, block_bytes)``, alive until
        after :meth:`shutdown`.

        The tier is responsible for:

        * Keeping both. The base class does, so call ``super().attach``.
        * Raising ``ValueError`` for a pool it cannot use.
        * Returning promptly. ``start`` waits for it as for a constructor.
          I/O that may hang (a server, a network mount) belongs in the jobs,
          which have deadlines.

        ``report(JobResult)`` may then be called from any thread.
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
        """Report that a job ended, once per job.

        Thread-safe: it may be called from any thread.
        It raises ``RuntimeError`` before :meth:`attach`.
        """
        if self._report is None:
            raise RuntimeError(f"tier {self.name!r} is not attached")
        self._report(result)

    @abc.abstractmethod
    def lookup(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[LookupResult]:
        """One result per key: ``HIT`` if the tier can load it, else ``MISS``
        (or ``RETRY`` when it cannot tell now).

        Preconditions: it runs on the actor's thread (or the sender's, if inline).
        ``keys`` may repeat and may be empty.

        The tier is responsible for answering in order, one result per key, within
        a bound. A ``HIT`` that a later load cannot serve must be a failed load,
        never bad bytes.
        """

    @abc.abstractmethod
    def submit_store(self, job: TransferJob) -> None:
        """Copy ``pool[job.block_ids]`` into the tier under ``job.keys``; report when done.

        Preconditions:

        * The job's request has not finished (see the class).
        * ``job.keys`` and ``job.block_ids`` have one row per key.
        * The rows stay pinned (unchanged) until the job is reported, or until its
          deadline passed and its late report came.

        The tier is responsible for:

        * Returning promptly if it names this method in :attr:`inline_calls`.
        * Reporting exactly once. For a job that ended per key, ``successful_keys``
          names exactly the keys that are stored.
        * Not reading the rows after the report.
        """

    @abc.abstractmethod
    def submit_load(self, job: TransferJob) -> None:
        """Copy the tier's data for ``job.keys`` into ``pool[job.block_ids]``; report when done.

        Preconditions: as :meth:`submit_store`.
        The rows are the tier's to write until the report, and nobody reads them before it.

        The tier is responsible for reporting ``success=False`` if any key is
        missing or fails verification. The rows are then discarded, never served.
        A job may end per key. ``JobResult(..., successful_keys=(...))`` makes only
        those keys' rows ready, and the others are discarded.
        A tier should also forget a key it cannot load, so that a later ``lookup``
        says ``MISS``. The runtime backs off promoting it from this tier meanwhile.
        """

    def on_new_request(self, ctx: ReqContext) -> None:  # noqa: B027 - optional hook
        """First sight of a request attempt.

        Preconditions: it comes before any submit for ``ctx``.

        The tier is responsible for returning promptly, as it may run inline.
        """

    def on_request_finished(self, ctx: ReqContext) -> None:  # noqa: B027 - optional hook
        """No submit for ``ctx`` follows, but reports of earlier jobs still may.

        Preconditions: it comes once per attempt, after its last submit.

        The tier is responsible for:

        * Not taking it as "persisted".
        * Returning promptly.
        """

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:  # noqa: B027
        """A recency hint that ``keys`` were used, present or not.

        It is best effort. The tier is responsible for not raising.
        As it may run inline, the tier is also responsible for not blocking.
        """

    def take_events(self) -> list[OffloadingEvent]:
        """Blocks stored or removed at this tier since the last call, in order.

        Preconditions: it runs on the actor's thread, while the tier's workers may run.

        The tier is responsible for returning each event once.
        That must be thread-safe against its own workers.
        """
        return []

    def drain(self, timeout: float | None) -> None:  # noqa: B027
        """Return when every submitted job has been reported, or ``timeout`` passed.

        Preconditions: it runs on the actor's thread, just before :meth:`shutdown`.
        No submit follows. ``None`` means no bound (the runtime always passes one).

        The tier is responsible for returning within ``timeout``.
        It may report jobs still queued as failed.
        """

    def shutdown(self) -> None:  # noqa: B027
        """Release resources: stop the tier's threads, close its connections.

        Preconditions: called once, last, on the actor's thread, after :meth:`drain`
        (whose timeout may have passed). No other method follows, but a second call is
        possible from a user's cleanup.

        The tier is responsible for:

        * Returning within a bound of its own.
        * Reporting every job still unreported by the time it returns, as failed,
          exactly once.
        * Being idempotent.
        """

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def hooks_of(tier: SecondaryTier) -> frozenset[str]:
    """``tier.hooks``, checked.

    ``ValueError`` if it names a method outside :data:`HOOKS`.
    """
    declared = frozenset(tier.hooks)
    unknown = declared - HOOKS
    if unknown:
        raise ValueError(f"tier {tier.name!r}: hooks names {sorted(unknown)}; choose from {sorted(HOOKS)}")
    return declared


def inline_calls_of(tier: SecondaryTier) -> frozenset[InlineCall]:
    """``tier.inline_calls`` and the hooks it does not declare (no-ops).

    ``ValueError`` if it names a method outside :data:`INLINE_CALLS`, or a hook outside :data:`HOOKS`.
    """
    declared = frozenset(tier.inline_calls)
    unknown = declared - INLINE_CALLS
    if unknown:
        raise ValueError(f"tier {tier.name!r}: inline_calls names {sorted(unknown)}; "
                         f"choose from {sorted(INLINE_CALLS)}")
    hooks = hooks_of(tier)
    not_declared = {hook for hook in HOOKS if hook not in hooks}
    return frozenset(call for call in INLINE_CALLS if call in declared) | not_declared
