"""The engine of ``kvactors simulate``: a threaded serving frontend on the real tiers.

``workload`` (conversations as prefix-hash chains, key-derived block bytes),
``runner`` (the frontend threads and the end-of-run checks), ``instrument``
(a delegating tier wrapper that watches the per-request hooks), ``metrics``
and ``report`` (the table and the plot). The command line is
:mod:`kvactors.commands.simulate`.
"""
