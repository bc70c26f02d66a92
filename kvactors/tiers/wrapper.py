"""``DelegatingTier``: the base of tier wrappers (fault injection, recording).

A wrapper must be *transparent*.
The runtime must take the same paths with it as with the tier under it.
The runtime chooses its paths from what a tier declares in
:attr:`~kvactors.tiers.base.SecondaryTier.hooks`,
:attr:`~kvactors.tiers.base.SecondaryTier.inline_calls` and
:attr:`~kvactors.tiers.base.SecondaryTier.max_inflight_jobs`.
Of the hooks, ``on_new_request`` makes the primary announce every request start,
and gates the tier's lookup lane on it.
A ``touch`` hook makes the supervisor send recency hints.
A hook not declared counts as inline.
A :class:`DelegatingTier` declares what its inner tier declares.
So a wrapped ``DiskTier`` keeps the lazy path a bare one takes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvactors.tiers.base import ReportFn, SecondaryTier, hooks_of, inline_calls_of
from kvactors.types import LookupResult, OffloadingEvent, OffloadKey, ReqContext, TransferJob


class DelegatingTier(SecondaryTier):
    """Forwards every call to ``inner``, under ``inner``'s name, job limit and shape.

    Subclasses override the calls they watch or change and call ``super()`` to pass them on.
    Its ``hooks`` and ``inline_calls`` are ``inner``'s (see the module docstring).
    ``max_inflight_jobs`` overrides ``inner``'s job limit when given.
    Threading is ``inner``'s, as the wrapper adds none.
    """

    def __init__(self, inner: SecondaryTier, *, max_inflight_jobs: int | None = None) -> None:
        if not isinstance(inner, SecondaryTier):
            raise TypeError(f"a wrapper wraps a SecondaryTier, got {type(inner).__name__}")
        super().__init__(name=inner.name)
        self.inner = inner
        self.max_inflight_jobs = max_inflight_jobs or inner.max_inflight_jobs  # type: ignore[misc]
        self.inline_calls = inline_calls_of(inner)  # type: ignore[misc]
        self.hooks = hooks_of(inner)  # type: ignore[misc]
        self.medium = inner.medium  # type: ignore[misc]
        self.locality = inner.locality  # type: ignore[misc]

    def attach(self, pool: torch.Tensor, report: ReportFn) -> None:
        super().attach(pool, report)
        self.inner.attach(pool, report)

    def lookup(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[LookupResult]:
        return self.inner.lookup(keys, ctx)

    def submit_store(self, job: TransferJob) -> None:
        self.inner.submit_store(job)

    def submit_load(self, job: TransferJob) -> None:
        self.inner.submit_load(job)

    def on_new_request(self, ctx: ReqContext) -> None:
        self.inner.on_new_request(ctx)

    def on_request_finished(self, ctx: ReqContext) -> None:
        self.inner.on_request_finished(ctx)

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        self.inner.touch(keys, ctx)

    def take_events(self) -> list[OffloadingEvent]:
        return self.inner.take_events()

    def drain(self, timeout: float | None) -> None:
        self.inner.drain(timeout)

    def shutdown(self) -> None:
        self.inner.shutdown()

    def layers(self) -> list[SecondaryTier]:
        """This wrapper and every tier under it, outermost first."""
        out: list[SecondaryTier] = [self]
        tier: SecondaryTier = self.inner
        while True:
            out.append(tier)
            if not isinstance(tier, DelegatingTier):
                return out
            tier = tier.inner

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"
