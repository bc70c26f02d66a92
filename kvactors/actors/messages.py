"""The messages the actors exchange: named tuples, immutable payloads.

Messages are passed by reference, so every field is an immutable value (tuples, frozen dataclasses, ints).
The only mutable thing a message carries is a :class:`~kvactors.actors.reply.Reply`.
Exactly one actor resolves it, exactly once.

They are named tuples rather than frozen dataclasses.
A request's lifecycle sends about twenty messages,
and a frozen dataclass is several times dearer to build (one ``object.__setattr__`` per field).
``docs/performance.md`` has the figures.
Handlers are found by the message's exact type, never by its tuple-ness.

Routing (who sends what to whom) is part of the contract's proof (see :mod:`kvactors.actors.supervisor`).

* frontend (the manager's callers) -> primary carries every public call.
* primary -> supervisor carries lifecycle facts, in the order the primary saw them.
* supervisor -> tiers carries every hook and every submit, as the supervisor is their only sender.
* tiers and their worker threads -> supervisor carries lookup answers and job reports.
* supervisor -> primary carries allocations for promotions, job ends and finalizations.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from kvactors.actors.reply import Reply
from kvactors.core.counters import MetricsSnapshot, PrimaryFigures
from kvactors.core.gathers import GatherKind
from kvactors.types import JobResult, LookupResult, OffloadingEvent, OffloadKey, ReqContext, TransferJob

Keys = tuple[OffloadKey, ...]

# --------------------------------------------------------------- frontend -> primary


class NewRequest(NamedTuple):
    """Not answered: the facade refuses duplicates before it sends one."""

    ctx: ReqContext


class Lookup(NamedTuple):
    keys: Keys
    ctx: ReqContext
    reply: Reply[list[LookupResult]]


class PrepareLoad(NamedTuple):
    keys: Keys
    ctx: ReqContext
    reply: Reply[Any]


class CompleteLoad(NamedTuple):
    keys: Keys
    ctx: ReqContext


class Touch(NamedTuple):
    keys: Keys
    ctx: ReqContext


class PrepareStore(NamedTuple):
    keys: Keys
    ctx: ReqContext
    reply: Reply[Any]


class CompleteStore(NamedTuple):
    keys: Keys
    ctx: ReqContext
    success: bool


class FinishRequest(NamedTuple):
    ctx: ReqContext


class ResetCache(NamedTuple):
    reply: Reply[None]


class TakeEvents(NamedTuple):
    reply: Reply[list[OffloadingEvent]]


class Barrier(NamedTuple):
    """``wait_idle``: resolves once everything sent before it has settled."""

    reply: Reply[bool]


class QueryStats(NamedTuple):
    reply: Reply[dict[str, int | float]]


class QueryMetrics(NamedTuple):
    """The metrics' one round trip: the figures of ``stats()`` and every counter."""

    reply: Reply[Any]


class Shutdown(NamedTuple):
    """``stop``: stop accepting work, drain in-flight jobs, shut the tiers down,
    all within ``budget_s`` (jobs still in flight then fail)."""

    reply: Reply[None]
    budget_s: float


# --------------------------------------------------------------- primary -> supervisor


class RequestStarted(NamedTuple):
    """Sent at once only when some tier wants ``on_new_request``.

    Otherwise the supervisor opens a request's state with its first fact that has ``opens`` set.
    """

    ctx: ReqContext


class StoresExpired(NamedTuple):
    """``expired`` pending keys of a finished request passed their deadline."""

    ctx: ReqContext
    expired: int


class CascadeJob(NamedTuple):
    """A cascade the primary prepared: rows pinned for ``job.job_id`` until it ends."""

    tier: str
    job: TransferJob


class StoresCompleted(NamedTuple):
    """``live`` pending keys of ``ctx`` completed, and ``cascades`` are to be submitted.

    Sent when there are cascades, or when the request is finished (the count matters then).
    ``opens`` marks the first fact about ``ctx`` the supervisor gets (see :class:`RequestStarted`).
    """

    ctx: ReqContext
    live: int
    cascades: tuple[CascadeJob, ...]
    opens: bool = False


class RequestFinished(NamedTuple):
    """``pending_stores``: the request's keys prepared and still pending at its finish.

    ``opens``: the first fact about ``ctx`` the supervisor gets (see :class:`RequestStarted`)."""

    ctx: ReqContext
    pending_stores: int
    opens: bool = False


class SecondaryLookup(NamedTuple):
    """Keys the primary does not hold: ask the tiers, then maybe promote.

    ``results`` is the whole answer so far (MISS at ``missing`` positions).
    ``lookup_id`` was drawn from the shared work sequence by the primary.
    """

    lookup_id: int
    ctx: ReqContext
    keys: Keys
    missing: tuple[int, ...]
    results: tuple[LookupResult, ...]
    reply: Reply[list[LookupResult]]
    opens: bool = False


class PromotionsAllocated(NamedTuple):
    """The primary's answer to :class:`AllocatePromotions`."""

    lookup_id: int
    ctx: ReqContext
    epoch: int
    jobs: tuple[CascadeJob, ...]


class SupervisorReset(NamedTuple):
    reply: Reply[None]


class CollectEvents(NamedTuple):
    events: tuple[OffloadingEvent, ...]
    reply: Reply[list[OffloadingEvent]]


class SupervisorBarrier(NamedTuple):
    """``snapshot``: every unit of work with an origin id below it must settle."""

    snapshot: int
    reply: Reply[bool]


class SupervisorStats(NamedTuple):
    primary: PrimaryFigures
    reply: Reply[dict[str, int | float]]


class SupervisorMetrics(NamedTuple):
    primary: PrimaryFigures
    reply: Reply[MetricsSnapshot]


class SupervisorShutdown(NamedTuple):
    reply: Reply[None]
    budget_s: float


class TouchTiers(NamedTuple):
    keys: Keys
    ctx: ReqContext


# --------------------------------------------------------------- supervisor -> primary


class AllocatePromotions(NamedTuple):
    """Allocate rows for ``plan`` (tier, keys) and answer the lookup."""

    lookup_id: int
    ctx: ReqContext
    epoch: int
    plan: tuple[tuple[str, Keys], ...]
    keys: Keys
    results: tuple[LookupResult, ...]
    reply: Reply[list[LookupResult]]


class JobEnded(NamedTuple):
    """Release what a job holds in the pool.

    With ``hold``, the job timed out, and its rows stay unreusable until :class:`HoldReleased`.
    With ``ok_keys``, the job ended per key, and only these keys of a promotion become ready.
    ``None`` means all keys follow ``success``.
    """

    job_id: int
    is_promotion: bool
    success: bool
    hold: bool
    ok_keys: frozenset[OffloadKey] | None = None


class HoldReleased(NamedTuple):
    job_id: int


class RequestFinalized(NamedTuple):
    ctx: ReqContext


class BarrierFinal(NamedTuple):
    """``idle``: every tier passed the barrier (false only when stop() cut it short)."""

    reply: Reply[bool]
    idle: bool = True


# --------------------------------------------------------------- supervisor <-> tier actors


class TierNewRequest(NamedTuple):
    ctx: ReqContext


class TierFinished(NamedTuple):
    ctx: ReqContext


class TierTouch(NamedTuple):
    keys: Keys
    ctx: ReqContext


class TierSubmit(NamedTuple):
    job: TransferJob


class TierLookup(NamedTuple):
    """``inline_answer`` is given only for a lookup run by a claim (an inline call, on the caller's thread).

    The answer is appended to it instead of coming back as a :class:`TierLookupAnswered`.
    It is a list, not a :class:`Reply`, as nobody waits on it.
    """

    lookup_id: int
    keys: Keys
    ctx: ReqContext
    inline_answer: list[tuple[LookupResult, ...] | None] | None = None


class TierGather(NamedTuple):
    """Ask a tier actor for something it answers with :class:`TierGathered`: ``what``."""

    gather_id: int
    what: GatherKind
    timeout_s: float | None = None


class TierLookupAnswered(NamedTuple):
    lookup_id: int
    tier: str
    results: tuple[LookupResult, ...] | None  # None: the tier failed to answer


class JobReported(NamedTuple):
    tier: str
    result: JobResult


class TierGathered(NamedTuple):
    gather_id: int
    tier: str
    payload: tuple[Any, ...] = ()


# --------------------------------------------------------------- timers


class Tick(NamedTuple):
    """A deadline may have passed."""
