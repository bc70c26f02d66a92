"""Observing wrappers are transparent: the runtime takes the same paths with them as without.

For each wrapper (the bare ``DelegatingTier``, the fault layer, the recorder,
the recorder over the fault layer) over each built-in tier (``DiskTier``,
``MemoryTier``, ``RedisTier`` where a ``redis-server`` is installed), a tier
without any optional hook and one with every hook: the runtime's choices (does
the primary announce starts, which hooks the supervisor sends, which calls run
inline, the job limit) are the same, and one fixed workload makes the same
calls reach the inner tier, as for the bare tier.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvactors import LookupResult, ReqContext, TieringManager
from kvactors.testing.faults import Faults, FaultTier
from kvactors.testing.recorder import RecordedTier, TierRecord
from kvactors.testing.tiers import ThreadDeferrer
from kvactors.tiers.base import HOOKS, SecondaryTier, hooks_of
from kvactors.tiers.disk import DiskTier
from kvactors.tiers.memory import MemoryTier
from kvactors.tiers.prefixed import PrefixedTier
from kvactors.tiers.wrapper import DelegatingTier
from kvactors.types import JobResult, OffloadKey, TransferJob
from tests.support import wait_for

CALLS = ("lookup", "submit_store", "submit_load", "on_new_request", "on_request_finished", "touch",
         "take_events", "drain", "shutdown")


class PlainTier(SecondaryTier):
    """Declares no optional hook: every job reported at once, every key it stored a hit."""

    def __init__(self) -> None:
        super().__init__(name="plain")
        self.keys: set[OffloadKey] = set()

    def lookup(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[LookupResult]:
        return [LookupResult.HIT if key in self.keys else LookupResult.MISS for key in keys]

    def submit_store(self, job: TransferJob) -> None:
        self.keys.update(job.keys)
        self.report(JobResult(job.job_id, True))

    def submit_load(self, job: TransferJob) -> None:
        self.report(JobResult(job.job_id, all(key in self.keys for key in job.keys)))


class HookedTier(MemoryTier):
    """A ``MemoryTier`` with every optional hook of its own."""

    def on_new_request(self, ctx: ReqContext) -> None:
        pass

    def on_request_finished(self, ctx: ReqContext) -> None:
        pass


def _inner(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> SecondaryTier:
    if kind == "disk":
        return DiskTier(tmp_path / f"disk-{uuid.uuid4().hex[:6]}", capacity_bytes=1 << 20)
    if kind == "memory":
        return MemoryTier(capacity_blocks=64)
    if kind == "redis":
        from kvactors.tiers.redis import RedisTier

        server = request.getfixturevalue("redis_server")
        return RedisTier(server.url, namespace=f"wrappers-{uuid.uuid4().hex[:8]}")
    if kind == "hookless":
        return PlainTier()
    return HookedTier(name="hooked", capacity_blocks=64)


WRAPPERS: dict[str, Callable[[SecondaryTier, ThreadDeferrer], SecondaryTier]] = {
    "delegating": lambda tier, deferrer: DelegatingTier(tier),
    "faults": lambda tier, deferrer: FaultTier(tier, deferrer=deferrer, faults=Faults()),
    "recorded": lambda tier, deferrer: RecordedTier(tier, record=TierRecord()),
    "recorded-faults": lambda tier, deferrer: RecordedTier(FaultTier(tier, deferrer=deferrer, faults=Faults())),
    "prefixed": lambda tier, deferrer: PrefixedTier(tier, b"model:1"),
}


def _spy(tier: SecondaryTier) -> Counter[str]:
    """Count the calls that reach ``tier``: instance attributes, so its class (which the runtime inspects)
    is unchanged."""
    seen: Counter[str] = Counter()
    for name in CALLS:
        method = getattr(tier, name)

        def spy(*args: Any, _method: Any = method, _name: str = name) -> Any:
            seen[_name] += 1
            return _method(*args)

        setattr(tier, name, spy)
    return seen


def _paths(manager: TieringManager, name: str) -> dict[str, Any]:
    """What the runtime chose for tier ``name`` at its start."""
    actors = {ref.name: getattr(ref, "actor", None) or ref._actor for ref in manager._actors}  # type: ignore[attr-defined]
    link = actors["supervisor"].tiers[name]
    return {"announce_starts": actors["primary"].announce_starts, "wants_new_request": link.wants_new_request,
            "wants_touch": link.wants_touch, "inline": link.inline,
            "max_inflight": actors["supervisor"].jobs.max_inflight[name]}


def _workload(tier: SecondaryTier) -> dict[str, Any]:
    """Store two keys, cascade them to ``tier``, drop them from the CPU pool, promote them back."""
    with TieringManager.start(num_blocks=8, block_bytes=256, secondary_tiers=[tier], transfer_timeout_s=10,
                              lookup_timeout_s=10) as manager:
        paths = _paths(manager, tier.name)
        first = ReqContext("first")
        manager.on_new_request(first)
        assert manager.lookup([b"a", b"b"], first) == [LookupResult.MISS] * 2
        out = manager.prepare_store([b"a", b"b"], first)
        manager.complete_store(out.keys_to_store, first)
        manager.on_request_finished(first)
        assert manager.wait_idle(10)
        manager.reset_cache()
        second = ReqContext("second")
        manager.on_new_request(second)
        assert manager.lookup([b"a", b"b"], second) == [LookupResult.HIT_PENDING] * 2
        assert manager.wait_idle(10)
        assert wait_for(lambda: manager.lookup([b"a", b"b"], second) == [LookupResult.HIT] * 2, 10)
        manager.on_request_finished(second)
        assert manager.wait_idle(10)
        manager.take_events()
    return paths


@pytest.mark.timeout(60)
@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
@pytest.mark.parametrize("kind", ["disk", "memory", "redis", "hookless", "hooked"])
def test_a_wrapped_tier_takes_the_paths_of_the_bare_one(kind: str, wrapper: str, tmp_path: Path,
                                                         request: pytest.FixtureRequest) -> None:
    deferrer = ThreadDeferrer(1, name="wrappers-test")
    try:
        bare = _inner(kind, tmp_path, request)
        bare_calls = _spy(bare)
        bare_paths = _workload(bare)
        inner = _inner(kind, tmp_path, request)
        wrapped_calls = _spy(inner)
        wrapped_paths = _workload(WRAPPERS[wrapper](inner, deferrer))
    finally:
        deferrer.close()
    assert wrapped_paths == bare_paths
    assert wrapped_calls == bare_calls
    assert bare_calls["submit_store"] >= 1 and bare_calls["submit_load"] >= 1  # the workload reached the tier


def test_a_wrapper_declares_the_inner_tiers_hooks_and_keeps_its_class() -> None:
    record = TierRecord()
    plain, hooked = RecordedTier(PlainTier(), record=record), RecordedTier(HookedTier(capacity_blocks=4))
    assert type(plain) is type(hooked) is RecordedTier  # no class built per shape: the hooks are declared
    assert PlainTier.hooks == plain.hooks == frozenset()
    assert HookedTier.hooks == hooked.hooks == HOOKS
    deferrer = ThreadDeferrer(1)
    try:
        assert RecordedTier(FaultTier(HookedTier(capacity_blocks=4), deferrer=deferrer)).hooks == HOOKS
    finally:
        deferrer.close()
    with pytest.raises(TypeError, match="wraps a SecondaryTier"):
        DelegatingTier(object())  # type: ignore[arg-type]


def test_a_class_declares_its_hooks_or_gets_those_it_defines() -> None:
    """The default declaration: the bases' hooks and those the class body defines; a declaration wins."""

    class Touching(PlainTier):
        def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
            pass

    class Declared(Touching):
        hooks = frozenset({"on_request_finished"})

    class Below(Declared):
        def on_new_request(self, ctx: ReqContext) -> None:
            pass

    assert Touching.hooks == {"touch"} and Declared.hooks == {"on_request_finished"}
    assert Below.hooks == {"on_request_finished", "on_new_request"}
    assert MemoryTier.hooks == DiskTier.hooks == {"touch"}
    bad = PlainTier()
    bad.hooks = frozenset({"lookup"})  # type: ignore[misc]
    with pytest.raises(ValueError, match="hooks names"):
        hooks_of(bad)


def test_the_explorers_stacks_keep_their_hooks() -> None:
    """A ``RecordingTier`` declaring ``on_new_request`` is announced starts, one without it is not:
    the explorer's ``tier_hooks`` draw still chooses between the two paths."""
    import torch

    from kvactors.actors.secondary import SecondaryTierActor
    from kvactors.testing import SimRuntime
    from kvactors.testing.tiers import RecordingTier

    supervisor = SimRuntime(0).new_ref("supervisor")
    pool = torch.zeros((4, 8), dtype=torch.uint8)

    def actor(tier: SecondaryTier) -> SecondaryTierActor:
        return SecondaryTierActor(tier, supervisor=supervisor, pool=pool)  # attaches: once per tier

    deferrer = ThreadDeferrer(1)
    try:
        hooked = RecordingTier(name="a", capacity_blocks=4, deferrer=deferrer)
        plain = RecordingTier(name="b", capacity_blocks=4, deferrer=deferrer, hooks=HOOKS - {"on_new_request"})
        inner = RecordingTier(name="c", capacity_blocks=4, deferrer=deferrer).memory
        hooked_actor, plain_actor = actor(hooked), actor(plain)
        assert hooked_actor.wants_new_request and not plain_actor.wants_new_request
        assert hooked_actor.inline == actor(inner).inline == frozenset()
        assert plain_actor.inline == {"on_new_request"}  # not declared: a no-op
        assert [type(layer).__name__ for layer in plain.layers()] == ["RecordingTier", "FaultTier",
                                                                       "DeferredMemoryTier"]
    finally:
        deferrer.close()
