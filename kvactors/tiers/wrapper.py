"""``DelegatingTier``: the base of tier wrappers (fault injection, observation)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvactors.tiers.base import ReportFn, SecondaryTier, inline_calls_of
from kvactors.types import LookupResult, OffloadingEvent, OffloadKey, ReqContext, TransferJob


class DelegatingTier(SecondaryTier):
    """Forwards every call to ``inner``, under ``inner``'s name and job limit.

    Subclasses override the calls they watch or change and call ``super()`` to
    pass them on. Threading is ``inner``'s: the wrapper adds none.
    """

    def __init__(self, inner: SecondaryTier, *, max_inflight_jobs: int | None = None) -> None:
        super().__init__(name=inner.name)
        self.inner = inner
        self.max_inflight_jobs = max_inflight_jobs or inner.max_inflight_jobs  # type: ignore[misc]
        self.inline_calls = inline_calls_of(inner)  # type: ignore[misc]

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

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"
