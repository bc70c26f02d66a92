"""What a ``simulate`` run found (:class:`SimResult`).

What it is given is :mod:`~kvactors.commands.simulate.config`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from kvactors.commands.simulate.config import SimConfig
from kvactors.commands.simulate.run_metrics import CPU, CPU_IN_FLIGHT, Sample, percentile


@dataclass
class SimResult:
    config: SimConfig
    tiers: list[str]
    seconds: float
    counts: Counter[str]
    hits: Counter[str]
    finalize_ms: list[float]
    violations: int
    violation_notes: list[str]
    leaks: int
    leak_notes: list[str]
    stats: dict[str, int | float]
    promotions: dict[str, int]
    cascaded: dict[str, int]
    samples: list[Sample]
    errors: list[str]
    mismatch_notes: list[str]
    conversations: int
    interrupted: bool = False

    @property
    def requests(self) -> int:
        return self.counts["turns"]

    @property
    def mismatches(self) -> int:
        return self.counts["mismatches"]

    @property
    def hit_rate(self) -> float:
        looked = self.counts["keys_looked_up"]
        return sum(self.hits.values()) / looked if looked else 0.0

    def hit_rate_of(self, category: str) -> float:
        looked = self.counts["keys_looked_up"]
        return self.hits[category] / looked if looked else 0.0

    def gbps(self, what: str) -> float:
        return self.counts[f"bytes_{what}"] / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def ok(self) -> bool:
        return not (self.violations or self.mismatches or self.leaks or self.counts["frontend_errors"])

    def to_json(self) -> dict[str, Any]:
        c = self.counts
        return {
            "requests": c["turns"],
            "completed": c["completed"],
            "conversations": self.conversations,
            "attempts": c["attempts"],
            "preemptions": c["preemptions"],
            "aborts": c["aborts"],
            "seconds": round(self.seconds, 3),
            "interrupted": self.interrupted,
            "keys_looked_up": c["keys_looked_up"],
            "hit_rate": round(self.hit_rate, 4),
            "hit_rate_by_tier": {cat: round(self.hit_rate_of(cat), 4) for cat in self.hit_categories},
            "bytes_offloaded": c["bytes_offloaded"],
            "bytes_onboarded": c["bytes_onboarded"],
            "offload_gbps": round(self.gbps("offloaded"), 4),
            "onboard_gbps": round(self.gbps("onboarded"), 4),
            "finalize_p50_ms": round(percentile(self.finalize_ms, 50), 3),
            "finalize_p99_ms": round(percentile(self.finalize_ms, 99), 3),
            "promotions": dict(self.promotions),
            "cascaded": dict(self.cascaded),
            "load_races": c["load_races"],
            "pending_timeouts": c["pending_timeouts"],
            "transfer_errors": c["transfer_errors"],
            "frontend_errors": c["frontend_errors"],
            "violations": self.violations,
            "mismatches": self.mismatches,
            "leaks": self.leaks,
        }

    @property
    def hit_categories(self) -> list[str]:
        return [CPU, CPU_IN_FLIGHT, *self.tiers]
