"""The subcommands of the ``kvactors`` command line, one module each.

Each module defines ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args) -> int`` (the exit status). :mod:`kvactors.commands.options` holds
the option types and checks they share.
"""
