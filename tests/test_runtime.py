"""The thread runtime: pykka's stop race and global registry kept out, failures contained."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from concurrent.futures import Future

import pykka
import pytest

from kvactors import JobResult, ManagerStoppedError, ReqContext, TieringManager
from kvactors.actors.runtime import Actor, ActorStoppedError, handles
from kvactors.actors.threads import ThreadRuntime
from kvactors.core.deadlines import DeadlineQueue
from tests.support import ControlledTier, keys, settled


class Echo(Actor):
    name = "echo"

    def __init__(self) -> None:
        self.seen: list[int] = []

    @handles(int)
    def _on_int(self, value: int) -> None:
        if value < 0:
            raise ValueError("negative")
        self.seen.append(value)

    @handles(Future)
    def _on_future(self, reply: Future) -> None:
        reply.set_result(list(self.seen))


def test_failed_tell_is_contained_and_actor_lives():
    runtime = ThreadRuntime()
    actor = Echo()
    ref = runtime.spawn(actor, "echo")
    ref.tell(1)
    ref.tell(-1)  # raises in the handler
    ref.tell(2)
    reply: Future = Future()
    ref.tell(reply)
    assert reply.result(5) == [1, 2]
    assert actor.internal_errors == 1
    runtime.stop([ref], 5)
    with pytest.raises(ActorStoppedError):
        ref.tell(3)


def test_registry_stop_all_does_not_stop_kvactors():
    with TieringManager.start(num_blocks=4, block_bytes=8) as manager:
        pykka.ActorRegistry.stop_all()  # another library's teardown
        ctx = ReqContext("r")
        manager.on_new_request(ctx)
        assert manager.prepare_store(keys(1), ctx) is not None


@pytest.mark.timeout(120)
def test_stop_during_in_flight_completions_never_loses_or_hangs():
    """pykka's stop race: a tell that passes the alive check while the actor drains is lost.

    Here, reports race with stop() on a tiny switch interval; each is either processed
    or, after stop, refused at its sender, and stop() always returns."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for trial in range(40):
            tier = ControlledTier()
            manager = TieringManager.start(num_blocks=16, block_bytes=8, secondary_tiers=[tier],
                                           transfer_timeout_s=30)
            ctx = ReqContext(f"r{trial}")
            manager.on_new_request(ctx)
            for n in range(4):
                out = manager.prepare_store(keys(n), ctx)
                manager.complete_store(out.keys_to_store, ctx)
            jobs = tier.wait_held(4)
            manager.on_request_finished(ctx)
            releaser = threading.Thread(target=tier.release_all)
            stopper = threading.Thread(target=manager.stop, kwargs={"timeout": 20})
            releaser.start()
            stopper.start()
            stopper.join(30)
            releaser.join(30)
            assert not stopper.is_alive(), f"stop() hung in trial {trial}"
            assert manager.stopped
            # Late reports after stop are refused at the sender, never raised into the tier.
            tier.report(JobResult(jobs[0].job_id, True))
            with pytest.raises(ManagerStoppedError):
                manager.stats()
    finally:
        sys.setswitchinterval(old)


def test_stop_waits_for_in_flight_jobs_and_shuts_tiers_down():
    tier = ControlledTier()
    shutdowns = []
    tier.shutdown = lambda: shutdowns.append(True)  # type: ignore[method-assign]
    manager = TieringManager.start(num_blocks=4, block_bytes=8, secondary_tiers=[tier])
    ctx = ReqContext("r")
    manager.on_new_request(ctx)
    out = manager.prepare_store(keys(1), ctx)
    manager.complete_store(out.keys_to_store, ctx)
    tier.wait_held(1)
    manager.on_request_finished(ctx)
    stopper = threading.Thread(target=manager.stop)
    stopper.start()
    stopper.join(0.3)
    assert stopper.is_alive()  # draining: the job is in flight
    tier.release_all()
    stopper.join(10)
    assert not stopper.is_alive() and shutdowns == [True]
    assert tier.calls_of(ctx) == ["on_new_request", "submit_store", "on_request_finished"]


def test_stop_does_not_finalize_active_requests():
    tier = ControlledTier(hold=False)
    manager = TieringManager.start(num_blocks=4, block_bytes=8, secondary_tiers=[tier])
    active, done = ReqContext("active"), ReqContext("done")
    manager.on_new_request(active)
    manager.on_new_request(done)
    manager.on_request_finished(done)
    settled(manager)
    manager.stop()
    assert tier.calls_of(active) == ["on_new_request"]
    assert tier.calls_of(done) == ["on_new_request", "on_request_finished"]


def test_stop_with_a_stalled_tier_returns_within_its_timeout():
    tier = ControlledTier()  # holds its job forever
    manager = TieringManager.start(num_blocks=4, block_bytes=8, secondary_tiers=[tier])
    ctx = ReqContext("r")
    manager.on_new_request(ctx)
    out = manager.prepare_store(keys(1), ctx)
    manager.complete_store(out.keys_to_store, ctx)
    tier.wait_held(1)
    stopper = threading.Thread(target=manager.stop, kwargs={"timeout": 1.0})
    stopper.start()
    stopper.join(10)
    assert not stopper.is_alive()


def test_thread_count_is_bounded_by_tiers_not_requests():
    before = threading.active_count()
    with TieringManager.start(num_blocks=64, block_bytes=8,
                              secondary_tiers=[ControlledTier(hold=False, name=f"t{n}") for n in range(2)]) as manager:
        during = threading.active_count()
        for n in range(300):
            ctx = ReqContext(f"r{n}")
            manager.on_new_request(ctx)
            out = manager.prepare_store(keys(n % 50), ctx)
            if out is not None:
                manager.complete_store(out.keys_to_store, ctx)
            manager.on_request_finished(ctx)
        settled(manager)
        assert threading.active_count() == during
    assert during - before == 4  # primary (the supervisor colocated with it), two tiers, one timer


def test_importing_configures_no_logging_and_prints_nothing():
    code = ("import logging, structlog, kvactors; "
            "assert not structlog.is_configured(); "
            "assert logging.getLogger().handlers == []; "
            "m = kvactors.TieringManager.start(num_blocks=2, block_bytes=8); "
            "c = kvactors.ReqContext('r'); m.on_new_request(c); m.on_request_finished(c); m.stop()")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "" and result.stderr == ""


def test_events_reach_stdlib_logging_when_an_application_asks(caplog):
    caplog.set_level(logging.DEBUG, logger="kvactors")
    with TieringManager.start(num_blocks=2, block_bytes=8) as manager:
        ctx = ReqContext("logged")
        manager.on_new_request(ctx)
        manager.complete_store(keys(1), ctx)  # misuse: never prepared
        settled(manager)
    messages = [record.getMessage() for record in caplog.records]
    assert any(msg.startswith("request_started") and "req_id=logged" in msg for msg in messages)
    assert any(msg.startswith("contract_violation") and "complete_store" in msg for msg in messages)


def test_deadline_queue_orders_and_discards():
    queue: DeadlineQueue[str] = DeadlineQueue()
    queue.add("late", 3.0)
    queue.add("early", 1.0)
    queue.add("gone", 2.0)
    queue.discard("gone")
    assert queue.next_deadline() == 1.0
    assert queue.pop_expired(2.5) == ["early"]
    assert len(queue) == 1 and "late" in queue
    queue.add("late", 5.0)  # re-armed: the old entry is ignored
    assert queue.pop_expired(4.0) == []
    assert queue.pop_expired(5.0) == ["late"]


def test_lookup_lane_takes_each_lookup_once_while_its_sender_pushes():
    """The lane is shared by the supervisor (pushing) and the tier actor (taking out of
    order). A bare deque's remove() compares with a dataclass __eq__ (Python code), and
    an append meanwhile made it raise "deque mutated during iteration"."""
    from kvactors.actors import messages as m
    from kvactors.actors.secondary import LookupLane

    lookups = [m.TierLookup(n, (b"k%d" % n,), ReqContext(f"r{n % 7}")) for n in range(2000)]
    lane = LookupLane()
    pushed = [0]
    done = threading.Event()
    taken: list[int] = []
    errors: list[BaseException] = []

    def push() -> None:
        for n, lookup in enumerate(lookups):
            lane.push(lookup)
            pushed[0] = n + 1
        done.set()

    def take() -> None:
        try:
            while not done.is_set():
                newest = pushed[0] - 1
                # Out of order: the newest, past every older one still waiting ahead of it.
                if newest >= 0 and (not taken or taken[-1] != newest) and lane.take(lookups[newest]):
                    taken.append(newest)
            taken.extend(lookup.lookup_id for lookup in lane.take_leading())
        except BaseException as exc:
            errors.append(exc)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=take), threading.Thread(target=push)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(old)
    assert errors == []
    assert sorted(taken) == list(range(len(lookups))) and len(lane) == 0


def test_the_seeded_scheduler_imports_no_pykka():
    code = "import sys, kvactors.testing.scheduler, kvactors.testing.explore; assert 'pykka' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_stop_names_a_timer_thread_it_leaves_behind_and_keeps_its_budget():
    """Issue 15 item 4: the timer thread's join used to time out silently, after 5 s whatever the budget."""
    entered, release = threading.Event(), threading.Event()

    class StuckRef:
        name = "stuck"

        def tell(self, message: object) -> None:
            entered.set()
            release.wait(30)

    runtime = ThreadRuntime("stopper")
    runtime.call_later(0.0, StuckRef(), "x")  # type: ignore[arg-type]
    assert entered.wait(10)
    try:
        started = time.monotonic()
        left = runtime.stop([], 0.2)
        assert time.monotonic() - started < 3
        assert left == ["stopper-timer"]
    finally:
        release.set()
