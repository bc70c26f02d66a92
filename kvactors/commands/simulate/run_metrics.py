"""Counters of a simulation run, and their samples over time."""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from kvactors.types import PRIMARY_TIER_NAME

CPU = PRIMARY_TIER_NAME
"""Hit category: the key was ready in the primary pool at the request's first lookup."""
CPU_IN_FLIGHT = "cpu (in flight)"
"""Hit category: the key was being stored in the pool by another request (or an
earlier attempt) at the first lookup, and became ready while this one waited."""


class Metrics:
    """Thread-safe counters, updated by the frontend threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.hits: Counter[str] = Counter()
        self.errors: list[str] = []
        self.mismatch_notes: list[str] = []
        self.frontend_done: dict[object, float] = {}  # ctx -> when the frontend was done with it

    def add(self, **deltas: int) -> None:
        with self._lock:
            self.counts.update(deltas)

    def add_hits(self, by_category: Counter[str]) -> None:
        with self._lock:
            self.hits.update(by_category)

    def error(self, note: str) -> None:
        with self._lock:
            self.counts["frontend_errors"] += 1
            if len(self.errors) < 10:
                self.errors.append(note)

    def mismatch(self, note: str) -> None:
        with self._lock:
            self.counts["mismatches"] += 1
            if len(self.mismatch_notes) < 10:
                self.mismatch_notes.append(note)

    def done(self, ctx: object, when: float) -> None:
        with self._lock:
            self.frontend_done[ctx] = when

    def snapshot(self) -> tuple[Counter[str], Counter[str]]:
        with self._lock:
            return Counter(self.counts), Counter(self.hits)


@dataclass
class Sample:
    t: float
    turns: int
    keys_looked_up: int
    keys_hit: int
    bytes_offloaded: int
    bytes_onboarded: int


@dataclass
class Sampler:
    """Samples the counters every ``interval_s`` on a thread of its own (for ``--plot``)."""

    metrics: Metrics
    interval_s: float = 0.5
    samples: list[Sample] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="kvactors-simulate-sampler", daemon=True)

    def start(self) -> None:
        self._t0 = time.monotonic()
        self.take()
        self._thread.start()

    def take(self) -> None:
        counts, hits = self.metrics.snapshot()
        self.samples.append(Sample(time.monotonic() - self._t0, counts["turns"], counts["keys_looked_up"],
                                   sum(hits.values()), counts["bytes_offloaded"], counts["bytes_onboarded"]))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.take()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.take()


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100), by the nearest-rank method.

    It is 0.0 for no values.
    """
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q / 100 * len(ordered))))
    return ordered[rank - 1]
