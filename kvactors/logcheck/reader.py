"""Reading an event log: one JSON object per line, streamed, never the whole file in memory.

A line that is not a JSON object with a string ``event`` is *unreadable*.
It is counted, and the check goes on.
A last line cut short without its newline is what a crash leaves.
It is counted apart (``truncated``), and does not by itself make the log inconclusive.
Input that is not a text log at all stops the read with :class:`LogReadError`, whose message is one line.
Such input is binary data, text that is not UTF-8, or a line longer than :data:`MAX_LINE_BYTES`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

from kvactors.logcheck.model import Event

#: The longest line accepted. An event is well under a kilobyte, and a handler's traceback a few.
MAX_LINE_BYTES = 1 << 20
_KEPT_ERRORS = 20


class LogReadError(Exception):
    """The input is not a JSON-lines event log. The message is one line."""


@dataclass
class ReadStats:
    lines: int = 0
    unreadable: int = 0  # not counting a truncated last line
    truncated: bool = False
    errors: list[str] = field(default_factory=list)  # the first few, one line each

    def bad_line(self, number: int, why: str) -> None:
        self.unreadable += 1
        if len(self.errors) < _KEPT_ERRORS:
            self.errors.append(f"line {number}: {why}")


def iter_events(stream: BinaryIO, stats: ReadStats, max_line: int = MAX_LINE_BYTES) -> Iterator[Event]:
    """Yield the events of ``stream`` in file order.

    What could not be read is counted in ``stats``.
    """
    loads = json.loads
    number = 0
    while True:
        raw = stream.readline(max_line + 1)
        if not raw:
            return
        number += 1
        stats.lines = number
        complete = raw.endswith(b"\n")
        if not complete and len(raw) > max_line:
            raise LogReadError(f"line {number} is longer than {max_line} bytes: not an event log")
        if b"\0" in raw:
            raise LogReadError(f"line {number} holds binary data (a NUL byte): not an event log")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise LogReadError(f"line {number} is not UTF-8 text ({exc.reason} at byte {exc.start}): "
                               "not an event log") from None
        if not text.strip():
            continue
        try:
            event = loads(text)
        except (ValueError, RecursionError) as exc:  # not JSON, a number too long, or nested too deep
            if not complete:  # readline stopped short of max_line without a newline: the end of the file
                stats.truncated = True  # the last line, cut short: what a crash leaves
                stats.errors.append(f"line {number}: truncated last line (not JSON: {exc})")
                return
            stats.bad_line(number, f"not JSON ({exc})")
            continue
        if type(event) is not dict or type(event.get("event")) is not str:
            stats.bad_line(number, "not an event object (a JSON object with a string 'event')")
            continue
        yield event
