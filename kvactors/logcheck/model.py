"""What the checker reports: violations and the verdict."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

Event = dict[str, Any]

_SHOWN = ("req_id", "attempt", "tier", "job_id", "kind", "keys", "live", "stale", "success", "stored", "reason", "call",
          "finished", "pending_stores")


def describe(event: Event) -> str:
    """One event on one line: its manager, seq, name and the fields that identify it."""
    fields = " ".join(f"{name}={event[name]}" for name in _SHOWN if name in event)
    return f"[manager {event.get('manager', '?')} seq {event.get('seq', '?')}] {event.get('event')} {fields}"


@dataclass
class Violation:
    """A rule of the contract the log shows broken, with the events that show it."""

    rule: str
    message: str
    events: list[Event]

    def format(self) -> str:
        return "\n".join([f"VIOLATION {self.rule}: {self.message}", *(f"    {describe(e)}" for e in self.events)])


class Verdict(enum.Enum):
    """The checker's verdict.

    ``OK`` (exit 0): every rule held over a log that covers each manager from start to stop.
    ``VIOLATION`` (exit 1): some rule is broken.
    ``INCONCLUSIVE`` (exit 3): no rule is broken in what could be read, but the log does not prove
    that the contract held (see ``CheckResult.inconclusive``).
    """

    OK = 0
    VIOLATION = 1
    INCONCLUSIVE = 3

    @property
    def exit_status(self) -> int:
        return int(self.value)


@dataclass
class CheckResult:
    """The outcome of one check.

    ``violations`` keeps the first ``keep`` violations found, and ``violation_count`` counts all.
    ``errors`` keeps the first unreadable lines' messages, and ``unreadable`` counts all.
    ``inconclusive`` says, one line each, what the log could not prove.
    """

    events: int = 0
    managers: int = 0
    requests: int = 0
    misuse: int = 0
    violations: list[Violation] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    inconclusive: list[str] = field(default_factory=list)
    violation_count: int = 0
    unreadable: int = 0
    unknown_events: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def verdict(self) -> Verdict:
        if self.violation_count or self.violations:
            return Verdict.VIOLATION
        if self.inconclusive:
            return Verdict.INCONCLUSIVE
        return Verdict.OK

    def summary(self) -> dict[str, Any]:
        """The figures as JSON-ready values."""
        return {"verdict": self.verdict.name, "events": self.events, "managers": self.managers,
                "requests": self.requests, "violations": max(self.violation_count, len(self.violations)),
                "misuse": self.misuse, "unreadable": self.unreadable, "unknown_events": dict(self.unknown_events),
                "inconclusive": list(self.inconclusive), "seconds": round(self.seconds, 3),
                "events_per_second": round(self.events / self.seconds) if self.seconds else None}
