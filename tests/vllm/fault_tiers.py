"""Secondary tiers that misbehave, for the fault suites (loaded by the spec's ``custom`` tier type)."""

from __future__ import annotations

import os
import threading

from kvactors import JobResult, LookupResult, SecondaryTier
from kvactors.tiers.memory import MemoryTier


class RaisingTier(SecondaryTier):
    """Every call raises."""

    def __init__(self, name: str = "raising") -> None:
        super().__init__(name=name)

    def lookup(self, keys, ctx):
        raise RuntimeError("planted: lookup raises")

    def submit_store(self, job):
        raise RuntimeError("planted: submit_store raises")

    def submit_load(self, job):
        raise RuntimeError("planted: submit_load raises")


class StallingTier(MemoryTier):
    """Stores like a MemoryTier; its lookups claim every key and its loads never report (the deadline fails them)."""

    def __init__(self, name: str = "stalling") -> None:
        super().__init__(name=name, capacity_blocks=64)
        self._stall = threading.Event()

    def lookup(self, keys, ctx):
        return [LookupResult.HIT for _ in keys]

    def submit_load(self, job):
        return None  # never reported: the transfer deadline fails the promotion

    def drain(self, timeout):
        return None

    def shutdown(self):
        self._stall.set()


class SwitchedStallTier(MemoryTier):
    """A MemoryTier that stalls while the file ``flag`` exists (the chaos run creates and removes it
    under traffic): its lookups then claim every key, and the loads it gets then never report (the
    transfer deadline fails them, whatever ``transfer_timeout_s`` is). One ``stat`` per call."""

    def __init__(self, flag: str, name: str = "switched", capacity_blocks: int = 64) -> None:
        super().__init__(name=name, capacity_blocks=capacity_blocks)
        self._flag = flag

    def stalled(self) -> bool:
        return os.path.exists(self._flag)

    def lookup(self, keys, ctx):
        if self.stalled():
            return [LookupResult.HIT for _ in keys]
        return super().lookup(keys, ctx)

    def submit_load(self, job):
        if self.stalled():
            return None  # never reported
        return super().submit_load(job)

    def drain(self, timeout):
        return None


class HangingLookupTier(MemoryTier):
    """Stores like a MemoryTier; its lookups hang until shutdown (a tier stuck inside a call, on its own
    thread: it does not declare them inline, as no tier whose calls can block may)."""

    inline_calls = frozenset()

    def __init__(self, name: str = "hanging") -> None:
        super().__init__(name=name, capacity_blocks=64)
        self._release = threading.Event()

    def lookup(self, keys, ctx):
        self._release.wait(30.0)
        return [LookupResult.MISS for _ in keys]

    def shutdown(self):
        self._release.set()


__all__ = ["HangingLookupTier", "JobResult", "RaisingTier", "StallingTier", "SwitchedStallTier"]
