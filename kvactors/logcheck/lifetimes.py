"""The rules of a request's lifetime.

* One finish comes at the primary, the supervisor and every tier, in order.
* Finalize comes only after the finish and the stores.
* The stop's roll call names what is still live.
* What the runtime says of the caller's finishes and refused calls must agree with the replay.

See :mod:`kvactors.logcheck.replay` for the whole contract.

Threading: none, as this is part of one manager's replay.
"""

from __future__ import annotations

from kvactors.logcheck.model import Event
from kvactors.logcheck.state import Lifetime, ReplayState


class LifetimeRules(ReplayState):
    """``request_*``, ``tier_finalized``/``tier_finish_received``, ``call_rejected``, ``finish_ignored``."""

    def on_request_started(self, event: Event) -> None:
        identity = self.identity(event)
        old = self.current.get(identity)
        if old is not None:
            self.violation("one-lifecycle", "request started again before it was finalized", old.started, event)
        self.current[identity] = Lifetime(event)
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

    def stop_lifetimes(self, stopped: Event) -> None:
        """Check at the stop that every lifetime was finalized.

        A lifetime named in the roll call may instead be live, if it is consistent with the log.
        """
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
        # A tier whose actor was left behind at the stop (stuck in a call) logs nothing more: what it
        # still owed is not in the log, and cannot be proven either way.
        abandoned = {name[len("tier-"):] for name in str(stopped.get("abandoned") or "").split(",")
                     if name.startswith("tier-")}
        unproven: dict[str, int] = {}
        for lifetimes in self.draining.values():
            for req in lifetimes:
                for tier in sorted(req.tiers_owed):
                    if tier in abandoned:
                        unproven[tier] = unproven.get(tier, 0) + 1
                        continue
                    self.violation("one-finish", f"tier {tier} was finalized but never received on_request_finished",
                                   req.tier_finalized[tier], stopped)
        for tier, count in sorted(unproven.items()):
            self.notes.append(f"tier {tier}'s actor was left behind at the stop (actor_abandoned): {count} finish(es) "
                              "it was told were not seen received")
