#!/usr/bin/env python
"""Stress the runtime on real threads: ``python scripts/stress.py --threads 4 --requests 200`` (see --help)."""

import sys

from kvactors.cli import main

if __name__ == "__main__":
    sys.exit(main(["stress", *sys.argv[1:]]))
