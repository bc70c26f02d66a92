"""``DelegatingTier``: the base of tier wrappers (fault injection, recording).

A wrapper must be *transparent*: the runtime chooses its paths from what a
tier's class overrides (an ``on_new_request`` hook makes the primary announce
every request start and gates the tier's lookup lane on it; a ``touch`` hook
makes the supervisor send recency hints; a hook left to the base class counts
as inline), so a wrapper that defined every hook would move a wrapped
``DiskTier`` off the lazy path a bare one takes. A :class:`DelegatingTier`
therefore takes the shape of its inner tier: its instance's class is a
subclass of the wrapper's own, built once per (wrapper class, inner shape),
in which each hook of :data:`SENT_IF_OVERRIDDEN` the inner tier leaves to the
base class is left to the base class too; its ``inline_calls`` and
``max_inflight_jobs`` are the inner tier's.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import ClassVar

import torch

from kvactors.tiers.base import ReportFn, SecondaryTier, inline_calls_of, overrides
from kvactors.types import LookupResult, OffloadingEvent, OffloadKey, ReqContext, TransferJob

SENT_IF_OVERRIDDEN = ("on_new_request", "touch")
"""The hooks the runtime sends only to a tier whose class overrides them.
(``on_request_finished`` is always sent; whether it may run inline, which a
base-class hook may, is carried by ``inline_calls``.)"""

_shapes: dict[tuple[type, frozenset[str]], type] = {}
_shapes_lock = threading.Lock()


def _shaped(cls: type[DelegatingTier], missing: frozenset[str]) -> type[DelegatingTier]:
    """``cls`` without its own versions of the hooks in ``missing`` (cached)."""
    base = cls.__dict__.get("_unshaped", cls)
    if not missing:
        return base
    with _shapes_lock:
        shaped = _shapes.get((base, missing))
        if shaped is None:
            body: dict[str, object] = {hook: getattr(SecondaryTier, hook) for hook in missing}
            body.update(_unshaped=base, __module__=base.__module__, __qualname__=base.__qualname__,
                        __doc__=base.__doc__)
            shaped = _shapes[(base, missing)] = type(base.__name__, (base,), body)
        return shaped


class DelegatingTier(SecondaryTier):
    """Forwards every call to ``inner``, under ``inner``'s name, job limit and shape.

    Subclasses override the calls they watch or change and call ``super()`` to
    pass them on; a hook of :data:`SENT_IF_OVERRIDDEN` that ``inner`` does not
    override is removed from the instance's class (see the module docstring), so
    the runtime takes the same paths with the wrapper as without it.
    ``max_inflight_jobs`` overrides ``inner``'s job limit when given.
    Threading is ``inner``'s: the wrapper adds none.
    """

    _unshaped: ClassVar[type]

    def __init__(self, inner: SecondaryTier, *, max_inflight_jobs: int | None = None) -> None:
        if not isinstance(inner, SecondaryTier):
            raise TypeError(f"a wrapper wraps a SecondaryTier, got {type(inner).__name__}")
        super().__init__(name=inner.name)
        self.inner = inner
        self.max_inflight_jobs = max_inflight_jobs or inner.max_inflight_jobs  # type: ignore[misc]
        self.inline_calls = inline_calls_of(inner)  # type: ignore[misc]
        self.medium = inner.medium  # type: ignore[misc]
        self.locality = inner.locality  # type: ignore[misc]
        missing = frozenset(hook for hook in SENT_IF_OVERRIDDEN if not overrides(inner, hook))
        self.__class__ = _shaped(type(self), missing)

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
