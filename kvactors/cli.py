"""The ``kvactors`` command: ``simulate``, ``stress``, ``check-log``.

A bad option is one line on stderr, ``kvactors <command>: error: ...``, and exit status 2
(:class:`kvactors.commands.options.Parser`).
Ctrl-C ends a run with exit status 130, once the command has stopped what it started.
SIGTERM ends it the same way, with 143.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

from kvactors.commands.options import TERMINATION, Parser

COMMANDS = {
    "simulate": "kvactors.commands.simulate.command",
    "stress": "kvactors.commands.stress",
    "check-log": "kvactors.commands.check_log",
}


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, Any]]:
    """The ``kvactors`` parser, with one subparser per command module found. Returns it and the modules by name.

    :func:`subparsers` finds the commands' parsers in it.
    """
    parser = Parser(prog="kvactors", description="Tiered KV-cache offloading runtime.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    modules: dict[str, Any] = {}
    for name, module_name in COMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        modules[name] = module
        command_parser = subparsers.add_parser(name, help=module.HELP, description=module.HELP,
                                               formatter_class=argparse.RawDescriptionHelpFormatter,
                                               epilog=getattr(module, "EPILOG", None))
        module.add_arguments(command_parser)
    return parser, modules


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The commands' parsers of a parser made by :func:`build_parser`, by name."""
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def main(argv: Sequence[str] | None = None) -> int:
    restore: list[tuple[int, Any]] = []
    TERMINATION.seen = False  # this command's own signals only
    if threading.current_thread() is threading.main_thread():
        # A shell starts background jobs with SIGINT ignored, and Python then keeps it ignored:
        # Ctrl-C (or kill -INT) must still stop a run, so the commands get their KeyboardInterrupt.
        restore.append((signal.SIGINT, signal.signal(signal.SIGINT, signal.default_int_handler)))
        if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:  # else the embedding program decides
            restore.append((signal.SIGTERM, signal.signal(signal.SIGTERM, TERMINATION)))
    try:
        parser, modules = build_parser()
        args, extra = parser.parse_known_args(argv)
        if extra:  # reported by the command's parser, so that the line names the command
            subparsers(parser)[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
        status = int(modules[args.command].run(args))
        return TERMINATION.status() if status == 130 else status  # a command that says 130 for any interrupt
    except KeyboardInterrupt:  # before the command started (nothing to stop), or once it returned
        print("kvactors: interrupted", file=sys.stderr)
        return TERMINATION.status()
    finally:
        for signum, handler in reversed(restore):
            signal.signal(signum, handler)


if __name__ == "__main__":
    sys.exit(main())
