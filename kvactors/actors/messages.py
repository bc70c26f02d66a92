"""The messages the actors exchange: frozen dataclasses, immutable payloads.

pykka passes messages by reference, so every field is an immutable value
(tuples, frozen dataclasses, ints); the only mutable thing a message carries
is a :class:`~kvactors.actors.reply.Reply`, which exactly one actor resolves, exactly once.

Routing (who sends what to whom) is part of the contract's proof; see
:mod:`kvactors.actors.supervisor`:

* frontend (the manager's callers) -> primary: every public call;
* primary -> supervisor: lifecycle facts, in the order the primary saw them;
* supervisor -> tiers: every hook and every submit (it is their only sender);
* tiers and their worker threads -> supervisor: lookup answers and job reports;
* supervisor -> primary: allocations for promotions, job ends, finalizations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvactors.actors.reply import Reply
from kvactors.types import JobResult, LookupResult, OffloadingEvent, OffloadKey, ReqContext, TransferJob

Keys = tuple[OffloadKey, ...]

# --------------------------------------------------------------- frontend -> primary


@dataclass(frozen=True, slots=True)
class NewRequest:
    """``reply`` is ``None`` when the facade already refused duplicates (nobody waits)."""

    ctx: ReqContext
    reply: Reply[None] | None


@dataclass(frozen=True, slots=True)
class Lookup:
    keys: Keys
    ctx: ReqContext
    reply: Reply[list[LookupResult]]


@dataclass(frozen=True, slots=True)
class PrepareLoad:
    keys: Keys
    ctx: ReqContext
    reply: Reply[Any]


@dataclass(frozen=True, slots=True)
class CompleteLoad:
    keys: Keys
    ctx: ReqContext


@dataclass(frozen=True, slots=True)
class Touch:
    keys: Keys
    ctx: ReqContext


@dataclass(frozen=True, slots=True)
class PrepareStore:
    keys: Keys
    ctx: ReqContext
    reply: Reply[Any]


@dataclass(frozen=True, slots=True)
class CompleteStore:
    keys: Keys
    ctx: ReqContext
    success: bool


@dataclass(frozen=True, slots=True)
class FinishRequest:
    ctx: ReqContext


@dataclass(frozen=True, slots=True)
class ResetCache:
    reply: Reply[None]


@dataclass(frozen=True, slots=True)
class TakeEvents:
    reply: Reply[list[OffloadingEvent]]


@dataclass(frozen=True, slots=True)
class Barrier:
    """``wait_idle``: resolves once everything sent before it has settled."""

    reply: Reply[bool]


@dataclass(frozen=True, slots=True)
class QueryStats:
    reply: Reply[dict[str, int | float]]


@dataclass(frozen=True, slots=True)
class Shutdown:
    """``stop``: stop accepting work, drain in-flight jobs, shut the tiers down."""

    reply: Reply[None]
    drain_timeout_s: float | None


# --------------------------------------------------------------- primary -> supervisor


@dataclass(frozen=True, slots=True)
class RequestStarted:
    """Sent at once only when some tier wants ``on_new_request``; otherwise the
    supervisor opens a request's state with its first fact that has ``opens`` set."""

    ctx: ReqContext


@dataclass(frozen=True, slots=True)
class StoresExpired:
    """``count`` pending keys of a finished request passed their deadline."""

    ctx: ReqContext
    count: int


@dataclass(frozen=True, slots=True)
class CascadeJob:
    """A cascade the primary prepared: rows pinned for ``job.job_id`` until it ends."""

    tier: str
    job: TransferJob


@dataclass(frozen=True, slots=True)
class StoresCompleted:
    """``live`` pending keys of ``ctx`` completed; ``cascades`` are to be submitted.

    Sent when there are cascades, or when the request is finished (the count matters then).
    ``opens``: the first fact about ``ctx`` the supervisor gets (see :class:`RequestStarted`)."""

    ctx: ReqContext
    live: int
    cascades: tuple[CascadeJob, ...]
    opens: bool = False


@dataclass(frozen=True, slots=True)
class RequestFinished:
    """``pending_stores``: the request's keys prepared and still pending at its finish.

    ``opens``: the first fact about ``ctx`` the supervisor gets (see :class:`RequestStarted`)."""

    ctx: ReqContext
    pending_stores: int
    opens: bool = False


@dataclass(frozen=True, slots=True)
class SecondaryLookup:
    """Keys the primary does not hold: ask the tiers, then maybe promote.

    ``results`` is the whole answer so far (MISS at ``missing`` positions);
    ``lookup_id`` was drawn from the shared work sequence by the primary.
    """

    lookup_id: int
    ctx: ReqContext
    keys: Keys
    missing: tuple[int, ...]
    results: tuple[LookupResult, ...]
    reply: Reply[list[LookupResult]]
    opens: bool = False


@dataclass(frozen=True, slots=True)
class PromotionsAllocated:
    """The primary's answer to :class:`AllocatePromotions`."""

    lookup_id: int
    ctx: ReqContext
    epoch: int
    jobs: tuple[CascadeJob, ...]


@dataclass(frozen=True, slots=True)
class SupervisorReset:
    reply: Reply[None]


@dataclass(frozen=True, slots=True)
class CollectEvents:
    events: tuple[OffloadingEvent, ...]
    reply: Reply[list[OffloadingEvent]]


@dataclass(frozen=True, slots=True)
class SupervisorBarrier:
    """``snapshot``: every unit of work with an origin id below it must settle."""

    snapshot: int
    reply: Reply[bool]


@dataclass(frozen=True, slots=True)
class SupervisorStats:
    stats: tuple[tuple[str, int | float], ...]
    reply: Reply[dict[str, int | float]]


@dataclass(frozen=True, slots=True)
class SupervisorShutdown:
    reply: Reply[None]
    drain_timeout_s: float | None


@dataclass(frozen=True, slots=True)
class TouchTiers:
    keys: Keys
    ctx: ReqContext


# --------------------------------------------------------------- supervisor -> primary


@dataclass(frozen=True, slots=True)
class AllocatePromotions:
    """Allocate rows for ``plan`` (tier, keys) and answer the lookup."""

    lookup_id: int
    ctx: ReqContext
    epoch: int
    plan: tuple[tuple[str, Keys], ...]
    keys: Keys
    results: tuple[LookupResult, ...]
    reply: Reply[list[LookupResult]]


@dataclass(frozen=True, slots=True)
class JobEnded:
    """Release what a job holds in the pool. ``hold``: it timed out; keep its rows
    unreusable until :class:`HoldReleased`."""

    job_id: int
    is_promotion: bool
    success: bool
    hold: bool


@dataclass(frozen=True, slots=True)
class HoldReleased:
    job_id: int


@dataclass(frozen=True, slots=True)
class RequestFinalized:
    ctx: ReqContext


@dataclass(frozen=True, slots=True)
class BarrierFinal:
    reply: Reply[bool]


# --------------------------------------------------------------- supervisor <-> tier actors


@dataclass(frozen=True, slots=True)
class TierNewRequest:
    ctx: ReqContext


@dataclass(frozen=True, slots=True)
class TierFinished:
    ctx: ReqContext


@dataclass(frozen=True, slots=True)
class TierTouch:
    keys: Keys
    ctx: ReqContext


@dataclass(frozen=True, slots=True)
class TierSubmit:
    job: TransferJob


@dataclass(frozen=True, slots=True)
class TierLookup:
    lookup_id: int
    keys: Keys
    ctx: ReqContext


@dataclass(frozen=True, slots=True)
class TierGather:
    """Ask a tier actor for something it answers with :class:`TierGathered`:
    ``what`` is ``"barrier"``, ``"events"`` or ``"shutdown"``."""

    gather_id: int
    what: str
    timeout_s: float | None = None


@dataclass(frozen=True, slots=True)
class TierLookupAnswered:
    lookup_id: int
    tier: str
    results: tuple[LookupResult, ...] | None  # None: the tier failed to answer


@dataclass(frozen=True, slots=True)
class JobReported:
    tier: str
    result: JobResult


@dataclass(frozen=True, slots=True)
class TierGathered:
    gather_id: int
    tier: str
    payload: tuple[Any, ...] = ()


# --------------------------------------------------------------- timers


@dataclass(frozen=True, slots=True)
class Tick:
    """A deadline may have passed."""
