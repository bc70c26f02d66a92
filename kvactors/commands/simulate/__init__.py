"""``kvactors simulate``: a threaded serving frontend on the real tiers.

``command`` (the command line), ``traffic`` (conversations as prefix-hash
chains, key-derived block bytes), ``runner`` (the frontend threads and the
end-of-run checks), ``instrument`` (a delegating tier wrapper that watches the
per-request hooks), ``run_metrics`` and ``report`` (the table and the plot).
"""
