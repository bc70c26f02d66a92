"""``PrefixedTier``: one namespace of keys inside a tier that others share.

A tier that outlives its process or is shared (a disk root, a Redis namespace)
holds the blocks of whoever wrote there.
The runtime's keys may not say which data they stand for.
vLLM's block hashes, for one, do not include the model.
Two writers of different data would then read each other's blocks under the same key.
:class:`PrefixedTier` keeps each writer in its own part of the key space.
Every key going into the inner tier (lookups, jobs, touches) gets ``prefix`` in front.
Every key coming out (a job's ``successful_keys``, events) has it taken off again.
Keys of the inner tier without this prefix are never shown to the runtime.
Those are other writers' blocks, seen when the tier evicts them or found at a restart.
To this tier they do not exist.

Why a prefix on the key and not a folder or namespace per writer?

* It works the same for every tier, the custom ones too, with no change to any of them.
* The writers still share one capacity bound and one LRU order.
  An operator's ``capacity_bytes`` stays the bound of the whole root, however many models use it.
* Keys stay the tier's only notion of identity, so a block of another writer can only be a miss.

The key's end is unchanged.
vLLM's keys end with their 4-byte group index, which code reads as ``key[-4:]``.

The cost is one ``bytes`` concatenation per key going in.
Each key coming out in an event or a per-key report costs one ``startswith`` and slice.
That is small against a block's copy and the actor messages of a job.
The figures are in ``docs/performance.md``, "Model isolation".
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvactors.tiers.base import ReportFn, SecondaryTier
from kvactors.tiers.wrapper import DelegatingTier
from kvactors.types import JobResult, LookupResult, OffloadingEvent, OffloadKey, ReqContext, TransferJob


class PrefixedTier(DelegatingTier):
    """``inner`` with ``prefix`` in front of every key it sees.

    Otherwise it is transparent, as a :class:`~kvactors.tiers.wrapper.DelegatingTier`.
    It has the same name, job limit, inline calls and hooks as ``inner``.
    ``prefix`` must be non-empty ``bytes``.
    What it is made of is the caller's choice.
    A digest of what the blocks' bytes depend on fits (see :mod:`kvactors.integrations.vllm.identity`).

    Reports: a job's ``successful_keys`` come back without the prefix.
    A key in them without the prefix, or not ``bytes``, fails the whole job.
    Such a key means the tier reported a key it was never given.
    Any report that does not fit its job fails it the same way (:func:`kvactors.core.outcomes.key_outcomes`).
    A tier that names keys it was not given cannot be trusted with the others it names either.
    And such a key is never taken for the success of a runtime key that happens to look the same.
    """

    def __init__(self, inner: SecondaryTier, prefix: bytes, *, max_inflight_jobs: int | None = None) -> None:
        if type(prefix) is not bytes or not prefix:
            raise ValueError(f"a key prefix must be non-empty bytes, got {prefix!r}")
        super().__init__(inner, max_inflight_jobs=max_inflight_jobs)
        self.prefix = prefix

    # -------------------------------------------------------------- keys in

    def _keys(self, keys: Sequence[OffloadKey]) -> list[OffloadKey]:
        prefix = self.prefix
        return [prefix + key for key in keys]

    def _job(self, job: TransferJob) -> TransferJob:
        # The runtime knows the job by job_id; the copy differs in its keys only.
        return TransferJob(job.job_id, tuple(self._keys(job.keys)), job.block_ids, job.req_context,
                           job.is_promotion)

    def lookup(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[LookupResult]:
        return self.inner.lookup(self._keys(keys), ctx)

    def submit_store(self, job: TransferJob) -> None:
        self.inner.submit_store(self._job(job))

    def submit_load(self, job: TransferJob) -> None:
        self.inner.submit_load(self._job(job))

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        self.inner.touch(self._keys(keys), ctx)

    # ------------------------------------------------------------- keys out

    def _strip(self, keys: Sequence[object]) -> tuple[OffloadKey, ...]:
        """``keys`` of this namespace, without the prefix. The others are left out."""
        prefix, n = self.prefix, len(self.prefix)
        return tuple([key[n:] for key in keys if type(key) is bytes and key.startswith(prefix)])

    def attach(self, pool: torch.Tensor, report: ReportFn) -> None:
        def unprefixed(result: JobResult) -> None:
            named = result.successful_keys
            # Anything but a tuple goes on as it is: the runtime reads a malformed report
            # as every key failed (kvactors.core.outcomes), which is safe as it stands.
            if type(named) is tuple:
                prefix, n = self.prefix, len(self.prefix)
                if all(type(key) is bytes and key.startswith(prefix) for key in named):
                    result = JobResult(result.job_id, result.success, result.error,
                                       tuple([key[n:] for key in named]))
                else:  # a report that does not fit its job fails the whole job (key_outcomes)
                    result = JobResult(result.job_id, False,
                                       "successful_keys names a key outside this tier's prefix", None)
            report(result)

        super().attach(pool, unprefixed)

    def take_events(self) -> list[OffloadingEvent]:
        out = []
        for event in self.inner.take_events():
            keys = self._strip(event.keys)
            if keys:  # an event about other writers' blocks only is not this tier's
                out.append(OffloadingEvent(keys, event.tier, event.removed))
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r}, prefix={self.prefix.hex()})"
