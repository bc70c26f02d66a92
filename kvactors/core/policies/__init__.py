"""Eviction policies for the primary pool and the tiers."""

from __future__ import annotations

from kvactors.core.policies.arc import ARCPolicy
from kvactors.core.policies.base import EvictionPolicy, RowPolicy
from kvactors.core.policies.keyed import KeyedRowPolicy
from kvactors.core.policies.lru import LRUPolicy
from kvactors.core.policies.row_lru import RowLRUPolicy

POLICIES = ("lru", "arc")


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """The policy called ``name`` (``"lru"`` or ``"arc"``) for ``capacity`` blocks."""
    if name == "lru":
        return LRUPolicy()
    if name == "arc":
        return ARCPolicy(capacity)
    raise ValueError(f"unknown eviction policy {name!r}; choose one of {POLICIES}")


__all__ = ["POLICIES", "ARCPolicy", "EvictionPolicy", "KeyedRowPolicy", "LRUPolicy", "RowLRUPolicy", "RowPolicy",
           "make_policy"]
