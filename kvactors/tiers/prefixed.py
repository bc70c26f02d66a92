"""``PrefixedTier``: one namespace of keys inside a tier that others share.

A tier that outlives its process or is shared (a disk root, a Redis namespace)
holds the blocks of whoever wrote there. When the runtime's keys do not say
which data they stand for (vLLM's block hashes do not include the model), two
writers of different data would read each other's blocks under the same key.
:class:`PrefixedTier` keeps each writer in its own part of the key space: every
key going into the inner tier (lookups, jobs, touches) gets ``prefix`` in
front, and every key coming out (a job's ``successful_keys``, events) has it
taken off again. Keys of the inner tier without this prefix (other writers'
blocks, seen when the tier evicts them or found at a restart) are never shown
to the runtime: to this tier they do not exist.

Why a prefix on the key and not a folder or namespace per writer: it works
the same for every tier, the custom ones too, with no change to any of them;
the writers still share one capacity bound and one LRU order (an operator's
``capacity_bytes`` stays the bound of the whole root, however many models
use it); and keys stay the tier's only notion of identity, so a block of
another writer can only be a miss. The key's end is unchanged (vLLM's keys
end with their 4-byte group index, which code reads as ``key[-4:]``).

Cost: one ``bytes`` concatenation per key going in, one ``startswith`` and slice
per key coming out in an event or a per-key report: small against a block's copy
and the actor messages of a job (figures: ``docs/performance.md``, "Model
isolation").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvactors.tiers.base import ReportFn, SecondaryTier
from kvactors.tiers.wrapper import DelegatingTier
from kvactors.types import JobResult, LookupResult, OffloadingEvent, OffloadKey, ReqContext, TransferJob


class PrefixedTier(DelegatingTier):
    """``inner`` with ``prefix`` in front of every key it sees.

    Transparent otherwise (a :class:`~kvactors.tiers.wrapper.DelegatingTier`):
    same name, job limit, inline calls and hooks as ``inner``. ``prefix`` must be
    non-empty ``bytes``; what it is made of is the caller's choice (a digest of
    what the blocks' bytes depend on: see
    :mod:`kvactors.integrations.vllm.identity`).

    Reports: a job's ``successful_keys`` come back without the prefix. A key
    in them without it, or not ``bytes`` (a tier reporting a key it was never
    given), fails the whole job, as any report that does not fit its job does
    (:func:`kvactors.core.outcomes.key_outcomes`): a tier that names keys it was
    not given cannot be trusted with the others it names either, and such a key
    is never taken for the success of a runtime key that happens to look the same.
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
        """``keys`` of this namespace, without the prefix; the others are left out."""
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
