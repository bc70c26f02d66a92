"""``kvactors check-log FILE``: verify the lifecycle contract from a JSON-lines event log alone.

The rules are :mod:`kvactors.logcheck.replay`'s, and the verdict is :mod:`kvactors.logcheck.check`'s.
This module is the command line.
It also keeps the names older callers import from here:
``check_events``, ``check_file``, ``read_events``, ``Event``, ``Violation``, ``describe``.

Exit status:

* 0 for ``OK``.
* 1 for ``VIOLATION``.
* 3 for ``INCONCLUSIVE``.
  Nothing is broken in what was read, but the log does not prove the contract.
  The log may be empty, name no manager, hold a manager that never stopped, or have events lost or unknown.
* 2 if the file cannot be read or is not an event log, or for a bad option.
  A bad option prints one line, ``kvactors check-log: error: ...``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import NoReturn, TextIO

from kvactors.commands.options import TERMINATION
from kvactors.logcheck import (
    CheckResult,
    Event,
    LogReadError,
    Verdict,
    Violation,
    check_events,
    check_file,
    check_stream,
    describe,
)

__all__ = ["HELP", "CheckResult", "Event", "Verdict", "Violation", "add_arguments", "check_events", "check_file",
           "describe", "read_events", "run"]

HELP = "Verify the lifecycle contract from a JSON-lines event log (exit 0 OK, 1 violation, 3 inconclusive)."
PROG = "kvactors check-log"


def read_events(stream: TextIO) -> tuple[list[Event], list[str]]:
    """Parse a whole text stream into events and one message per unreadable line (kept for older callers)."""
    events, errors = [], []
    for number, line in enumerate(stream, 1):
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except ValueError as exc:
            errors.append(f"line {number}: not JSON ({exc})")
            continue
        if not isinstance(event, dict) or not isinstance(event.get("event"), str):
            errors.append(f"line {number}: not an event object")
            continue
        events.append(event)
    return events, errors


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value


def _one_line_errors(parser: argparse.ArgumentParser) -> None:
    """A bad option is one line on stderr and exit status 2, without the usage block."""

    def error(message: str) -> NoReturn:
        parser.exit(2, f"{PROG}: error: {message}\n")

    parser.error = error  # type: ignore[method-assign]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _one_line_errors(parser)
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    parser.add_argument("file", help="a JSON-lines event log ('-' for stdin)")
    parser.add_argument("--max", type=_non_negative, default=50, metavar="N",
                        help="print at most N violations")
    parser.add_argument("--json", action="store_true",
                        help="print only a JSON summary on stdout (the violations go to stderr)")


def _error(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    try:
        result = check_stream(sys.stdin.buffer) if args.file == "-" else check_file(args.file)
    except IsADirectoryError:
        return _error(f"{args.file} is a directory, not an event log")
    except OSError as exc:
        return _error(f"cannot read {args.file}: {exc.strerror or exc}")
    except LogReadError as exc:
        return _error(f"{args.file}: {exc}")
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return TERMINATION.status()
    report = sys.stderr if args.json else sys.stdout
    for error in result.errors:
        print(f"{PROG}: {error}", file=sys.stderr)
    for violation in result.violations[: args.max]:
        print(violation.format(), file=report)
    count = max(result.violation_count, len(result.violations))
    if count > args.max:
        print(f"... and {count - args.max} more", file=report)
    verdict = result.verdict
    for reason in result.inconclusive:
        print(f"not proven: {reason}", file=report)
    head = {Verdict.OK: "OK", Verdict.VIOLATION: f"{count} VIOLATION(S)", Verdict.INCONCLUSIVE: "INCONCLUSIVE"}
    rate = f", {result.events / result.seconds:,.0f} events/s" if result.seconds else ""
    print(f"{head[verdict]}: {result.events} events, {result.managers} manager(s), {result.requests} request "
          f"attempts, {result.misuse} caller misuse(s) rejected, {result.unreadable} unreadable line(s){rate}",
          file=report)
    if args.json:
        print(json.dumps(result.summary()))
    return verdict.exit_status
