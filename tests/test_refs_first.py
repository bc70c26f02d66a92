"""Refs before actors: each actor takes its peers' refs in its constructor, then starts.

Both runtimes hand out refs (``new_ref``) before the actors exist and bind each one at
``start``; the manager builds its actors that way, and a failure while building them
leaves no thread behind.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

from kvactors import JobResult, TieringManager
from kvactors.actors.reply import Reply
from kvactors.actors.runtime import Actor, ActorRef, Runtime, handles
from kvactors.actors.secondary import SecondaryTierActor
from kvactors.actors.supervisor import LifecycleSupervisor
from kvactors.actors.threads import ThreadRuntime
from kvactors.testing import SimRuntime
from kvactors.tiers.memory import MemoryTier

RUNTIMES: list[tuple[str, Callable[[], Runtime]]] = [
    ("threads", ThreadRuntime),
    ("seeded", lambda: SimRuntime(seed=7)),
]


class Ping(Actor):
    """Counts down, passing the count to its peer; sets ``done`` at zero."""

    def __init__(self, name: str, peer: ActorRef, done: Reply[str], log: list[tuple[str, int]]) -> None:
        self.name = name
        self.peer = peer
        self.done = done
        self.entries = log

    @handles(int)
    def _on_int(self, count: int) -> None:
        self.entries.append((self.name, count))
        if count:
            self.peer.tell(count - 1)
        else:
            self.done.set_result(self.name)


@pytest.mark.parametrize(("label", "make"), RUNTIMES, ids=[label for label, _ in RUNTIMES])
def test_actors_that_refer_to_each_other_get_each_others_refs_in_their_constructors(label, make):
    runtime = make()
    first = runtime.new_ref("first")
    second = runtime.new_ref("second", colocate_with=first)
    done: Reply[str] = Reply()
    log: list[tuple[str, int]] = []
    runtime.start(first, Ping("first", second, done, log))
    runtime.start(second, Ping("second", first, done, log))
    first.tell(4)
    assert runtime.wait(done, 10)
    assert log == [("first", 4), ("second", 3), ("first", 2), ("second", 1), ("first", 0)]
    assert runtime.stop([first, second], 5) == []


@pytest.mark.parametrize(("label", "make"), RUNTIMES, ids=[label for label, _ in RUNTIMES])
def test_a_colocated_actor_starts_after_its_host_and_a_ref_is_bound_once(label, make):
    runtime = make()
    host = runtime.new_ref("host")
    guest = runtime.new_ref("guest", colocate_with=host)
    done: Reply[str] = Reply()
    with pytest.raises(ValueError, match="after the actor it is colocated with"):
        runtime.start(guest, Ping("guest", host, done, []))
    runtime.start(host, Ping("host", guest, done, []))
    with pytest.raises(ValueError, match="started already"):
        runtime.start(host, Ping("again", guest, done, []))
    runtime.start(guest, Ping("guest", host, done, []))
    host.tell(1)
    assert runtime.wait(done, 10) and done.result() == "guest"
    assert runtime.stop([host], 5) == []


@pytest.mark.parametrize(("label", "make"), RUNTIMES, ids=[label for label, _ in RUNTIMES])
def test_a_ref_never_started_stops_at_once(label, make):
    """What a failed start leaves: a ref whose actor was never built stops without waiting."""
    runtime = make()
    ref = runtime.new_ref("never")
    assert runtime.stop([ref], 1) == []
    assert ref.closed


def _threads_of(runtime: ThreadRuntime) -> set[str]:
    return {thread.name for thread in threading.enumerate() if thread.name.startswith(runtime.name + "-")}


def test_a_thread_runtime_starts_no_thread_before_its_first_actor():
    runtime = ThreadRuntime()
    ref = runtime.new_ref("only")
    assert _threads_of(runtime) == set()
    done: Reply[str] = Reply()
    runtime.start(ref, Ping("only", ref, done, []))
    ref.tell(0)
    assert done.wait(10)
    assert _threads_of(runtime) == {f"{runtime.name}-only", f"{runtime.name}-timer"}
    assert runtime.stop([ref], 5) == []


class _Failing(MemoryTier):
    """A tier whose attach fails: the last step of building the actors."""

    def attach(self, pool: torch.Tensor, report: object) -> None:  # type: ignore[override]
        raise RuntimeError("attach refused")


def test_a_tier_that_cannot_attach_fails_the_start_and_leaves_no_thread():
    def kvactors_threads() -> set[str]:
        return {thread.name for thread in threading.enumerate() if thread.name.startswith("kvactors")}

    before = kvactors_threads()
    attached = MemoryTier(name="ok", capacity_blocks=4)
    with pytest.raises(RuntimeError, match="attach refused"):
        TieringManager.start(num_blocks=4, block_bytes=8,
                             secondary_tiers=[attached, _Failing(name="bad", capacity_blocks=4)])
    assert kvactors_threads() == before


@pytest.mark.parametrize(("label", "make"), RUNTIMES, ids=[label for label, _ in RUNTIMES])
def test_a_message_told_before_the_start_is_delivered_first_at_the_start(label, make):
    runtime = make()
    first = runtime.new_ref("first")
    second = runtime.new_ref("second", colocate_with=first)
    done: Reply[str] = Reply()
    log: list[tuple[str, int]] = []
    first.tell(3)  # before any actor exists: a tier may report from attach()
    first.tell(1)
    runtime.start(first, Ping("first", second, done, log))
    first.tell(2)
    runtime.start(second, Ping("second", first, done, log))
    assert runtime.wait(done, 10)
    # Every message to "first" in the order told, the early ones first.
    assert [count for name, count in log if name == "first"][:3] == [3, 1, 2]
    assert runtime.stop([first, second], 5) == []


class ReportsOnAttach(MemoryTier):
    """Reports a job this manager never sent, from ``attach`` (before any actor runs)."""

    def attach(self, pool: torch.Tensor, report: Callable[[JobResult], None]) -> None:
        super().attach(pool, report)
        report(JobResult(12345, True))


@pytest.mark.parametrize(("label", "make"), RUNTIMES, ids=[label for label, _ in RUNTIMES])
def test_a_report_during_attach_is_counted_as_unexpected_and_the_start_succeeds(label, make):
    with TieringManager.start(num_blocks=4, block_bytes=16, runtime=make(),
                              secondary_tiers=[ReportsOnAttach(name="m", capacity_blocks=4)]) as manager:
        assert manager.wait_idle(5.0)
        assert manager.stats()["unexpected_reports"] == 1


class CountsAttach(MemoryTier):
    attached = 0

    def attach(self, pool: torch.Tensor, report: Callable[[JobResult], None]) -> None:
        type(self).attached += 1
        super().attach(pool, report)


def test_a_bad_declaration_on_a_later_tier_fails_the_start_before_any_tier_is_attached():
    good = CountsAttach(name="a", capacity_blocks=4)
    bad = CountsAttach(name="b", capacity_blocks=4)
    bad.inline_calls = frozenset({"no_such_call"})  # type: ignore[misc,assignment]
    with pytest.raises(ValueError, match="no_such_call"):
        TieringManager.start(num_blocks=4, block_bytes=16, secondary_tiers=[good, bad])
    assert CountsAttach.attached == 0


class _Remote(MemoryTier):
    max_inflight_jobs = 3
    locality = "REMOTE"


def test_the_supervisor_takes_each_tiers_limit_and_kind_from_its_address_alone():
    runtime = SimRuntime(seed=7)
    primary_ref, supervisor_ref = runtime.new_ref("primary"), runtime.new_ref("supervisor")
    pool = torch.zeros((4, 8), dtype=torch.uint8)
    actors = [SecondaryTierActor(tier, supervisor=supervisor_ref, pool=pool)
              for tier in (_Remote(name="far", capacity_blocks=4), MemoryTier(name="near", capacity_blocks=4))]
    addresses = [actor.address(runtime.new_ref(f"tier-{actor.tier.name}")) for actor in actors]
    supervisor = LifecycleSupervisor(primary=primary_ref, tiers=addresses, transfer_timeout_s=1.0,
                                     lookup_timeout_s=1.0)
    assert supervisor.tier_order == ("far", "near")
    assert supervisor.jobs.max_inflight == {"far": 3, "near": MemoryTier.max_inflight_jobs}
    assert supervisor.tier_kinds == {"far": ("CPU", "REMOTE"), "near": ("CPU", "LOCAL")}
    with pytest.raises(ValueError, match="one address"):
        LifecycleSupervisor(primary=primary_ref, tiers=[addresses[0], addresses[1], addresses[0]],
                            transfer_timeout_s=1.0, lookup_timeout_s=1.0)
