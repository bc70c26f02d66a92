"""``kvactors check-log``'s engine: the lifecycle contract, verified from an event log alone.

* :mod:`~kvactors.logcheck.reader` streams the JSON lines.
* :mod:`~kvactors.logcheck.replay` holds the rules, over one manager's events, in a plain class.
  It is made of :mod:`~kvactors.logcheck.lifetimes` (a request's finishes),
  :mod:`~kvactors.logcheck.jobs` (stores, pins, jobs) and :mod:`~kvactors.logcheck.state` (what is live).
* :mod:`~kvactors.logcheck.check` handles managers, ``seq`` order and the verdict.
* :mod:`~kvactors.logcheck.model` defines violations, the verdict and the result.

The event names are :mod:`kvactors.log_schema`'s.
"""

from kvactors.logcheck.check import LogChecker, check_events, check_file, check_stream
from kvactors.logcheck.model import CheckResult, Event, Verdict, Violation, describe
from kvactors.logcheck.reader import MAX_LINE_BYTES, LogReadError
from kvactors.logcheck.replay import ManagerReplay

__all__ = ["MAX_LINE_BYTES", "CheckResult", "Event", "LogChecker", "LogReadError", "ManagerReplay", "Verdict",
           "Violation", "check_events", "check_file", "check_stream", "describe"]
