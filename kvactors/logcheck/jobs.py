"""The rules of stores, load pins and jobs.

No submit comes after the finish.
Every pin and job is released once.
Each completed store has a cascade.
A promotion is allocated before anything else.
See :mod:`kvactors.logcheck.replay` for the whole contract.

Threading: none, as this is part of one manager's replay.
"""

from __future__ import annotations

from kvactors.logcheck.model import Event
from kvactors.logcheck.state import Job, Lifetime, ReplayState


class JobRules(ReplayState):
    """``store_*``, ``load_*``, ``cache_reset``, ``promotion_allocated``, ``job_*``, ``*_submitted``,
    ``*_completed``, ``tier_submit_received``, ``late_report_ignored``."""

    def _job(self, event: Event, kind: str) -> Job:
        """The live job ``event`` names, created (state ``new``) at its first event."""
        job_id = event["job_id"]
        job = self.jobs.get(job_id)
        if job is not None:
            self._same_job(job, event)
        else:
            lifetime = self.current.get(self.identity(event)) if "req_id" in event else None
            job = Job(kind, event["tier"], lifetime)
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

    def _same_job(self, job: Job, event: Event) -> None:
        """Check that every event of a job names the job's tier and kind.

        Where an event names the job's request and number of keys, they must match too.
        A line that names others would let a job pass as another's.
        """
        first = job.events[0] if job.events else None
        if event["tier"] != job.tier:
            self.violation("one-job", f"{job.kind} job {event['job_id']} of tier {job.tier} named with tier "
                           f"{event['tier']}", first, event)
        elif (first is not None and "req_id" in event and "req_id" in first
              and self.identity(event) != self.identity(first)):
            self.violation("one-job", f"{job.kind} job {event['job_id']} of request {first['req_id']}#"
                           f"{first['attempt']} named with request {event['req_id']}#{event['attempt']}",
                           first, event)
        elif first is not None and "keys" in event and "keys" in first and event["keys"] != first["keys"]:
            self.violation("one-job", f"{job.kind} job {event['job_id']} of {first['keys']} key(s) named with "
                           f"{event['keys']}", first, event)
        elif "promotion" in event and event["promotion"] != (job.kind == "promotion"):
            self.violation("one-job", f"{job.kind} job {event['job_id']} received as "
                           f"{'a promotion' if event['promotion'] else 'a cascade'}", first, event)

    def _end_job(self, job_id: int, job: Job) -> None:
        self.jobs.pop(job_id, None)
        if job.lifetime is not None:
            job.lifetime.jobs.pop(job_id, None)
            job.lifetime.ended_jobs.add(job_id)

    def _submit_at_primary(self, event: Event, what: str) -> Lifetime | None:
        req = self.current.get(self.identity(event))
        if req is None:
            self.violation("no-state-after-finalize", f"{what} for a request not live (never started, or "
                           "already finalized)", event)
        elif req.finished is not None:
            self.violation("no-submit-after-finish", f"{what} at the primary after request_finished",
                           req.finished, event)
        return req

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
        # What became ready cascades. A key written again that one of its writes failed does not,
        # whatever the call said. Logs without ``stored`` count every live key of a success.
        stored = event.get("stored")
        if stored is not None and (stored > event["live"] or (stored and not event["success"])):
            self.violation("failure-not-success", f"store_completed made {stored} block(s) ready of "
                           f"{event['live']} live write(s), success={event['success']}", event)
        if event["live"] and event["success"] and (stored is None or stored) and self.tiers:
            req = self.current.get(self.identity(event))
            if req is not None:  # each stored block cascades to every tier: one job per tier
                for tier in self.tiers:
                    req.cascades_owed[tier] = req.cascades_owed.get(tier, 0) + 1

    def on_cascade_skipped(self, event: Event) -> None:
        # Admission or back-pressure kept a completed store's blocks from a tier: no cascade is owed there.
        req = self.current.get(self.identity(event))
        if req is not None:
            req.cascades_owed[event["tier"]] = max(req.cascades_owed.get(event["tier"], 0) - 1, 0)

    def on_cascade_admitted(self, event: Event) -> None:
        # A cascade on behalf of a request that no store of its owes (min_seen, write_back): one job follows.
        req = self.current.get(self.identity(event))
        if req is not None:
            req.cascades_owed[event["tier"]] = req.cascades_owed.get(event["tier"], 0) + 1

    def on_request_param_ignored(self, event: Event) -> None:
        pass

    def on_cascades_dropped(self, event: Event) -> None:
        pass

    def on_cascades_resumed(self, event: Event) -> None:
        pass

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
        self._same_job(job, event)
        job.received = True
        job.events.append(event)
        req = job.lifetime
        if req is not None and tier in req.tier_received:
            self.violation("no-submit-after-finish", f"tier {tier} received a submit after on_request_finished",
                           req.tier_received[tier], event)

    def _reported(self, event: Event, kind: str) -> Job | None:
        job_id = event["job_id"]
        job = self.jobs.get(job_id)
        if job is None or job.state != "submitted" or not job.received or job.kind != kind:
            # Ended twice releases its rows twice; never submitted, it held rows no tier was writing.
            self.violation("pin-released-once", f"{kind} job {job_id} reported by its tier but not in flight there "
                           "(never submitted or received, or already ended)", *(job.events if job else ()), event)
            if job is not None:
                self._end_job(job_id, job)
            return None
        self._same_job(job, event)
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
        self._same_job(job, event)
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
        self._same_job(job, event)
        if not job.received:
            self.violation("one-job-end", f"late report of job {event['job_id']}, which its tier never received",
                           *job.events, event)
        self._end_job(event["job_id"], job)

    def on_job_report_unexpected(self, event: Event) -> None:
        pass  # a tier reported a job it was not given (the tier's bug); nothing of the contract changes

    def stop_jobs(self, stopped: Event) -> None:
        """Check at the stop that every job ended and every pin was released.

        A job that timed out may still be stuck at its tier.
        """
        for job_id, job in self.jobs.items():
            if job.state != "timed_out":  # one timed out may still be stuck at its tier: its report never came
                self.violation("pin-released-once", f"{job.kind} job {job_id} never ended "
                               "(its rows are never released)", *job.events, stopped)
        for identity, count in self.pins.items():
            self.violation("pin-released-once", f"{count} load pin(s) of {identity[0]}#{identity[1]} "
                           "never released", *self.pin_events.get(identity, [])[-6:], stopped)
