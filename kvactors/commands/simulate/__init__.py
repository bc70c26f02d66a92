"""``kvactors simulate``: a threaded serving frontend on the real tiers.

* ``command`` is the command line.
* ``traffic`` holds conversations as prefix-hash chains, with key-derived block bytes.
* ``runner`` holds the frontend threads and the end-of-run checks.
* ``results`` holds the run's configuration and findings.
* ``instrument`` records each tier with the toolkit's transparent ``RecordedTier``, and checks the record.
* ``run_metrics`` and ``report`` make the table and the plot.
"""
