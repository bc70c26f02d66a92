"""Claiming an idle actor: the caller runs one message itself, alone and in order."""

from __future__ import annotations

import json
import sys
import threading

import pytest

from kvactors import LookupResult, ReqContext, TieringManager
from kvactors.actors.reply import Reply
from kvactors.actors.runtime import Actor, handles
from kvactors.actors.threads import ThreadActorRef, ThreadRuntime
from kvactors.testing import SimRuntime
from tests.support import keys, within


class Blocker(Actor):
    """Blocks in its handler until told to go on; records who ran each message."""

    name = "blocker"

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.go_on = threading.Event()
        self.ran_on: list[tuple[str, int]] = []

    @handles(str)
    def _on_str(self, label: str) -> None:
        self.ran_on.append((label, threading.get_ident()))
        if label == "block":
            self.entered.set()
            assert self.go_on.wait(10)
        if label == "fail":
            raise RuntimeError("planted")

    @handles(Reply)
    def _on_reply(self, reply: Reply) -> None:
        reply.set_result([label for label, _ in self.ran_on])


class Ordered(Actor):
    """Checks that each sender's messages arrive in the order they were sent."""

    name = "ordered"

    def __init__(self) -> None:
        self.last: dict[int, int] = {}
        self.out_of_order: list[tuple[int, int, int]] = []
        self.running = 0
        self.overlaps = 0

    @handles(tuple)
    def _on_tuple(self, message: tuple[int, int]) -> None:
        self.running += 1
        if self.running > 1:
            self.overlaps += 1
        sender, seq = message
        if seq != self.last.get(sender, -1) + 1:
            self.out_of_order.append((sender, self.last.get(sender, -1), seq))
        self.last[sender] = seq
        self.running -= 1

    @handles(Reply)
    def _on_reply(self, reply: Reply) -> None:
        reply.set_result(None)


def send(ref: ThreadActorRef, message: object) -> bool:
    """What the manager does: claim the idle actor and run here, or queue."""
    if ref.claim():
        ref.run_claimed(message)
        return True
    ref.tell(message)
    return False


def settle(ref: ThreadActorRef) -> list[str]:
    reply: Reply[list[str]] = Reply()
    ref.tell(reply)
    assert reply.wait(10)
    return reply.result()


@pytest.fixture
def runtime():
    runtime = ThreadRuntime()
    yield runtime
    runtime.stop(runtime.refs, 5)


def test_claim_runs_on_the_calling_thread_and_is_refused_while_a_handler_runs(runtime):
    actor = Blocker()
    ref = runtime.spawn(actor, "blocker")
    assert ref.claim()
    ref.run_claimed("first")
    assert actor.ran_on[-1] == ("first", threading.get_ident())

    ref.tell("block")
    assert actor.entered.wait(10)
    assert not ref.claim()  # the actor's thread is in a handler
    ref.tell("queued")
    actor.go_on.set()
    assert settle(ref) == ["first", "block", "queued"]
    assert actor.ran_on[1][1] != threading.get_ident()
    assert ref.claim()  # idle again
    ref.run_claimed("second")
    assert actor.ran_on[-1] == ("second", threading.get_ident())


def test_a_claimed_failure_reaches_its_caller_and_the_actor_lives(runtime):
    actor = Blocker()
    ref = runtime.spawn(actor, "blocker")
    assert ref.claim()
    ref.run_claimed("fail")  # a tell-like message: contained, counted
    assert actor.internal_errors == 1
    assert ref.claim()  # the turn was given back
    reply: Reply[list[str]] = Reply()
    ref.run_claimed(reply)
    assert reply.result(1) == ["fail"]


def test_no_claim_after_stop_or_when_claims_are_off():
    runtime = ThreadRuntime()
    ref = runtime.spawn(Blocker(), "blocker")
    runtime.stop([ref], 5)
    assert not ref.claim()

    off = ThreadRuntime(claims=False)
    ref = off.spawn(Blocker(), "blocker")
    assert not ref.claim()
    assert settle(ref) == []
    off.stop([ref], 5)


@pytest.mark.timeout(120)
def test_claims_keep_each_senders_order_and_one_handler_at_a_time(runtime):
    """Senders race claims against queued messages on a tiny switch interval.

    A claim that looked only at "is a handler running" would overtake the
    sender's own message still in the mailbox; the mailbox's owner (nobody
    only when nothing is pending) is what forbids it."""
    actor = Ordered()
    ref = runtime.spawn(actor, "ordered")
    senders, per_sender = 6, 3000
    claimed = [0] * senders
    start = threading.Barrier(senders)

    def sender(n: int) -> None:
        start.wait()
        for seq in range(per_sender):
            claimed[n] += send(ref, (n, seq))

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        threads = [threading.Thread(target=sender, args=(n,)) for n in range(senders)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    finally:
        sys.setswitchinterval(old)
    reply: Reply[list[str]] = Reply()
    ref.tell(reply)
    assert reply.wait(30)
    assert actor.out_of_order == []
    assert actor.overlaps == 0
    assert actor.last == {n: per_sender - 1 for n in range(senders)}
    # Both paths were taken, or the test proves nothing.
    total_claimed = sum(claimed)
    assert 0 < total_claimed < senders * per_sender


def test_frontend_calls_run_on_the_caller_when_the_primary_is_idle(tmp_path):
    log = tmp_path / "events.jsonl"
    ctx = ReqContext("r")
    with TieringManager.start(num_blocks=8, block_bytes=8, event_log=log) as manager:
        manager.on_new_request(ctx)
        assert manager.wait_idle(10)
        out = manager.prepare_store(keys(1), ctx)
        assert out is not None
        manager.complete_store(out.keys_to_store, ctx)
        manager.on_request_finished(ctx)
        assert manager.wait_idle(10)
    events = [json.loads(line) for line in log.read_text().splitlines()]
    ran_on = {e["event"]: e["thread"] for e in events if e.get("req_id") == "r"}
    here = threading.current_thread().name
    assert ran_on["store_prepared"] == here
    assert ran_on["store_completed"] == here
    assert ran_on["request_finished"] == here


class Chain(Actor):
    """Tells itself ``n - 1`` after handling ``n`` (down to 0); records the thread of each."""

    name = "chain"

    def __init__(self) -> None:
        self.ran_on: dict[int, int] = {}
        self.done = threading.Event()

    @handles(int)
    def _on_int(self, n: int) -> None:
        self.ran_on[n] = threading.get_ident()
        if n:
            self.ref.tell(n - 1)
        else:
            self.done.set()


def off_main(fn):
    """``fn()`` on a thread of its own, named ``test-frontend`` (a frontend's: not the main thread)."""
    return within(30, fn, "frontend")[0]


def test_a_claimer_follows_what_its_handler_told_up_to_the_limit_the_thread_the_rest(runtime):
    from kvactors.actors.mailbox import CLAIM_FOLLOW_LIMIT

    actor = Chain()
    ref = runtime.spawn(actor, "chain")
    length = CLAIM_FOLLOW_LIMIT + 5

    def claimed() -> int:
        assert ref.claim()
        ref.run_claimed(length)
        return threading.get_ident()

    here = off_main(claimed)
    assert actor.done.wait(10)
    on_caller = [n for n, ident in actor.ran_on.items() if ident == here]
    # The claimed message and CLAIM_FOLLOW_LIMIT of those it caused, in order; the thread the rest.
    assert sorted(on_caller, reverse=True) == list(range(length, length - CLAIM_FOLLOW_LIMIT - 1, -1))
    assert all(actor.ran_on[n] != here for n in range(length - CLAIM_FOLLOW_LIMIT))


def test_a_claimer_stops_following_once_its_reply_is_in(runtime):
    actor = Chain()
    ref = runtime.spawn(actor, "chain")

    def claimed() -> int:
        assert ref.claim()
        ref.run_claimed(5, until=lambda: 3 in actor.ran_on)  # "the reply": message 3 handled
        return threading.get_ident()

    here = off_main(claimed)
    assert actor.done.wait(10)
    assert [n for n in (5, 4, 3) if actor.ran_on[n] == here] == [5, 4, 3]
    assert actor.ran_on[2] != here and actor.ran_on[0] != here


def test_on_the_main_thread_a_claimer_runs_its_own_message_alone(runtime):
    """Python delivers signals to the main thread: a Ctrl-C there must not cut another handler short."""
    assert threading.current_thread() is threading.main_thread()
    actor = Chain()
    ref = runtime.spawn(actor, "chain")
    assert ref.claim()
    ref.run_claimed(3)
    assert actor.done.wait(10)
    here = threading.get_ident()
    assert actor.ran_on[3] == here and all(actor.ran_on[n] != here for n in (2, 1, 0))


def test_a_lookup_through_inline_tiers_runs_whole_on_the_caller(tmp_path):
    """Primary, supervisor and the tiers' inline lookups: no thread hand-off when the primary is idle."""
    from kvactors.tiers.memory import MemoryTier

    tiers = [MemoryTier(name="m0", capacity_blocks=64), MemoryTier(name="m1", capacity_blocks=64)]
    seen: list[str] = []
    for tier in tiers:
        lookup = tier.lookup

        def recording(keys_, ctx_, lookup=lookup):
            seen.append(threading.current_thread().name)
            return lookup(keys_, ctx_)

        tier.lookup = recording  # type: ignore[method-assign]
    ctx = ReqContext("r")
    with TieringManager.start(num_blocks=8, block_bytes=8, secondary_tiers=tiers) as manager:
        manager.on_new_request(ctx)
        assert manager.wait_idle(10)
        assert off_main(lambda: manager.lookup(keys(2), ctx)) == [LookupResult.MISS] * len(keys(2))
    assert seen == ["test-frontend"] * 2


def test_frontend_calls_queue_when_claims_are_off(tmp_path):
    log = tmp_path / "events.jsonl"
    ctx = ReqContext("r")
    with TieringManager.start(num_blocks=8, block_bytes=8, event_log=log,
                              runtime=ThreadRuntime(claims=False)) as manager:
        manager.on_new_request(ctx)
        assert manager.prepare_store(keys(1), ctx) is not None
    events = [json.loads(line) for line in log.read_text().splitlines()]
    ran_on = {e["event"]: e["thread"] for e in events if e.get("req_id") == "r"}
    assert ran_on["request_started"].endswith("-primary")
    assert ran_on["store_prepared"].endswith("-primary")


@pytest.mark.parametrize("claim_chance", [0.0, 1.0])
def test_sim_runtime_grants_claims_by_the_seed(claim_chance):
    runtime = SimRuntime(seed=7, claim_chance=claim_chance)
    manager = TieringManager.start(num_blocks=8, block_bytes=8, runtime=runtime)
    ctx = ReqContext("r")
    manager.on_new_request(ctx)
    runtime.run()
    steps = runtime.steps
    assert manager.prepare_store(keys(1), ctx) is not None
    # Claimed: the handler ran within the call, no scheduler step; otherwise at least one.
    assert (runtime.steps == steps) == (claim_chance == 1.0)
    manager.stop()


class Interrupted(Actor):
    """Raises a ``BaseException`` that is not an ``Exception`` when asked to."""

    name = "interrupted"

    def __init__(self) -> None:
        self.seen: list[str] = []

    @handles(str)
    def _on_str(self, label: str) -> None:
        if label in ("ctrl-c", "exit"):
            self.ref.tell("told meanwhile")  # waits in the mailbox for the claimer's turn to end
            raise KeyboardInterrupt if label == "ctrl-c" else SystemExit(3)
        self.seen.append(label)

    @handles(Reply)
    def _on_reply(self, reply: Reply) -> None:
        reply.set_result(list(self.seen))


@pytest.mark.parametrize(("label", "error"), [("ctrl-c", KeyboardInterrupt), ("exit", SystemExit)])
def test_a_ctrl_c_in_a_claimed_call_gives_the_claim_back_and_reaches_the_caller(runtime, label, error):
    """Issue 15 item 4: not swallowed as a handler failure (it was: ``except BaseException``)."""
    actor = Interrupted()
    ref = runtime.spawn(actor, "interrupted")
    assert ref.claim()
    with pytest.raises(error):
        ref.run_claimed(label)
    assert actor.internal_errors == 0
    assert settle(ref) == ["told meanwhile"]  # handed to the actor's thread
    assert ref.claim()  # the turn was given back
    ref.run_claimed("after")
    assert settle(ref) == ["told meanwhile", "after"]


def test_a_ctrl_c_in_a_claimed_frontend_call_reaches_the_caller_and_the_manager_goes_on(monkeypatch):
    from kvactors.actors.primary import PrimaryTier

    prepare_store = PrimaryTier._on_prepare_store
    interrupts = [KeyboardInterrupt()]

    def interrupted(self: PrimaryTier, msg: object) -> None:
        if interrupts:
            raise interrupts.pop()
        prepare_store(self, msg)

    monkeypatch.setattr(PrimaryTier, "_on_prepare_store", interrupted)
    monkeypatch.setattr(PrimaryTier, "_handlers", dict(PrimaryTier._handlers))
    ctx = ReqContext("r")
    with TieringManager.start(num_blocks=8, block_bytes=8) as manager:
        manager.on_new_request(ctx)
        assert manager.wait_idle(10)
        with pytest.raises(KeyboardInterrupt):
            manager.prepare_store(keys(1), ctx)  # claimed: the primary was idle
        out = manager.prepare_store(keys(1), ctx)
        assert out is not None and out.keys_to_store
        assert manager.stats()["internal_errors"] == 0


@pytest.mark.parametrize("error", [KeyboardInterrupt, SystemExit, ValueError])
def test_anything_a_tier_plugin_raises_is_its_failure_and_the_runtime_goes_on(error):
    """Issue 29 item 9, the policy in kvactors.actors.runtime: a plugin is foreign code; even its
    SystemExit (a sys.exit() in a tier) is that tier's failure, never the death of an actor's thread."""
    from kvactors.tiers.memory import MemoryTier

    class Raising(MemoryTier):
        def touch(self, keys_, ctx_):
            raise error()

    ctx = ReqContext("r")
    with TieringManager.start(num_blocks=8, block_bytes=8,
                              secondary_tiers=[Raising(name="m", capacity_blocks=4)]) as manager:
        manager.on_new_request(ctx)
        assert manager.wait_idle(10)
        manager.touch(keys(1), ctx)  # on the primary's thread, or inline on a claimer's
        off_main(lambda: manager.touch(keys(2), ctx))
        assert manager.wait_idle(10)
        out = manager.prepare_store(keys(3), ctx)  # every actor still serves
        manager.complete_store(out.keys_to_store, ctx)
        manager.on_request_finished(ctx)
        assert manager.wait_idle(10)
        stats = manager.stats()
        assert stats["active_requests"] == 0 and stats["internal_errors"] == 0 and stats["blocks_ready"] == 1


def test_both_runtimes_drive_the_one_mailbox():
    from kvactors.actors.mailbox import Mailbox

    threads = ThreadRuntime()
    sim = SimRuntime(seed=1)
    try:
        assert type(threads.spawn(Blocker(), "b").mailbox) is Mailbox
        assert isinstance(sim.spawn(Blocker(), "b").mailbox, Mailbox)
    finally:
        threads.stop(threads.refs, 5)


def test_the_scheduler_can_find_a_handler_done_but_its_thread_still_owning_the_mailbox():
    """As on threads: the thread's "nothing pending, go idle" is a step of its own, so a
    claim between the handler and it is refused (the seed picks either order)."""
    outcomes = set()
    for seed in range(40):
        sim = SimRuntime(seed=seed, claim_chance=1.0)
        ref = sim.spawn(Blocker(), "b")
        ref.tell("queued")
        sim.step()  # the thread handles "queued"
        sim.spawn_client("c", lambda ref=ref: outcomes.add(ref.claim() and (ref.run_claimed("claimed") or True)))
        sim.run()
    assert outcomes == {True, False}
