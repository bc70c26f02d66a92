"""Systematic single mutations of a good log, and the share the checker catches.

Every *contract event* of every manager gets four mutations in turn, not a sample.

* **delete** removes it.
* **duplicate** puts a copy right after it.
* **move earlier** puts it just before the previous event of the same request or job.
* **move later** puts it just after the next one.

Events of no request (``manager_started``, ``cache_reset``, ...) move past their neighbour.
``seq`` is renumbered after each mutation, so the checker cannot tell a mutated log by its numbering alone.
Without renumbering, every mutation is caught by the ``seq`` check.
That figure is reported apart.
A mutation is caught when the verdict is not ``OK``.
Most are ``VIOLATION``.
Deleting ``manager_stopped`` is ``INCONCLUSIVE``, because the stop is not proven.

Some mutations cannot be caught, because the mutated log is one the runtime could have written.
:data:`UNCATCHABLE` names each class, with the reason.
They are left out of the score, and counted.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvactors.logcheck.check import check_events
from kvactors.logcheck.model import Event, Verdict
from kvactors.types import PRIMARY_TIER_NAME

#: Events a rule reads. The others record a caller's misuse or a tier's failure, or are notes.
CONTRACT_EVENTS = frozenset({
    "manager_started", "manager_stopped", "request_started", "request_finished", "request_finish_seen",
    "store_prepared", "store_rejected", "store_completed", "load_prepared", "load_completed", "promotion_allocated",
    "job_queued", "cascade_submitted", "promotion_submitted", "tier_submit_received", "cascade_completed",
    "promotion_completed", "job_dropped", "job_timed_out", "late_report_ignored", "tier_finalized",
    "tier_finish_received", "request_finalized", "request_active_at_stop", "cache_reset",
})

_NO_STATE = "changes no state the log records (a store of no key, one that found no room, a completion of " \
            "writes already detached by a timeout or reset)"

#: (mutation, event, neighbour or "") -> why no checker can catch it. "*" matches any neighbour.
UNCATCHABLE: dict[tuple[str, str, str], str] = {
    **{(kind, name, "" if kind != "move" else "*"): _NO_STATE
       for kind in ("delete", "duplicate", "move")
       for name in ("store_rejected", "store_prepared(keys=0)", "store_completed(live=0)")},
    ("delete", "job_queued", ""): "a job may go to its tier at once or wait in its queue: the tier's slot limit "
                                  "is not in the log",
    ("delete", "late_report_ignored", ""): "a timed-out job's late report may never come (a tier stuck or lost "
                                           "it); the runtime names no held job at the stop",
    ("duplicate", "cache_reset", ""): "a second reset with nothing stored since changes no state",
    ("delete", "cache_reset", ""): "a reset when no request had a store pending changes no state the log records",
}

_PRIMARY = {"request_started", "request_finished", "finish_ignored", "call_rejected", "store_prepared",
            "store_rejected", "store_completed", "load_prepared", "load_completed", "promotion_allocated",
            "cache_reset", "request_active_at_stop"}
_TIER = {"tier_finish_received", "tier_submit_received"}

#: (earlier, later) pairs. When both concern one job (or one request at one tier), the runtime logs them in
#: this order, on two threads, with a message from one to the other between them.
CAUSAL = {
    *((f"{kind}_submitted", "tier_submit_received") for kind in ("cascade", "promotion")),
    *(("tier_submit_received", f"{kind}_completed") for kind in ("cascade", "promotion")),
    ("tier_submit_received", "late_report_ignored"), ("tier_finalized", "tier_finish_received"),
    ("request_finished", "request_finish_seen"), ("store_completed", "job_queued"),
    ("store_completed", "cascade_submitted"), ("store_completed", "job_dropped"),
    ("promotion_allocated", "promotion_submitted"), ("promotion_allocated", "job_queued"),
    ("promotion_allocated", "job_dropped"), ("store_completed", "tier_finalized"),
    ("store_completed", "request_finalized"), ("store_prepared", "tier_finalized"),
    ("request_started", "request_finish_seen"), ("request_started", "job_queued"),
    ("request_started", "cascade_submitted"), ("request_started", "promotion_submitted"),
    ("request_started", "tier_finalized"), ("request_finish_seen", "tier_finalized"),
    ("request_finished", "tier_finalized"), ("job_timed_out", "tier_finalized"),
}
_JOBS = {"job_queued", "cascade_submitted", "promotion_submitted", "cascade_completed", "promotion_completed",
         "job_dropped", "job_timed_out", "late_report_ignored", "tier_submit_received"}
#: Unordered pairs of events of one request whose two orders are both runs the runtime may produce.
COMMUTE = {
    **{frozenset((a, b)): "pins and stores are independent: either order is legal"
       for a in ("load_prepared", "load_completed") for b in ("store_prepared", "store_completed")},
    frozenset(("store_prepared",)): "keys are logged as counts, not names: two stores of one request commute",
    frozenset(("store_prepared", "store_completed")): "keys are logged as counts, not names: a completion "
                                                      "cannot be matched to its own prepare",
    frozenset(("load_completed", "request_finished")): "complete_load may come before or after the finish",
    **{frozenset(("request_finalized", end)): "a job submitted before the finalize may end before or after it"
       for end in ("cascade_completed", "promotion_completed", "job_timed_out", "late_report_ignored")},
    **{frozenset(("job_timed_out", other)): "a store's timeout is a count of keys, like its prepare and completion"
       for other in ("store_prepared", "store_completed", "load_completed")},
    frozenset(("store_completed",)): "keys are logged as counts, not names: two completions commute",
    **{frozenset(("request_finish_seen", job)): "the supervisor sees the finish between two steps of a job "
                                                "already created: either order is legal"
       for job in _JOBS},
}
_INDEPENDENT = "concern two jobs (or two tiers): the contract orders neither against the other"
_CONCURRENT = ("logged by two actors with no message between them: the runtime may log them in either order")


def emitter(event: Event) -> str:
    """The actor that logs ``event``. A tier's events are logged by that tier's actor."""
    name = event["event"]
    if name in _TIER:
        return f"tier:{event.get('tier')}"
    if name in _PRIMARY or (name == "job_timed_out" and event.get("kind") == "store"):
        return "primary"
    if name.startswith("manager_"):
        return "manager"
    return "supervisor"


@dataclass
class Mutation:
    kind: str  # delete | duplicate | earlier | later
    index: int  # in the manager's events
    event: str
    neighbour: str = ""

    def label(self) -> str:
        verb = {"earlier": "move before", "later": "move after"}.get(self.kind, self.kind)
        return f"{verb} {self.event}" + (f" / {self.neighbour}" if self.neighbour else "")

    def klass(self) -> tuple[str, str, str]:
        return ("move" if self.kind in ("earlier", "later") else self.kind, self.event, self.neighbour)


@dataclass
class Score:
    tried: int = 0
    caught: int = 0  # the verdict is not OK
    as_violation: int = 0  # of those, VIOLATION (the others INCONCLUSIVE)
    excluded: Counter[str] = field(default_factory=Counter)
    uncaught: Counter[str] = field(default_factory=Counter)
    by_kind: Counter[str] = field(default_factory=Counter)  # tried, per mutation kind
    caught_by_kind: Counter[str] = field(default_factory=Counter)
    raw_tried: int = 0
    raw_caught: int = 0  # without renumbering seq: caught as not OK

    @property
    def share(self) -> float:
        return self.caught / self.tried if self.tried else 1.0

    def to_json(self) -> dict[str, object]:
        return {"tried": self.tried, "caught": self.caught, "score": round(self.share, 5),
                "caught_as_violation": self.as_violation,
                "by_kind": {k: [self.caught_by_kind[k], n] for k, n in sorted(self.by_kind.items())},
                "uncaught": dict(self.uncaught.most_common()), "excluded": dict(self.excluded.most_common()),
                "excluded_reasons": {" ".join(filter(None, k)): why for k, why in UNCATCHABLE.items()},
                "raw_seq": {"tried": self.raw_tried, "caught": self.raw_caught}}


def _key(event: Event) -> tuple[object, object] | None:
    return (event["req_id"], event.get("attempt")) if "req_id" in event else None


def _related(a: Event, b: Event) -> bool:
    if "job_id" in a and a.get("job_id") == b.get("job_id"):
        return True
    key = _key(a)
    return key is not None and key == _key(b)


def label(event: Event) -> str:
    """The event's name, qualified where the event changes no state (a store of no key, a completion of
    writes already detached)."""
    name: str = event["event"]
    if name == "store_prepared" and not event.get("keys"):
        return "store_prepared(keys=0)"
    if name == "store_completed" and not event.get("live"):
        return "store_completed(live=0)"
    return name


def mutations(events: list[Event]) -> Iterator[Mutation]:
    """Every single mutation of one manager's events (``seq`` order) on its contract events."""
    for i, event in enumerate(events):
        name = label(event)
        if event["event"] not in CONTRACT_EVENTS:
            continue
        yield Mutation("delete", i, name)
        yield Mutation("duplicate", i, name)
        unrelated = _key(event) is None and "job_id" not in event
        before = next((j for j in range(i - 1, -1, -1) if unrelated or _related(event, events[j])), None)
        after = next((j for j in range(i + 1, len(events)) if unrelated or _related(event, events[j])), None)
        if before is not None:
            yield Mutation("earlier", i, name, label(events[before]))
        if after is not None:
            yield Mutation("later", i, name, label(events[after]))


def apply(events: list[Event], mutation: Mutation, *, renumber: bool = True) -> list[Event]:
    i = mutation.index
    event = events[i]
    if mutation.kind == "delete":
        out = events[:i] + events[i + 1:]
    elif mutation.kind == "duplicate":
        out = [*events[:i + 1], dict(event), *events[i + 1:]]
    else:
        rest = events[:i] + events[i + 1:]
        unrelated = _key(event) is None and "job_id" not in event
        if mutation.kind == "earlier":
            j = next(j for j in range(i - 1, -1, -1) if unrelated or _related(event, events[j]))
            out = [*rest[:j], event, *rest[j:]]
        else:
            j = next(j for j in range(i + 1, len(events)) if unrelated or _related(event, events[j]))
            out = [*rest[:j], event, *rest[j:]]  # rest[j - 1] is events[j]: the event lands right after it
    if renumber:
        out = [{**e, "seq": n} for n, e in enumerate(out)]
    return out


def _excluded(events: list[Event], mutation: Mutation) -> str | None:
    kind, name, neighbour = mutation.klass()
    listed = UNCATCHABLE.get((kind, name, neighbour)) or UNCATCHABLE.get((kind, name, "*"))
    if listed is None and kind == "move":
        if neighbour in UNCATCHABLE.get(("move", neighbour, "*"), "") or neighbour.endswith(")"):
            return _NO_STATE
        event = events[mutation.index]
        other = _neighbour(events, mutation)
        if other["event"] not in CONTRACT_EVENTS:
            return "the neighbour is a note no rule reads (a caller's misuse, a tier's failure)"
        first, second = (other, event) if mutation.kind == "earlier" else (event, other)
        if "job_id" in event and "job_id" in other and event["job_id"] != other["job_id"]:
            return _INDEPENDENT
        tiers = {e.get("tier") for e in (event, other)} - {None, PRIMARY_TIER_NAME}
        if len(tiers) == 2:
            return _INDEPENDENT
        same_job = "job_id" in event and event.get("job_id") == other.get("job_id")
        causal = (first["event"], second["event"]) in CAUSAL and (same_job or not ("job_id" in event
                                                                                and "job_id" in other))
        if emitter(event) != emitter(other) and not causal:
            return _CONCURRENT
        commute = COMMUTE.get(frozenset((event["event"], other["event"])))
        if commute is not None:
            return commute
    return listed


def _neighbour(events: list[Event], mutation: Mutation) -> Event:
    i = mutation.index
    event = events[i]
    unrelated = _key(event) is None and "job_id" not in event
    steps = range(i - 1, -1, -1) if mutation.kind == "earlier" else range(i + 1, len(events))
    return events[next(j for j in steps if unrelated or _related(event, events[j]))]


def score(managers: list[list[Event]], *, raw_every: int = 0) -> Score:
    """Try every mutation of every manager's events.

    With ``raw_every``, also try every N-th mutation without renumbering.
    """
    out = Score()
    for events in managers:
        base = check_events(events)
        if base.verdict is not Verdict.OK:
            raise ValueError(f"the log to mutate is not OK: {base.inconclusive[:2]} "
                             f"{[v.format() for v in base.violations[:2]]}")
        for n, mutation in enumerate(mutations(events)):
            if _excluded(events, mutation) is not None:
                out.excluded[mutation.label()] += 1
                continue
            out.tried += 1
            out.by_kind[mutation.kind] += 1
            verdict = check_events(apply(events, mutation)).verdict
            if verdict is not Verdict.OK:
                out.caught += 1
                out.as_violation += verdict is Verdict.VIOLATION
                out.caught_by_kind[mutation.kind] += 1
            else:
                out.uncaught[mutation.label()] += 1
            if raw_every and n % raw_every == 0:
                out.raw_tried += 1
                out.raw_caught += check_events(apply(events, mutation, renumber=False)).verdict is not Verdict.OK
    return out
