"""``MemoryTier``: an in-process secondary tier, bounded, LRU."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch

from kvactors.core.arguments import check_int
from kvactors.core.events import EventBuffer, warn_on_overflow
from kvactors.logs import component_logger
from kvactors.tiers.base import SecondaryTier
from kvactors.types import JobResult, LookupResult, OffloadingEvent, OffloadKey, ReqContext, TransferJob


class MemoryTier(SecondaryTier):
    """Blocks copied into private tensors, at most ``capacity_blocks`` of them.

    Copies run synchronously on the tier's actor thread.
    A memory copy is fast, and this keeps the tier free of threads.
    So each job is reported before ``submit_*`` returns.
    The least recently stored, loaded, looked-up or touched block is evicted first.
    The tier's own memory is ordinary RAM, so it holds no checksums.
    Nothing between the copy in and the copy out could corrupt it without corrupting the pool as well.

    Threading: every method runs on the tier's actor.
    ``take_events`` and ``stats`` may also be called from other threads, as a lock guards the state.
    """

    # Dict work under a lock. Not the submits: a copy of large blocks takes a while.
    inline_calls = frozenset(("lookup", "touch"))
    hooks = frozenset(("touch",))  # on_new_request and on_request_finished are no-ops here
    medium = "CPU"
    locality = "LOCAL"

    def __init__(self, *, name: str = "memory", capacity_blocks: int) -> None:
        super().__init__(name=name)
        self.capacity_blocks = check_int(capacity_blocks, "capacity_blocks")
        self._blocks: OrderedDict[OffloadKey, torch.Tensor] = OrderedDict()
        self._events = EventBuffer(name, on_overflow=warn_on_overflow(component_logger("tiers.memory", tier=name)))
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
        """Copy the rows in, key by key.

        A key that cannot be copied fails alone, and is not in the tier.
        So does a key that its own job evicts, when the capacity is below the job's size.
        """
        assert self.pool is not None
        stored, evicted = [], []
        failed: dict[OffloadKey, str] = {}
        with self._lock:
            for key, row in zip(job.keys, job.block_ids, strict=True):
                if key in self._blocks:
                    self._blocks.move_to_end(key)
                    continue
                try:
                    self._blocks[key] = self.pool[row].clone()
                except Exception as exc:  # out of memory: this key is not stored
                    failed.setdefault(key, f"{type(exc).__name__}: {exc}")
                    continue
                stored.append(key)
            while len(self._blocks) > self.capacity_blocks:
                key, _ = self._blocks.popitem(last=False)
                evicted.append(key)
            self._events.add(stored, removed=False)
            self._events.add(evicted, removed=True)
        lost = set(evicted) & set(job.keys)
        for key in lost:
            failed.setdefault(key, f"evicted by its own job (capacity {self.capacity_blocks})")
        self.report(_result(job, failed))

    def submit_load(self, job: TransferJob) -> None:
        """Copy the blocks present into their rows. A key no longer here fails alone."""
        assert self.pool is not None
        failed: dict[OffloadKey, str] = {}
        with self._lock:
            for key, row in zip(job.keys, job.block_ids, strict=True):
                block = self._blocks.get(key)
                if block is None:
                    failed[key] = f"no longer in tier {self.name!r}"
                    continue
                self._blocks.move_to_end(key)
                self.pool[row].copy_(block)
        self.report(_result(job, failed))

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        with self._lock:
            for key in keys:
                if key in self._blocks:
                    self._blocks.move_to_end(key)

    def take_events(self) -> list[OffloadingEvent]:
        with self._lock:
            return self._events.take()


def _result(job: TransferJob, failed: dict[OffloadKey, str]) -> JobResult:
    """A success, or the keys that succeeded (``successful_keys``) and the first failure."""
    if not failed:
        return JobResult(job.job_id, True)
    ok = tuple(key for key in dict.fromkeys(job.keys) if key not in failed)
    error = f"{len(failed)} of {len(set(job.keys))} blocks failed: {next(iter(failed.values()))}"
    return JobResult(job.job_id, False, error, successful_keys=ok)
