"""The contract's rules, replayed over one manager's events in ``seq`` order.

:class:`ManagerReplay` is a plain class (no I/O, no threads): :meth:`feed` one
event at a time, then :meth:`stop` at ``manager_stopped``. It keeps state only
for what is live: request lifetimes not yet finalized (or finalized but still
owed a tier's receipt), jobs not yet ended (or timed out and owed their late
report) and load pins not yet released. Memory is bounded by those, not by the
log's length.

Every rule is an obligation checked at the latest at ``manager_stopped``:

* **one finish**: one ``request_finished`` per lifetime, then one
  ``request_finish_seen`` (the supervisor); per secondary tier one
  ``tier_finalized`` and, after it, one ``tier_finish_received``; a
  ``request_finalized`` only after ``request_finished`` and every tier's
  ``tier_finalized``;
* **the stop's roll call**: at the stop the primary names every request it still
  holds (``request_active_at_stop``, with ``finished`` and ``pending_stores``).
  A lifetime started and neither finalized nor named there lost its finish
  events; one named must match what the log says of it; a finished one with
  nothing pending at the stop (no store pending, no job in flight) must have
  been finalized;
* **no submit after finish**: no ``store_prepared``/``store_rejected``/
  ``load_prepared`` after ``request_finished``; no job submitted to a tier after
  its ``tier_finalized``; no ``tier_submit_received`` at a tier after its
  ``tier_finish_received``;
* **finalize only when nothing can submit**: at ``tier_finalized`` no primary
  store pending (the checker counts them and the primary's own count, logged
  with ``request_finished``/``request_active_at_stop``, must agree), no
  promotion or cascade allocated or queued but not submitted;
* **every pin released once**: load pins never released more than taken and
  none left at the stop; every job ends once (completed after its tier
  received it, dropped before it was submitted, or timed out and then
  reported late once); a promotion is allocated before anything else;
* **no state after finalize**: nothing creates state for a lifetime that is
  not live; a store completion still counted as pending for none;
* the runtime's own alarms and what it says of the caller's calls
  (``call_rejected``/``finish_ignored`` must agree with the replayed state).

Threading: none; one instance per manager, used by one thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvactors.logcheck.model import Event, Violation

Identity = tuple[str, int]


class _Lifetime:
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
        self.jobs: dict[int, _Job] = {}  # live jobs of this lifetime
        self.ended_jobs: set[int] = set()  # while the lifetime is kept: a second end is caught
        self.cascades_owed: dict[str, int] = {}  # per tier: stores completed whose cascade job is not yet seen

    def note_store(self, event: Event) -> None:
        self.store_events.append(event)
        if len(self.store_events) > 6:
            del self.store_events[0]


class _Job:
    __slots__ = ("allocated", "events", "kind", "lifetime", "received", "state", "tier")

    def __init__(self, kind: str, tier: str, lifetime: _Lifetime | None) -> None:
        self.kind = kind
        self.tier = tier
        self.lifetime = lifetime
        self.events: list[Event] = []
        self.state = "new"  # new | allocated | stale | queued | submitted | timed_out
        self.allocated = False
        self.received = False


class ManagerReplay:
    """The rules for one manager; see the module docstring. ``report`` receives each violation."""

    def __init__(self, report: Callable[[Violation], None]) -> None:
        self.report = report
        self.tiers: list[str] = []
        self.started = False
        self.stopped: Event | None = None
        self.current: dict[Identity, _Lifetime] = {}
        self.draining: dict[Identity, list[_Lifetime]] = {}  # finalized, owed a tier's receipt
        self.jobs: dict[int, _Job] = {}
        self.pins: dict[Identity, int] = {}
        self.pin_events: dict[Identity, list[Event]] = {}
        self.requests = 0
        self.misuse = 0
        self.resets = 0
        self.handlers: dict[str, Callable[[Event], None]] = {
            name[3:]: getattr(self, name) for name in dir(self) if name.startswith("on_")
        }

    # ------------------------------------------------------------ helpers

    def violation(self, rule: str, message: str, *events: Event | None) -> None:
        self.report(Violation(rule, message, [e for e in events if e is not None]))

    @staticmethod
    def identity(event: Event) -> Identity:
        return (event["req_id"], event["attempt"])

    def _job(self, event: Event, kind: str) -> _Job:
        """The live job ``event`` names, created (state ``new``) at its first event."""
        job_id = event["job_id"]
        job = self.jobs.get(job_id)
        if job is None:
            lifetime = self.current.get(self.identity(event)) if "req_id" in event else None
            job = _Job(kind, event["tier"], lifetime)
            if lifetime is not None and job_id in lifetime.ended_jobs:
                self.violation("one-job-end", f"{kind} job {job_id} seen again after it ended", event)
            self.jobs[job_id] = job
            if lifetime is not None:
                lifetime.jobs[job_id] = job
                if kind == "cascade":
                    owed = lifetime.cascades_owed.get(job.tier, 0) - 1
                    if owed < 0:
                        self.violation("one-job-end", f"cascade job {job_id} to tier {job.tier} that no completed "
                                       "store caused", *lifetime.store_events, event)
                    lifetime.cascades_owed[job.tier] = max(owed, 0)
        job.events.append(event)
        if len(job.events) > 8:
            del job.events[1]
        return job

    def _end_job(self, job_id: int, job: _Job) -> None:
        self.jobs.pop(job_id, None)
        if job.lifetime is not None:
            job.lifetime.jobs.pop(job_id, None)
            job.lifetime.ended_jobs.add(job_id)

    def _submit_at_primary(self, event: Event, what: str) -> _Lifetime | None:
        req = self.current.get(self.identity(event))
        if req is None:
            self.violation("no-state-after-finalize", f"{what} for a request not live (never started, or "
                           "already finalized)", event)
        elif req.finished is not None:
            self.violation("no-submit-after-finish", f"{what} at the primary after request_finished",
                           req.finished, event)
        return req

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

    # ------------------------------------------------------------ request lifetime

    def on_request_started(self, event: Event) -> None:
        identity = self.identity(event)
        old = self.current.get(identity)
        if old is not None:
            self.violation("one-lifecycle", "request started again before it was finalized", old.started, event)
        self.current[identity] = _Lifetime(event)
        self.requests += 1

    def on_request_finished(self, event: Event) -> None:
        req = self.current.get(self.identity(event))
        if req is None:
            self.violation("one-finish", "request_finished for a request not live", event)
            return
        if req.finished is not None:
            self.violation("one-finish", "request finished twice at the primary", req.finished, event)
            return
        req.finished = event
        if event["pending_stores"] != req.pending_stores:
            self.violation("finalize-after-stores", f"the primary counts {event['pending_stores']} store(s) "
                           f"pending at the finish, the log {req.pending_stores}", *req.store_events, event)
            req.pending_stores = event["pending_stores"]

    def on_finish_ignored(self, event: Event) -> None:
        req = self.current.get(self.identity(event))
        # known=True with no live lifetime is fine: the primary forgets a request only after its finalize.
        if event["known"] and req is not None and req.finished is None:
            self.violation("one-finish", "a repeated finish ignored, but the log has no first finish",
                           req.started, event)

    def on_request_finish_seen(self, event: Event) -> None:
        req = self.current.get(self.identity(event))
        if req is None or req.finished is None:
            self.violation("one-finish", "the supervisor saw a finish the primary did not log",
                           *(req.started if req else None,), event)
        elif req.finish_seen is not None:
            self.violation("one-finish", "the supervisor saw the finish twice", req.finish_seen, event)
        else:
            req.finish_seen = event

    def on_call_rejected(self, event: Event) -> None:
        req = self.current.get(self.identity(event))
        if event["reason"] == "finished" and req is not None and req.finished is None:
            self.violation("one-finish", f"{event['call']} rejected as after the finish, but the log has no "
                           "finish", req.started, event)
        elif event["reason"] == "unknown" and req is not None and req.finalized is None:
            self.violation("one-lifecycle", f"{event['call']} rejected as for an unknown request, but the log "
                           "has it live", req.started, event)

    def on_tier_finalized(self, event: Event) -> None:
        req = self.current.get(self.identity(event))
        tier = event["tier"]
        if req is None:
            self.violation("one-finish", "tier_finalized for a request not live", event)
            return
        if req.finish_seen is None:
            self.violation("finalize-after-finish", "tier finalized before the supervisor saw the request's "
                           "finish", req.finished or req.started, event)
        if tier in req.tier_finalized:
            self.violation("one-finish", f"tier {tier} finalized twice", req.tier_finalized[tier], event)
            return
        expected = next((t for t in self.tiers if t not in req.tier_finalized), None)
        if expected is not None and tier != expected:
            self.violation("one-finish", f"tier {tier} finalized before tier {expected} (the supervisor tells "
                           "them in the tiers' order)", req.finish_seen or req.started, event)
        req.tier_finalized[tier] = event
        req.tiers_owed.add(tier)
        if req.cascades_owed.get(tier):
            self.violation("finalize-after-stores", f"tier {tier} told finished before the cascade of a completed "
                           "store was submitted or dropped", *req.store_events, event)
        if req.pending_stores > 0:
            self.violation("finalize-after-stores", f"tier {tier} told finished with {req.pending_stores} primary "
                           "store(s) still pending", *req.store_events, event)
        for job_id, job in list(req.jobs.items()):
            if job.tier == tier and job.state in ("new", "allocated", "queued"):
                self.violation("finalize-after-stores", f"tier {tier} told finished while {job.kind} job {job_id} "
                               f"is {job.state}, not submitted", *job.events, event)

    def on_request_finalized(self, event: Event) -> None:
        identity = self.identity(event)
        req = self.current.get(identity)
        if req is None:
            self.violation("one-finish", "request_finalized for a request not live", event)
            return
        if req.finished is None:
            self.violation("finalize-after-finish", "request finalized but never finished", req.started, event)
        missing = [t for t in self.tiers if t not in req.tier_finalized]
        if missing:
            self.violation("one-finish", f"request finalized without telling tier(s) {missing}", req.started, event)
        if req.pending_stores > 0:
            self.violation("finalize-after-stores", f"request finalized with {req.pending_stores} store(s) pending",
                           *req.store_events, event)
        req.finalized = event
        del self.current[identity]
        if req.tiers_owed:
            self.draining.setdefault(identity, []).append(req)

    def on_tier_finish_received(self, event: Event) -> None:
        identity = self.identity(event)
        tier = event["tier"]
        # The tier hears of an older lifetime's finish before anything of a newer one (FIFO from the supervisor).
        candidates = [*self.draining.get(identity, ()), *filter(None, (self.current.get(identity),))]
        owner = next((req for req in candidates if tier in req.tiers_owed), None)
        if owner is None:
            prior = next((req.tier_received[tier] for req in candidates if tier in req.tier_received), None)
            if prior is not None:
                self.violation("one-finish", f"tier {tier} received on_request_finished twice", prior, event)
            else:
                self.violation("one-finish", f"tier {tier} received on_request_finished without its "
                               "tier_finalized", event)
                if candidates:  # still the tier's finish: what it receives after it is checked against it
                    candidates[-1].tier_received[tier] = event
            return
        owner.tiers_owed.discard(tier)
        owner.tier_received[tier] = event
        if owner.finalized is not None and not owner.tiers_owed:
            drained = self.draining[identity]
            drained.remove(owner)
            if not drained:
                del self.draining[identity]

    def on_request_active_at_stop(self, event: Event) -> None:
        req = self.current.get(self.identity(event))
        if req is None:
            self.violation("one-lifecycle", "named at the stop as still held, but not live in the log", event)
            return
        if req.roll_call is not None:
            self.violation("one-lifecycle", "named twice in the stop's roll call", req.roll_call, event)
            return
        req.roll_call = event
        if bool(event["finished"]) != (req.finished is not None):
            self.violation("one-finish", f"the primary says finished={event['finished']} at the stop, the log "
                           f"{'has' if req.finished else 'has no'} request_finished", req.finished or req.started,
                           event)
        if event["pending_stores"] != req.pending_stores:
            self.violation("finalize-after-stores", f"the primary counts {event['pending_stores']} store(s) "
                           f"pending at the stop, the log {req.pending_stores}", *req.store_events, event)

    # ------------------------------------------------------------ stores and loads

    def on_store_prepared(self, event: Event) -> None:
        req = self._submit_at_primary(event, "store_prepared")
        if req is not None and event["keys"]:
            req.pending_stores += event["keys"]
            req.note_store(event)

    def on_store_rejected(self, event: Event) -> None:
        self._submit_at_primary(event, "store_rejected")

    def _stores_done(self, event: Event, count: int) -> None:
        if count <= 0:
            return
        req = self.current.get(self.identity(event))
        if req is None:
            self.violation("finalize-after-stores", f"{count} store(s) completed as pending for a request not "
                           "live (finalized before they completed)", event)
            return
        req.pending_stores -= count
        req.note_store(event)
        if req.pending_stores < 0:
            self.violation("finalize-after-stores", "more stores completed than prepared", *req.store_events)
            req.pending_stores = 0

    def on_store_completed(self, event: Event) -> None:
        self._stores_done(event, event["live"])
        if event["live"] and event["success"] and self.tiers:
            req = self.current.get(self.identity(event))
            if req is not None:  # each stored block cascades to every tier: one job per tier
                for tier in self.tiers:
                    req.cascades_owed[tier] = req.cascades_owed.get(tier, 0) + 1

    def on_cache_reset(self, event: Event) -> None:
        # Promotions the primary allocated before this reset reach the supervisor before it: not stale.
        # Those it allocates after it for a decision taken before it are (see on_promotion_allocated).
        self.resets += 1
        for req in self.current.values():
            req.pending_stores = 0
            req.note_store(event)

    def on_cache_reset_draining(self, event: Event) -> None:
        pass

    def on_load_prepared(self, event: Event) -> None:
        self._submit_at_primary(event, "load_prepared")
        identity = self.identity(event)
        self.pins[identity] = self.pins.get(identity, 0) + event["keys"]
        self.pin_events.setdefault(identity, []).append(event)

    def on_load_completed(self, event: Event) -> None:
        identity = self.identity(event)
        count = self.pins.get(identity, 0) - event["keys"]
        events = self.pin_events.setdefault(identity, [])
        events.append(event)
        if count < 0:
            self.violation("pin-released-once", "more load pins released than taken", *events[-6:])
            count = 0
        if count:
            self.pins[identity] = count
            del events[:-6]
        else:
            self.pins.pop(identity, None)
            del self.pin_events[identity]

    # ------------------------------------------------------------ jobs

    def on_promotion_allocated(self, event: Event) -> None:
        job = self._job(event, "promotion")
        if job.state != "new":
            self.violation("one-job-end", f"promotion {event['job_id']} allocated twice", *job.events)
        job.allocated = True
        job.state = "allocated"
        if event["epoch"] < self.resets:
            job.state = "stale"  # decided before a reset the primary already did: it will be dropped
            return
        if job.lifetime is None:
            self.violation("no-state-after-finalize", "promotion allocated for a request not live", event)

    def on_job_queued(self, event: Event) -> None:
        job = self._job(event, event["kind"])
        if job.state not in ("new", "allocated") or (job.kind == "promotion" and not job.allocated):
            self.violation("one-job-end", f"{job.kind} job queued in state {job.state}", *job.events)
        job.state = "queued"

    def _submitted(self, event: Event, kind: str) -> None:
        job = self._job(event, kind)
        if job.state not in ("new", "allocated", "queued") or (kind == "promotion" and not job.allocated):
            self.violation("one-job-end", f"{kind} submitted in state {job.state}"
                           f"{'' if job.allocated or kind != 'promotion' else ' (never allocated)'}", *job.events)
        job.state = "submitted"
        req = job.lifetime
        tier = event["tier"]
        if req is None:
            self.violation("no-state-after-finalize", f"{kind} submitted for a request not live", event)
        elif tier in req.tier_finalized:
            self.violation("no-submit-after-finish", f"{kind} submitted to tier {tier} after its tier_finalized",
                           req.tier_finalized[tier], event)

    def on_cascade_submitted(self, event: Event) -> None:
        self._submitted(event, "cascade")

    def on_promotion_submitted(self, event: Event) -> None:
        self._submitted(event, "promotion")

    def on_tier_submit_received(self, event: Event) -> None:
        job_id = event["job_id"]
        job = self.jobs.get(job_id)
        tier = event["tier"]
        if job is None or job.state not in ("submitted", "timed_out") or job.received or job.tier != tier:
            self.violation("no-submit-after-finish", f"tier {tier} received job {job_id}, which was not sent to it "
                           "(or received twice)", *(job.events if job else ()), event)
            return
        job.received = True
        job.events.append(event)
        req = job.lifetime
        if req is not None and tier in req.tier_received:
            self.violation("no-submit-after-finish", f"tier {tier} received a submit after on_request_finished",
                           req.tier_received[tier], event)

    def _reported(self, event: Event, kind: str) -> _Job | None:
        job_id = event["job_id"]
        job = self.jobs.get(job_id)
        if job is None or job.state != "submitted" or not job.received or job.kind != kind:
            # Ended twice releases its rows twice; never submitted, it held rows no tier was writing.
            self.violation("pin-released-once", f"{kind} job {job_id} reported by its tier but not in flight there "
                           "(never submitted or received, or already ended)", *(job.events if job else ()), event)
            if job is not None:
                self._end_job(job_id, job)
            return None
        job.events.append(event)
        return job

    def on_cascade_completed(self, event: Event) -> None:
        job = self._reported(event, "cascade")
        if job is not None:
            self._end_job(event["job_id"], job)

    def on_promotion_completed(self, event: Event) -> None:
        job = self._reported(event, "promotion")
        if job is not None:
            self._end_job(event["job_id"], job)

    def on_job_dropped(self, event: Event) -> None:
        job = self._job(event, event["kind"])
        if job.state not in ("new", "allocated", "stale", "queued") or (job.kind == "promotion" and not job.allocated):
            self.violation("one-job-end", f"{job.kind} job {event['job_id']} dropped in state {job.state}",
                           *job.events)
        elif job.state == "new" and job.lifetime is None:
            self.violation("no-state-after-finalize", f"{job.kind} job {event['job_id']} created for a request "
                           "not live", event)
        self._end_job(event["job_id"], job)

    def on_job_timed_out(self, event: Event) -> None:
        if event["kind"] == "store":
            self._stores_done(event, event["keys"])
            return
        job_id = event["job_id"]
        job = self.jobs.get(job_id)
        if job is None or job.state != "submitted" or job.kind != event["kind"]:
            self.violation("one-job-end", f"job {job_id} timed out but was not in flight",
                           *(job.events if job else ()), event)
            return
        job.events.append(event)
        job.state = "timed_out"  # its rows stay held until the late report; a stuck tier may never receive it
        if job.lifetime is not None:
            job.lifetime.jobs.pop(job_id, None)

    def on_late_report_ignored(self, event: Event) -> None:
        job = self.jobs.get(event["job_id"])
        if job is None or job.state != "timed_out":
            self.violation("pin-released-once", "late report (rows released) without a timeout, or twice",
                           *(job.events if job else ()), event)
            return
        if not job.received:
            self.violation("one-job-end", f"late report of job {event['job_id']}, which its tier never received",
                           *job.events, event)
        self._end_job(event["job_id"], job)

    def on_job_report_unexpected(self, event: Event) -> None:
        pass  # a tier reported a job it was not given (the tier's bug); nothing of the contract changes

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
    # A stuck tier's and a bounded stop's alarms: what they end (jobs, gathers) is logged on its own.
    on_tier_stuck = on_tier_unstuck = on_gather_timed_out = on_inline_call_demoted = _ignore
    on_tiers_not_shut_down = on_stop_timed_out = on_actor_abandoned = on_call_unanswered = _ignore

    # ------------------------------------------------------------ at the stop

    def stop(self, stopped: Event) -> None:
        """The obligations that must hold once the manager stopped; frees every state."""
        for req in self.current.values():
            if req.roll_call is None:
                self.violation("one-finish", "request neither finalized nor named at the stop as still held "
                               "(its finish events are missing from the log)", req.started, req.finished, stopped)
                continue
            if req.finished is not None and req.finish_seen is None:
                self.violation("one-finish", "finished, but the supervisor never saw the finish",
                               req.finished, stopped)
            if req.tier_finalized:
                self.violation("one-finish", "tiers finalized but the request never was",
                               *req.tier_finalized.values(), stopped)
            for tier, owed in req.cascades_owed.items():
                if owed:
                    self.violation("one-job-end", f"{owed} completed store(s) never cascaded to tier {tier} "
                                   "(no job submitted or dropped)", *req.store_events, stopped)
            in_flight = [job for job in req.jobs.values() if job.state == "submitted"]
            if req.finished is not None and req.pending_stores == 0 and not in_flight:
                self.violation("one-finish", "finished with nothing pending at the stop, never finalized",
                               req.finished, req.roll_call, stopped)
        for lifetimes in self.draining.values():
            for req in lifetimes:
                for tier in sorted(req.tiers_owed):
                    self.violation("one-finish", f"tier {tier} was finalized but never received on_request_finished",
                                   req.tier_finalized[tier], stopped)
        for job_id, job in self.jobs.items():
            if job.state != "timed_out":  # one timed out may still be stuck at its tier: its report never came
                self.violation("pin-released-once", f"{job.kind} job {job_id} never ended "
                               "(its rows are never released)", *job.events, stopped)
        for identity, count in self.pins.items():
            self.violation("pin-released-once", f"{count} load pin(s) of {identity[0]}#{identity[1]} "
                           "never released", *self.pin_events.get(identity, [])[-6:], stopped)
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
