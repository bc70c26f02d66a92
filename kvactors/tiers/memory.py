"""``MemoryTier``: an in-process secondary tier, bounded, LRU."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch

from kvactors.tiers.base import SecondaryTier
from kvactors.types import JobResult, LookupResult, OffloadingEvent, OffloadKey, ReqContext, TransferJob


class MemoryTier(SecondaryTier):
    """Blocks copied into private tensors, at most ``capacity_blocks`` of them.

    Copies run synchronously on the tier's actor thread (a memory copy is
    fast, and it keeps this tier free of threads), so each job is reported
    before ``submit_*`` returns. The least recently stored, loaded, looked-up
    or touched block is evicted first. The tier's own memory is ordinary RAM,
    so it holds no checksums: nothing between the copy in and the copy out can
    corrupt it that would not corrupt the pool as well.

    Threading: every method runs on the tier's actor; ``take_events`` and
    ``stats`` may also be called from other threads (a lock guards the state).
    """

    # Dict work under a lock. Not the submits: a copy of large blocks takes a while.
    inline_calls = frozenset(("lookup", "touch"))

    def __init__(self, *, name: str = "memory", capacity_blocks: int) -> None:
        super().__init__(name=name)
        if not isinstance(capacity_blocks, int) or capacity_blocks <= 0:
            raise ValueError(f"capacity_blocks must be an int > 0, got {capacity_blocks!r}")
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[OffloadKey, torch.Tensor] = OrderedDict()
        self._events: list[OffloadingEvent] = []
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: object) -> bool:
        return key in self._blocks

    def lookup(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[LookupResult]:
        with self._lock:
            results = []
            for key in keys:
                if key in self._blocks:
                    self._blocks.move_to_end(key)
                    results.append(LookupResult.HIT)
                else:
                    results.append(LookupResult.MISS)
            return results

    def submit_store(self, job: TransferJob) -> None:
        assert self.pool is not None
        stored, evicted = [], []
        with self._lock:
            for key, row in zip(job.keys, job.block_ids, strict=True):
                if key in self._blocks:
                    self._blocks.move_to_end(key)
                    continue
                self._blocks[key] = self.pool[row].clone()
                stored.append(key)
            while len(self._blocks) > self.capacity_blocks:
                key, _ = self._blocks.popitem(last=False)
                evicted.append(key)
            if stored:
                self._events.append(OffloadingEvent(tuple(stored), self.name, False))
            if evicted:
                self._events.append(OffloadingEvent(tuple(evicted), self.name, True))
        # A block stored and evicted by the same job (capacity below the job's
        # size) is not in the tier: the store of that key did not succeed.
        lost = set(evicted) & set(job.keys)
        error = f"{len(lost)} blocks evicted by their own job (capacity {self.capacity_blocks})" if lost else None
        self.report(JobResult(job.job_id, not lost, error))

    def submit_load(self, job: TransferJob) -> None:
        assert self.pool is not None
        with self._lock:
            missing = [key for key in job.keys if key not in self._blocks]
            if not missing:
                for key, row in zip(job.keys, job.block_ids, strict=True):
                    self._blocks.move_to_end(key)
                    self.pool[row].copy_(self._blocks[key])
        if missing:
            self.report(JobResult(job.job_id, False, f"{len(missing)} blocks no longer in tier {self.name!r}"))
        else:
            self.report(JobResult(job.job_id, True))

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        with self._lock:
            for key in keys:
                if key in self._blocks:
                    self._blocks.move_to_end(key)

    def take_events(self) -> list[OffloadingEvent]:
        with self._lock:
            events, self._events = self._events, []
            return events
