"""``kvactors simulate``: a threaded serving frontend on the real tiers.

``command`` (the command line), ``traffic`` (conversations as prefix-hash
chains, key-derived block bytes), ``runner`` (the frontend threads and the
end-of-run checks), ``results`` (the run's configuration and findings),
``instrument`` (each tier recorded by the toolkit's transparent
``RecordedTier``, and the checks on the record), ``run_metrics`` and
``report`` (the table and the plot).
"""
