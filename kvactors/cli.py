"""The ``kvactors`` command: ``simulate``, ``stress``, ``check-log``."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

COMMANDS = {
    "simulate": "kvactors.commands.simulate",
    "stress": "kvactors.commands.stress",
    "check-log": "kvactors.commands.check_log",
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvactors", description="Tiered KV-cache offloading runtime.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    modules = {}
    for name, module_name in COMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        modules[name] = module
        command_parser = subparsers.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(command_parser)
    args = parser.parse_args(argv)
    return int(modules[args.command].run(args))


if __name__ == "__main__":
    sys.exit(main())
