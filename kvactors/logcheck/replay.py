"""The contract's rules, replayed over one manager's events in ``seq`` order.

:class:`ManagerReplay` is a plain class, with no I/O and no threads.
:meth:`feed` it one event at a time, then call :meth:`stop` at ``manager_stopped``.
It keeps state only for what is live.
That is request lifetimes not yet finalized (or finalized but still owed a tier's receipt),
jobs not yet ended (or timed out and owed their late report), and load pins not yet released.
Memory is bounded by those, not by the log's length.

Every rule is an obligation checked at the latest at ``manager_stopped``.

**One finish.**
Each lifetime has one ``request_finished``, then one ``request_finish_seen`` (the supervisor).
Each secondary tier has one ``tier_finalized`` and, after it, one ``tier_finish_received``.
A ``request_finalized`` comes only after ``request_finished`` and every tier's ``tier_finalized``.

**The stop's roll call.**
At the stop the primary names every request it still holds
(``request_active_at_stop``, with ``finished`` and ``pending_stores``).
A lifetime started and neither finalized nor named there lost its finish events.
One named must match what the log says of it.
A finished one with nothing pending at the stop (no store pending, no job in flight) must have been finalized.

**No submit after finish.**
No ``store_prepared``, ``store_rejected`` or ``load_prepared`` comes after ``request_finished``.
No job is submitted to a tier after its ``tier_finalized``.
No ``tier_submit_received`` comes at a tier after its ``tier_finish_received``.

**Finalize only when nothing can submit.**
At ``tier_finalized`` no primary store is pending.
The checker counts them, and the primary's own count must agree.
The primary logs its count with ``request_finished`` and ``request_active_at_stop``.
No promotion or cascade is allocated or queued but not submitted.

**Every pin released once.**
Load pins are never released more than taken, and none is left at the stop.
Every job ends once.
It is completed after its tier received it, dropped before it was submitted,
or timed out and then reported late once.
A promotion is allocated before anything else.

**One job.**
Every event of a job names the same tier, kind, request and number of keys.
A line that names others would pass one job off as another.

**No state after finalize.**
Nothing creates state for a lifetime that is not live.
No store completion is still counted as pending for such a lifetime.

**The runtime's own word.**
The runtime's own alarms are checked too.
What it says of the caller's calls (``call_rejected``, ``finish_ignored``) must agree with the replayed state.

Threading: none. One instance serves one manager, used by one thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvactors.logcheck.jobs import JobRules
from kvactors.logcheck.lifetimes import LifetimeRules
from kvactors.logcheck.model import Event, Violation
from kvactors.logcheck.state import Identity

__all__ = ["Identity", "ManagerReplay"]


class ManagerReplay(LifetimeRules, JobRules):
    """The rules for one manager (see the module docstring). ``report`` receives each violation.

    ``handlers`` maps each lifecycle event name to its rule, the method ``on_<name>``.
    """

    def __init__(self, report: Callable[[Violation], None]) -> None:
        super().__init__(report)
        self.handlers: dict[str, Callable[[Event], None]] = {
            name[3:]: getattr(self, name) for name in dir(self) if name.startswith("on_")
        }

    # ------------------------------------------------------------ the manager

    def on_manager_started(self, event: Event) -> None:
        if self.started:
            self.violation("one-lifecycle", "manager_started twice in one manager's log", event)
        self.started = True
        self.tiers = [t for t in str(event["tiers"]).split(",") if t][1:]

    def on_manager_stopped(self, event: Event) -> None:
        self.stopped = event
        self.stop(event)

    def on_runtime_stopping(self, event: Event) -> None:
        pass

    def on_shutdown_timeout_zero(self, event: Event) -> None:
        self.unwaited_stop = True  # said in the note of a log that ends without manager_stopped

    # ------------------------------------------------------------ alarms and notes

    def on_contract_violation(self, event: Event) -> None:
        if event["reason"] == "submit_after_finalize":
            self.violation("runtime-guard", "the supervisor's guard refused a submit after finalize", event)
        else:
            self.misuse += 1  # a caller's misuse, rejected and counted: the contract held

    def on_invariant_broken(self, event: Event) -> None:
        self.violation("runtime-error", "a lifecycle counter went below zero", event)

    def on_actor_handler_failed(self, event: Event) -> None:
        self.violation("runtime-error", "an actor's handler raised", event)

    def _ignore(self, event: Event) -> None:
        pass

    on_lookup_timed_out = on_tier_call_failed = on_job_report_invalid = on_report_after_stop = _ignore
    on_promotions_backed_off = _ignore  # a tier's promotions of those keys failed: no rule reads it
    on_pool_events_dropped = _ignore  # notifications nobody took: no block changed
    # A stuck tier's and a bounded stop's alarms: what they end (jobs, gathers) is logged on its own.
    on_tier_stuck = on_tier_unstuck = on_gather_timed_out = on_inline_call_demoted = _ignore
    on_tiers_not_shut_down = on_stop_timed_out = on_actor_abandoned = on_call_unanswered = _ignore

    # ------------------------------------------------------------ at the stop

    def stop(self, stopped: Event) -> None:
        """Check the obligations that must hold once the manager stopped, and free every state."""
        self.stop_lifetimes(stopped)
        self.stop_jobs(stopped)
        self.current.clear()
        self.draining.clear()
        self.jobs.clear()
        self.pins.clear()
        self.pin_events.clear()

    def size(self) -> int:
        """How many things the replay holds (for tests of its memory)."""
        return len(self.current) + sum(map(len, self.draining.values())) + len(self.jobs) + len(self.pins)

    def state(self) -> dict[str, Any]:
        return {"live": len(self.current), "draining": len(self.draining), "jobs": len(self.jobs),
                "pins": len(self.pins)}

