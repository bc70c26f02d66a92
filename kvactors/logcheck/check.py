"""The checker: events of any number of managers in, a :class:`CheckResult` out.

:class:`LogChecker` routes each event to its manager's :class:`~kvactors.logcheck.replay.ManagerReplay`.
A manager is ``(pid, manager)``.
Several processes and managers may share a file, with their lines interleaved.
Within one file a manager's lines are in ``seq`` order, because the sink stamps ``seq`` and writes the line under
one lock.
They are numbered 0, 1, 2, ... with no gap, from ``manager_started`` to ``manager_stopped``.
The checker relies on that to stream.
It holds one replay per manager still running and frees it at ``manager_stopped``.

Each of these makes the verdict ``INCONCLUSIVE`` rather than ``OK``, and is listed in ``CheckResult.inconclusive``:

* No event at all, or none of any manager.
* A manager that never stopped. The obligations checked at the stop were not checked.
* A manager whose start is not in the log. It is not checked at all.
* A gap in a manager's ``seq``, which means events were lost.
* A ``seq`` going back, which means lines were duplicated or reordered. Those lines are not replayed.
* An unreadable line other than a truncated last one.
* An event name the schema does not know. A rule it feeds may be switched off.
* An event lacking a field its rule reads.

A violation found in what was read makes the verdict ``VIOLATION`` in any case.

Threading: none. One checker is used by one thread.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any, BinaryIO

from kvactors.log_schema import LIFECYCLE_EVENTS
from kvactors.logcheck.model import CheckResult, Event, Violation
from kvactors.logcheck.reader import LogReadError, ReadStats, iter_events
from kvactors.logcheck.replay import ManagerReplay

__all__ = ["LogChecker", "LogReadError", "check_events", "check_file", "check_stream"]

ManagerKey = tuple[Any, Any]


class _Manager:
    __slots__ = ("gaps", "malformed", "missing", "next_seq", "replay", "skipped", "stopped", "went_back")

    def __init__(self, replay: ManagerReplay) -> None:
        self.replay: ManagerReplay | None = replay
        self.next_seq = 0
        self.skipped = False  # its start is not in the log: not checked
        self.stopped = False
        self.gaps = self.missing = self.went_back = self.malformed = 0


class LogChecker:
    """Feed events (each manager's in ``seq`` order), then :meth:`result`."""

    def __init__(self, keep: int = 1000) -> None:
        self.keep = keep
        self.out = CheckResult()
        self.managers: dict[ManagerKey, _Manager] = {}
        self.foreign = 0  # events of no manager
        self.unkeyed = 0  # events whose pid or manager is neither an int nor a str (nor absent)
        self.malformed_examples: list[str] = []
        self._started = time.perf_counter()

    def _report(self, violation: Violation) -> None:
        self.out.violation_count += 1
        if len(self.out.violations) < self.keep:
            self.out.violations.append(violation)

    def feed(self, event: Event) -> None:
        out = self.out
        out.events += 1
        name = event.get("event")
        key = _manager_key(event)
        if key is None:
            self.unkeyed += 1
            return
        if key[1] is None:
            self.foreign += 1
            return
        manager = self.managers.get(key)
        seq = event.get("seq")
        if manager is None:
            manager = self.managers[key] = _Manager(ManagerReplay(self._report))
            if seq != 0 or name != "manager_started":
                manager.skipped = True
                manager.replay = None
        if name not in LIFECYCLE_EVENTS:
            out.unknown_events[str(name)] = out.unknown_events.get(str(name), 0) + 1
        replay = manager.replay
        if replay is None:
            if manager.stopped:
                self._report(Violation("one-lifecycle", "an event after manager_stopped", [event]))
            return
        if type(seq) is not int:
            self._malformed(manager, event, "no integer seq")
            return
        if seq != manager.next_seq:
            if seq < manager.next_seq:
                manager.went_back += 1
                return  # replayed out of order it would show violations the runtime did not commit
            manager.gaps += 1
            manager.missing += seq - manager.next_seq
        manager.next_seq = seq + 1
        handler = replay.handlers.get(name)  # type: ignore[arg-type]
        if handler is None:
            return
        try:
            handler(event)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            self._malformed(manager, event, f"{type(exc).__name__}: {exc}")
        if replay.stopped is not None:
            self._close(manager, key)
            manager.stopped = True

    def _malformed(self, manager: _Manager, event: Event, why: str) -> None:
        manager.malformed += 1
        if len(self.malformed_examples) < 5:
            self.malformed_examples.append(f"seq {event.get('seq')} {event.get('event')}: {why}")

    def _close(self, manager: _Manager, key: ManagerKey) -> None:
        assert manager.replay is not None
        self.out.requests += manager.replay.requests
        self.out.misuse += manager.replay.misuse
        self.out.inconclusive.extend(f"manager {key[1]} (pid {key[0]}): {note}" for note in manager.replay.notes)
        manager.replay = None  # every state of this manager is freed

    def result(self, stats: ReadStats | None = None) -> CheckResult:
        """The verdict over everything fed.

        What could not be proven is listed in ``inconclusive``.
        """
        out = self.out
        notes = out.inconclusive
        if stats is not None:
            out.unreadable = stats.unreadable
            out.errors = list(stats.errors)
            if stats.unreadable:
                notes.append(f"{stats.unreadable} unreadable line(s): the events they held were not checked")
        if not out.events:
            notes.append("no event in the log")
        elif not self.managers:
            notes.append(f"no event of any manager ({self.foreign} event(s) without a 'manager' field)")
        elif self.foreign:
            notes.append(f"{self.foreign} event(s) of no manager (no 'manager' field) were not checked")
        if self.unkeyed:
            notes.append(f"{self.unkeyed} event(s) whose 'pid' or 'manager' is not an int or a str were not checked")
        for (pid, number), manager in sorted(self.managers.items(), key=str):
            who = f"manager {number} (pid {pid})"
            if manager.skipped:
                notes.append(f"{who}: its start (seq 0, manager_started) is not in the log: not checked")
                continue
            if manager.replay is not None:
                cause = (" (it logged shutdown_timeout_zero: its vLLM engine ran with --shutdown-timeout 0, "
                         "whose stop does not wait for it)") if manager.replay.unwaited_stop else ""
                notes.append(f"{who} never stopped (no manager_stopped): what must hold at the stop (every "
                             f"finish, every pin and job released) was not checked{cause}")
                self._close(manager, (pid, number))
            if manager.missing:
                notes.append(f"{who}: {manager.missing} event(s) missing ({manager.gaps} gap(s) in seq)")
            if manager.went_back:
                notes.append(f"{who}: seq went back {manager.went_back} time(s) (lines duplicated or reordered); "
                             "those lines were not replayed")
            if manager.malformed:
                notes.append(f"{who}: {manager.malformed} event(s) lack a field their rule reads, e.g. "
                             f"{'; '.join(self.malformed_examples[:2])}")
        if out.unknown_events:
            names = ", ".join(f"{name} ({count})" for name, count in sorted(out.unknown_events.items()))
            notes.append(f"event name(s) not in kvactors.log_schema: {names}; a rule they feed may not have run")
        out.managers = len(self.managers)
        out.seconds = time.perf_counter() - self._started
        return out


def _manager_key(event: Event) -> ManagerKey | None:
    """``(pid, manager)`` of an event, or ``None`` if either is something a log never holds."""
    pid, manager = event.get("pid"), event.get("manager")
    if not (pid is None or type(pid) in (int, str)) or not (manager is None or type(manager) in (int, str)):
        return None
    return pid, manager


def check_events(events: Iterable[Event]) -> CheckResult:
    """Check parsed events in any order. Each manager's events are replayed sorted by ``seq``."""
    by_manager: dict[ManagerKey, list[Event]] = {}
    checker = LogChecker()
    for event in events:
        key = _manager_key(event)
        if key is None:
            checker.feed(event)  # counted, not checked
        else:
            by_manager.setdefault(key, []).append(event)
    for key in sorted(by_manager, key=str):
        for event in sorted(by_manager[key], key=lambda e: e.get("seq", -1) if type(e.get("seq")) is int else -1):
            checker.feed(event)
    return checker.result()


def check_stream(stream: BinaryIO) -> CheckResult:
    """Check a JSON-lines log as it is read, in memory bounded by the live requests.

    Raises :class:`LogReadError` if the input is not a log.
    """
    stats = ReadStats()
    checker = LogChecker()
    for event in iter_events(stream, stats):
        checker.feed(event)
    return checker.result(stats)


def check_file(path: str) -> CheckResult:
    """Check the log at ``path``.

    Raises ``OSError`` if it cannot be opened, and :class:`LogReadError` if it is not a log.
    """
    with open(path, "rb") as stream:
        return check_stream(stream)
