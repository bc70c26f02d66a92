"""What :class:`~kvactors.logcheck.replay.ManagerReplay` holds for one manager.

It holds the live lifetimes, jobs and pins.
It also holds the helpers that the rules of :mod:`~kvactors.logcheck.lifetimes` and
:mod:`~kvactors.logcheck.jobs` share.

Threading: none. One instance serves one manager, used by one thread.
"""

from __future__ import annotations

from collections.abc import Callable

from kvactors.logcheck.model import Event, Violation

Identity = tuple[str, int]


class Lifetime:
    """One lifetime of a request attempt, from ``request_started`` to ``request_finalized``
    (and then until every tier received its finish)."""

    __slots__ = ("cascades_owed", "ended_jobs", "finalized", "finish_seen", "finished", "jobs", "pending_stores",
                 "roll_call", "started", "store_events", "tier_finalized", "tier_received", "tiers_owed")

    def __init__(self, started: Event) -> None:
        self.started = started
        self.finished: Event | None = None
        self.finish_seen: Event | None = None
        self.finalized: Event | None = None
        self.roll_call: Event | None = None
        self.pending_stores = 0
        self.store_events: list[Event] = []  # the last few, to show
        self.tier_finalized: dict[str, Event] = {}
        self.tier_received: dict[str, Event] = {}
        self.tiers_owed: set[str] = set()  # tier_finalized, not yet tier_finish_received
        self.jobs: dict[int, Job] = {}  # live jobs of this lifetime
        self.ended_jobs: set[int] = set()  # while the lifetime is kept: a second end is caught
        self.cascades_owed: dict[str, int] = {}  # per tier: stores completed whose cascade job is not yet seen

    def note_store(self, event: Event) -> None:
        self.store_events.append(event)
        if len(self.store_events) > 6:
            del self.store_events[0]


class Job:
    """One job (cascade or promotion) from its first event to its end."""

    __slots__ = ("allocated", "events", "kind", "lifetime", "received", "state", "tier")

    def __init__(self, kind: str, tier: str, lifetime: Lifetime | None) -> None:
        self.kind = kind
        self.tier = tier
        self.lifetime = lifetime
        self.events: list[Event] = []
        self.state = "new"  # new | allocated | stale | queued | submitted | timed_out
        self.allocated = False
        self.received = False



class ReplayState:
    """One manager's live state and the report of violations.

    The rules are its subclasses' ``on_<event>`` methods.
    """

    def __init__(self, report: Callable[[Violation], None]) -> None:
        self.report = report
        self.tiers: list[str] = []
        self.started = False
        self.stopped: Event | None = None
        self.unwaited_stop = False  # shutdown_timeout_zero: the engine's stop does not wait for the manager
        self.current: dict[Identity, Lifetime] = {}
        self.draining: dict[Identity, list[Lifetime]] = {}  # finalized, owed a tier's receipt
        self.jobs: dict[int, Job] = {}
        self.pins: dict[Identity, int] = {}
        self.pin_events: dict[Identity, list[Event]] = {}
        self.requests = 0
        self.misuse = 0
        self.resets = 0
        self.notes: list[str] = []  # what this manager's log could not prove (the verdict is INCONCLUSIVE)

    def violation(self, rule: str, message: str, *events: Event | None) -> None:
        self.report(Violation(rule, message, [e for e in events if e is not None]))

    @staticmethod
    def identity(event: Event) -> Identity:
        return (event["req_id"], event["attempt"])
