"""``kvactors check-log FILE``: verify the lifecycle contract from a JSON-lines event log alone.

The runtime writes one JSON object per lifecycle event (``TieringManager.start(
event_log=...)`` or ``KVACTORS_EVENT_LOG``). Events of one manager are ordered by
``seq`` (stamped under the sink's lock); several managers may share a file
(``manager`` tells them apart). This replays each manager's events in ``seq``
order and checks:

* **one finish**: per request attempt, one ``request_finished`` at the primary,
  and per secondary tier at most one ``tier_finalized`` and one
  ``tier_finish_received``; once the manager stopped, exactly one per tier for
  every request finalized;
* **no submit after finish**: no ``store_prepared``/``load_prepared`` after the
  request's ``request_finished``; no ``tier_submit_received`` at a tier after
  that tier's ``tier_finish_received``; no job submitted to a tier after its
  ``tier_finalized``;
* **finalize only when nothing can submit**: at ``tier_finalized`` the request is
  finished, has no primary store pending (prepared and neither completed nor
  timed out since the last ``cache_reset``), and no promotion or cascade of it to
  that tier is allocated or queued but not yet submitted or dropped;
* **every pin released once**: load pins (``load_prepared``/``load_completed``)
  never released more than taken, none left when the manager stopped; every job
  (each pins rows) ends once (completed, timed out or dropped), a late report
  only after a timeout, every submitted job ended by the stop;
* **no state after finalize**: nothing that creates request state (stores,
  loads, jobs, promotions) after ``request_finalized``, and no store completion
  that was still counted as pending;
* the runtime's own alarms: ``invariant_broken``, ``actor_handler_failed``, and
  a ``contract_violation`` raised by the supervisor's guard.

Each violation is printed with the events involved; the exit status is 1 if
there is any (2 if the file cannot be read).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, TextIO

HELP = "Verify the lifecycle contract from a JSON-lines event log."

Event = dict[str, Any]

_SHOWN = ("req_id", "attempt", "tier", "job_id", "kind", "keys", "live", "stale", "success", "reason", "call")


def describe(event: Event) -> str:
    fields = " ".join(f"{name}={event[name]}" for name in _SHOWN if name in event)
    return f"[manager {event.get('manager', '?')} seq {event.get('seq', '?')}] {event.get('event')} {fields}"


@dataclass
class Violation:
    rule: str
    message: str
    events: list[Event]

    def format(self) -> str:
        return "\n".join([f"VIOLATION {self.rule}: {self.message}", *(f"    {describe(e)}" for e in self.events)])


@dataclass
class _Request:
    """One incarnation of a request attempt, from ``request_started`` to ``request_finalized``."""

    started: Event
    finished: Event | None = None
    finalized: Event | None = None
    pending_stores: int = 0
    store_events: list[Event] = field(default_factory=list)
    tier_finalized: dict[str, Event] = field(default_factory=dict)
    tier_finish: dict[str, list[Event]] = field(default_factory=lambda: defaultdict(list))
    jobs: dict[int, _Job] = field(default_factory=dict)  # not yet submitted or ended


@dataclass
class _Job:
    kind: str
    tier: str
    request: _Request | None
    events: list[Event]
    state: str = "allocated"  # allocated | stale | queued | submitted | ended
    ends: int = 0
    timed_out: bool = False
    late: int = 0


class _ManagerReplay:
    """The checks for one manager's events, in ``seq`` order."""

    def __init__(self, out: list[Violation]) -> None:
        self.out = out
        self.tiers: list[str] = []
        self.current: dict[tuple[str, int], _Request] = {}
        self.jobs: dict[int, _Job] = {}
        self.pins: dict[tuple[str, int], int] = defaultdict(int)
        self.pin_events: dict[tuple[str, int], list[Event]] = defaultdict(list)
        self.finalized: list[_Request] = []
        self.stopped: Event | None = None
        self.misuse = 0
        self.resets = 0

    def violation(self, rule: str, message: str, *events: Event) -> None:
        self.out.append(Violation(rule, message, list(events)))

    @staticmethod
    def identity(event: Event) -> tuple[str, int]:
        return (str(event.get("req_id")), int(event.get("attempt", 0)))

    def request(self, event: Event) -> _Request | None:
        return self.current.get(self.identity(event))

    def job(self, event: Event, kind: str | None = None) -> _Job:
        job_id = int(event["job_id"])
        job = self.jobs.get(job_id)
        if job is None:
            job = _Job(kind or str(event.get("kind", "?")), str(event.get("tier")),
                       self.request(event) if "req_id" in event else None, [])
            self.jobs[job_id] = job
            if job.request is not None:
                job.request.jobs[job_id] = job
        job.events.append(event)
        return job

    # ------------------------------------------------------------ the replay

    def feed(self, event: Event) -> None:
        handler = getattr(self, "on_" + str(event.get("event")), None)
        if handler is not None:
            handler(event)

    def on_manager_started(self, event: Event) -> None:
        self.tiers = [t for t in str(event.get("tiers", "")).split(",") if t][1:]

    def on_request_started(self, event: Event) -> None:
        old = self.request(event)
        if old is not None and old.finalized is None:
            self.violation("one-lifecycle", "request started again before it was finalized", old.started, event)
        self.current[self.identity(event)] = _Request(event)

    def on_request_finished(self, event: Event) -> None:
        req = self.request(event)
        if req is None:
            self.violation("one-finish", "request_finished for a request never started", event)
        elif req.finished is not None:
            self.violation("one-finish", "request finished twice at the primary", req.finished, event)
        else:
            req.finished = event

    def _submit_at_primary(self, event: Event, what: str) -> _Request | None:
        req = self.request(event)
        if req is None:
            self.violation("no-state-after-finalize", f"{what} for a request never started", event)
        elif req.finalized is not None:
            self.violation("no-state-after-finalize", f"{what} after the request was finalized",
                           req.finalized, event)
        elif req.finished is not None:
            self.violation("no-submit-after-finish", f"{what} at the primary after request_finished",
                           req.finished, event)
        return req

    def on_store_prepared(self, event: Event) -> None:
        req = self._submit_at_primary(event, "store_prepared")
        if req is not None and int(event.get("keys", 0)):
            req.pending_stores += int(event["keys"])
            req.store_events.append(event)

    def _stores_done(self, event: Event, count: int) -> None:
        req = self.request(event)
        if req is None or count <= 0:
            return
        if req.finalized is not None:
            self.violation("finalize-after-stores", f"{count} store(s) still pending when the request was "
                           "finalized (their completion arrived after)", req.finalized, event)
            return
        req.pending_stores -= count
        req.store_events.append(event)
        if req.pending_stores < 0:
            self.violation("finalize-after-stores", "more stores completed than prepared", *req.store_events[-6:])
            req.pending_stores = 0

    def on_store_completed(self, event: Event) -> None:
        self._stores_done(event, int(event.get("live", 0)))

    def on_cache_reset(self, event: Event) -> None:
        # Promotions the primary allocated before this reset reach the supervisor before it: not stale.
        # Those it allocates after it for a decision taken before it are (see on_promotion_allocated).
        self.resets += 1
        for req in self.current.values():
            if req.finalized is None:
                req.pending_stores = 0
                req.store_events.append(event)

    def on_load_prepared(self, event: Event) -> None:
        self._submit_at_primary(event, "load_prepared")
        identity = self.identity(event)
        self.pins[identity] += int(event.get("keys", 0))
        self.pin_events[identity].append(event)

    def on_load_completed(self, event: Event) -> None:
        identity = self.identity(event)
        self.pins[identity] -= int(event.get("keys", 0))
        self.pin_events[identity].append(event)
        if self.pins[identity] < 0:
            self.violation("pin-released-once", "more load pins released than taken", *self.pin_events[identity][-6:])
            self.pins[identity] = 0

    def on_promotion_allocated(self, event: Event) -> None:
        job = self.job(event, "promotion")
        if int(event.get("epoch", self.resets)) < self.resets:
            job.state = "stale"  # decided before a reset the primary already did: it will be dropped
            return
        req = self.request(event)
        if req is None or req.finalized is not None:
            self.violation("no-state-after-finalize", "promotion allocated for a request not live",
                           *([req.finalized] if req and req.finalized else []), event)

    def on_job_queued(self, event: Event) -> None:
        job = self.job(event)
        if job.state != "allocated":
            self.violation("one-job-end", f"job queued in state {job.state}", *job.events)
        job.state = "queued"

    def _submitted(self, event: Event, kind: str) -> None:
        job = self.job(event, kind)
        if job.state not in ("allocated", "queued"):
            self.violation("one-job-end", f"{kind} submitted in state {job.state}", *job.events)
        job.state = "submitted"
        req = job.request
        tier = str(event.get("tier"))
        if req is not None and tier in req.tier_finalized:
            self.violation("no-submit-after-finish", f"{kind} submitted to tier {tier} after its tier_finalized",
                           req.tier_finalized[tier], event)
        elif req is not None and req.finalized is not None:
            self.violation("no-state-after-finalize", f"{kind} submitted after the request was finalized",
                           req.finalized, event)

    def on_cascade_submitted(self, event: Event) -> None:
        self._submitted(event, "cascade")

    def on_promotion_submitted(self, event: Event) -> None:
        self._submitted(event, "promotion")

    def _ended(self, event: Event) -> _Job:
        job = self.job(event)
        job.ends += 1
        if job.ends > 1:
            self.violation("pin-released-once", f"job {event['job_id']} ended {job.ends} times "
                           "(its rows released more than once)", *job.events)
        job.state = "ended"
        return job

    def _reported(self, event: Event) -> _Job:
        job = self.jobs.get(int(event["job_id"]))
        if job is None or job.state != "submitted":
            self.violation("one-job-end", f"job {event['job_id']} ended by its tier but never submitted",
                           *(job.events if job else []), event)
        return self._ended(event)

    def on_cascade_completed(self, event: Event) -> None:
        self._reported(event)

    def on_promotion_completed(self, event: Event) -> None:
        self._reported(event)

    def on_job_dropped(self, event: Event) -> None:
        self._ended(event)

    def on_job_timed_out(self, event: Event) -> None:
        if event.get("kind") == "store":
            self._stores_done(event, int(event.get("keys", 0)))
            return
        self._reported(event).timed_out = True

    def on_late_report_ignored(self, event: Event) -> None:
        job = self.job(event)
        job.late += 1
        if not job.timed_out or job.late > 1:
            self.violation("pin-released-once", "late report (hold released) without a timeout, or twice",
                           *job.events)

    def on_tier_finalized(self, event: Event) -> None:
        req = self.request(event)
        tier = str(event.get("tier"))
        if req is None:
            self.violation("one-finish", "tier_finalized for a request never started", event)
            return
        if req.finished is None:
            self.violation("finalize-after-finish", "finalized before the request finished", req.started, event)
        if tier in req.tier_finalized:
            self.violation("one-finish", f"tier {tier} finalized twice", req.tier_finalized[tier], event)
            return
        req.tier_finalized[tier] = event
        if req.pending_stores > 0:
            self.violation("finalize-after-stores", f"tier {tier} told finished with {req.pending_stores} primary "
                           "store(s) still pending", *req.store_events[-6:], event)
        for job_id, job in list(req.jobs.items()):
            if job.state not in ("allocated", "queued"):
                del req.jobs[job_id]  # submitted, dropped or stale: it cannot hold the finalize any more
            elif job.tier == tier:
                self.violation("finalize-after-stores", f"tier {tier} told finished while {job.kind} job {job_id} "
                               f"is {job.state}, not submitted", *job.events, event)

    def on_request_finalized(self, event: Event) -> None:
        req = self.request(event)
        if req is None:
            self.violation("one-finish", "request_finalized for a request never started", event)
            return
        if req.finalized is not None:
            self.violation("one-finish", "request finalized twice", req.finalized, event)
            return
        req.finalized = event
        missing = [t for t in self.tiers if t not in req.tier_finalized]
        if missing:
            self.violation("one-finish", f"request finalized without telling tier(s) {missing}", req.started, event)
        self.finalized.append(req)

    def on_tier_submit_received(self, event: Event) -> None:
        req = self.request(event)
        tier = str(event.get("tier"))
        if req is not None and req.tier_finish[tier]:
            self.violation("no-submit-after-finish", f"tier {tier} received a submit after on_request_finished",
                           req.tier_finish[tier][0], event)

    def on_tier_finish_received(self, event: Event) -> None:
        req = self.request(event)
        tier = str(event.get("tier"))
        if req is None:
            self.violation("one-finish", "a tier was told finished for a request never started", event)
            return
        req.tier_finish[tier].append(event)
        if len(req.tier_finish[tier]) > 1:
            self.violation("one-finish", f"tier {tier} received on_request_finished "
                           f"{len(req.tier_finish[tier])} times", *req.tier_finish[tier])

    def on_contract_violation(self, event: Event) -> None:
        if event.get("reason") == "submit_after_finalize":
            self.violation("runtime-guard", "the supervisor's guard refused a submit after finalize", event)
        else:
            self.misuse += 1  # a caller's misuse, rejected and counted: the contract held

    def on_invariant_broken(self, event: Event) -> None:
        self.violation("runtime-error", "a lifecycle counter went below zero", event)

    def on_actor_handler_failed(self, event: Event) -> None:
        self.violation("runtime-error", "an actor's handler raised", event)

    def on_manager_stopped(self, event: Event) -> None:
        self.stopped = event

    # ------------------------------------------------------------ at the end

    def finish(self) -> None:
        if self.stopped is None:
            return  # a log of a manager still running (or killed): no completeness checks
        for req in self.finalized:
            for tier in self.tiers:
                if len(req.tier_finish[tier]) != 1:
                    self.violation("one-finish", f"tier {tier} received on_request_finished "
                                   f"{len(req.tier_finish[tier])} times, not once", req.finalized or req.started,
                                   *req.tier_finish[tier], self.stopped)
        for req in self.current.values():
            if req.tier_finalized and req.finalized is None:
                self.violation("one-finish", "tiers finalized but the request never was",
                               *req.tier_finalized.values(), self.stopped)
        for job_id, job in self.jobs.items():
            if job.state != "ended":
                self.violation("pin-released-once", f"{job.kind} job {job_id} never ended "
                               "(its rows are never released)", *job.events, self.stopped)
        for identity, count in self.pins.items():
            if count > 0:
                self.violation("pin-released-once", f"{count} load pin(s) of {identity[0]}#{identity[1]} "
                               "never released", *self.pin_events[identity][-6:], self.stopped)


@dataclass
class CheckResult:
    events: int
    managers: int
    requests: int
    misuse: int
    violations: list[Violation]
    errors: list[str]


def check_events(events: list[Event]) -> CheckResult:
    """Check parsed events (any order; each manager's are replayed by ``seq``)."""
    by_manager: dict[Any, list[Event]] = defaultdict(list)
    for event in events:
        by_manager[(event.get("pid"), event.get("manager"))].append(event)  # several processes may share a file
    violations: list[Violation] = []
    requests = misuse = 0
    for manager in sorted(by_manager, key=str):
        replay = _ManagerReplay(violations)
        for event in sorted(by_manager[manager], key=lambda e: e.get("seq", -1)):
            replay.feed(event)
            if event.get("event") == "request_started":
                requests += 1
        replay.finish()
        misuse += replay.misuse
    return CheckResult(len(events), len(by_manager), requests, misuse, violations, [])


def read_events(stream: TextIO) -> tuple[list[Event], list[str]]:
    events, errors = [], []
    for number, line in enumerate(stream, 1):
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError as exc:
            errors.append(f"line {number}: not JSON ({exc})")
            continue
        if not isinstance(event, dict) or "event" not in event:
            errors.append(f"line {number}: not an event object")
            continue
        events.append(event)
    return events, errors


def check_file(path: str) -> CheckResult:
    with open(path, encoding="utf-8") as stream:
        events, errors = read_events(stream)
    result = check_events(events)
    result.errors = errors
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="a JSON-lines event log ('-' for stdin)")
    parser.add_argument("--max", type=int, default=50, help="print at most this many violations (default 50)")
    parser.add_argument("--json", action="store_true", help="end with a JSON summary line")


def run(args: argparse.Namespace) -> int:
    try:
        if args.file == "-":
            events, errors = read_events(sys.stdin)
            result = check_events(events)
            result.errors = errors
        else:
            result = check_file(args.file)
    except OSError as exc:
        print(f"check-log: cannot read {args.file}: {exc}", file=sys.stderr)
        return 2
    for error in result.errors:
        print(f"check-log: {error}", file=sys.stderr)
    for violation in result.violations[: args.max]:
        print(violation.format())
    if len(result.violations) > args.max:
        print(f"... and {len(result.violations) - args.max} more")
    verdict = "OK" if not result.violations else f"{len(result.violations)} VIOLATION(S)"
    print(f"{verdict}: {result.events} events, {result.managers} manager(s), {result.requests} request attempts, "
          f"{result.misuse} caller misuse(s) rejected, {len(result.errors)} unreadable line(s)")
    if args.json:
        print(json.dumps({"events": result.events, "managers": result.managers, "requests": result.requests,
                          "violations": len(result.violations), "misuse": result.misuse,
                          "unreadable": len(result.errors)}))
    return 1 if result.violations else 0
