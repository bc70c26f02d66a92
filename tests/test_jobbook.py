"""The job book alone: every transition, report routing, and a hypothesis state machine."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvactors.core.jobbook import JobBook, Route, Step
from kvactors.types import JobResult, ReqContext, TransferJob

CTX = ReqContext("r")
K1, K2 = b"k1", b"k2"


def job(job_id: int, promotion: bool = False, keys: tuple[bytes, ...] = (K1, K2), ctx: ReqContext = CTX) -> TransferJob:
    return TransferJob(job_id, keys, tuple(range(len(keys))), ctx, promotion)


def book(cap: int = 1, timeout_s: float = 1.0, **kwargs) -> JobBook:  # type: ignore[no-untyped-def]
    return JobBook([("a", cap), ("b", cap)], timeout_s, **kwargs)


def steps(pairs) -> list[tuple[Step, int]]:  # type: ignore[no-untyped-def]
    return [(step, entry.job_id) for step, entry in pairs]


def test_a_job_starts_while_a_slot_is_free_and_queues_behind_a_full_tier() -> None:
    b = book(cap=1)
    assert steps([b.add("a", job(1), 1, 0, 0.0)]) == [(Step.STARTED, 1)]
    assert steps([b.add("a", job(2), 2, 0, 0.0)]) == [(Step.QUEUED, 2)]
    assert steps([b.add("b", job(3), 3, 0, 0.0)]) == [(Step.STARTED, 3)]  # per tier
    assert (b.in_flight("a"), b.queued("a"), b.in_flight(), b.queued()) == (1, 1, 2, 1)
    entry = b.get(2)
    assert entry is not None and entry.waited and not entry.submitted
    assert b.in_flight_ids() == {1, 3} and b.oldest_origin() == 1


def test_a_freed_slot_goes_to_the_head_of_the_queue_and_nothing_overtakes_it() -> None:
    b = book(cap=1)
    b.add("a", job(1), 1, 0, 0.0)
    b.add("a", job(2), 2, 0, 0.0)
    b.add("a", job(3), 3, 0, 0.0)
    report = b.report("a", JobResult(1, True), 0.5)
    assert report.route is Route.ENDED and steps(report.steps) == [(Step.STARTED, 2)]
    assert b.queue("a") == (3,)
    entry = b.get(2)
    assert entry is not None and entry.submitted and entry.submitted_at == 0.5


def test_a_promotion_runs_its_deadline_from_booking_a_cascade_from_its_submit() -> None:
    b = book(cap=1, timeout_s=1.0)
    b.add("a", job(1), 1, 0, 0.0)  # a cascade in flight until 1.0
    _, promo = b.add("a", job(2, promotion=True), 2, 0, 0.2)  # queued; deadline 1.2
    _, cascade = b.add("a", job(3), 3, 0, 0.3)  # queued; no deadline while queued
    assert promo.deadline == pytest.approx(1.2) and cascade.deadline is None
    assert b.next_deadline() == pytest.approx(1.0)
    assert steps(b.expire(1.0)) == [(Step.TIMED_OUT, 1), (Step.STARTED, 2)]
    assert b.next_deadline() == pytest.approx(1.2)  # the promotion keeps its booking's deadline
    assert steps(b.expire(1.2)) == [(Step.TIMED_OUT, 2), (Step.STARTED, 3)]
    assert b.next_deadline() == pytest.approx(2.2)  # the cascade's runs from its submit


def test_queued_promotions_expire_before_a_timed_out_job_frees_its_slot() -> None:
    b = book(cap=1, timeout_s=1.0)
    b.add("a", job(1, promotion=True), 1, 0, 0.0)
    b.add("a", job(2, promotion=True), 2, 0, 0.0)  # same deadline, queued
    b.add("a", job(3), 3, 0, 0.5)
    assert steps(b.expire(1.0)) == [(Step.EXPIRED, 2), (Step.TIMED_OUT, 1), (Step.STARTED, 3)]
    assert b.is_held(1) and b.get(2) is None and b.queue("a") == ()


def test_a_freed_slot_skips_a_queued_promotion_past_its_deadline_whose_tick_is_late() -> None:
    b = book(cap=1, timeout_s=1.0)
    b.add("a", job(1), 1, 0, 0.9)
    b.add("a", job(2, promotion=True), 2, 0, 0.0)  # due at 1.0
    b.add("a", job(3), 3, 0, 0.0)
    report = b.report("a", JobResult(1, True), 1.5)  # before any tick at 1.0
    assert steps(report.steps) == [(Step.EXPIRED, 2), (Step.STARTED, 3)]
    assert b.expire(1.5) == []  # its deadline went with it: it is not timed out a second time


def test_a_job_of_a_request_not_live_is_refused_and_frees_nothing() -> None:
    dead: set[ReqContext] = set()
    b = book(cap=1, live=lambda ctx: ctx not in dead)
    other = ReqContext("o")
    b.add("a", job(1), 1, 0, 0.0)
    b.add("a", job(2, ctx=other), 2, 0, 0.0)
    b.add("a", job(3), 3, 0, 0.0)
    dead.add(other)
    assert steps(b.report("a", JobResult(1, True), 0.1).steps) == [(Step.REFUSED, 2), (Step.STARTED, 3)]
    assert steps([b.add("b", job(4, ctx=other), 4, 0, 0.1)]) == [(Step.REFUSED, 4)]
    assert b.get(2) is None and b.get(4) is None and b.in_flight("b") == 0


def test_reports_are_routed_late_duplicate_unknown_foreign_and_queued() -> None:
    b = book(cap=1)
    b.add("a", job(1), 1, 0, 0.0)
    b.add("a", job(2), 2, 0, 0.0)  # queued
    assert b.report("a", JobResult(2, True), 0.1).route is Route.UNEXPECTED  # not sent yet
    assert b.report("a", JobResult(99, True), 0.1).route is Route.UNEXPECTED  # unknown
    assert b.report("b", JobResult(1, True), 0.1).route is Route.UNEXPECTED  # another tier's word
    for garbage in (True, 1.0, [1], None, "1"):  # True == 1.0 == 1, a list is unhashable
        assert b.report("a", JobResult(garbage, True), 0.1).route is Route.UNEXPECTED  # type: ignore[arg-type]
    assert b.in_flight("a") == 1 and b.queue("a") == (2,)  # those changed nothing
    ended = b.report("a", JobResult(1, True, successful_keys=(K1, b"stranger")), 0.2)
    assert ended.route is Route.ENDED and ended.outcomes is not None
    assert ended.outcomes.problem is not None and ended.outcomes.failed == (K1, K2)  # a foreign key fails all
    assert b.report("a", JobResult(1, True), 0.3).route is Route.UNEXPECTED  # a duplicate
    b.expire(2.0)  # job 2 times out, held
    assert b.report("b", JobResult(2, True), 2.1).route is Route.UNEXPECTED  # another tier: still held
    assert b.is_held(2)
    late = b.report("a", JobResult(2, True), 2.2)
    assert late.route is Route.LATE and late.job is not None and late.job.job_id == 2 and not b.is_held(2)
    assert b.report("a", JobResult(2, True), 2.3).route is Route.UNEXPECTED  # a second late report


def test_partial_report_reads_per_key() -> None:
    b = book()
    b.add("a", job(1, promotion=True), 1, 0, 0.0)
    report = b.report("a", JobResult(1, True, successful_keys=(K2,)), 0.1)
    assert report.outcomes is not None and report.outcomes.ok == (K2,) and report.outcomes.failed == (K1,)


def test_dropped_queued_jobs_leave_with_their_deadlines() -> None:
    b = book(cap=1)
    b.add("a", job(1), 1, 0, 0.0)
    b.add("a", job(2, promotion=True), 2, 0, 0.0)
    b.add("b", job(3), 3, 0, 0.0)
    b.add("b", job(4), 4, 0, 0.0)
    assert [e.job_id for e in b.drop_queued(("a",))] == [2]
    assert [e.job_id for e in b.drop_queued()] == [4]
    assert b.queued() == 0 and steps(b.expire(5.0)) == [(Step.TIMED_OUT, 1), (Step.TIMED_OUT, 3)]


def test_time_out_all_holds_every_job_in_flight() -> None:
    b = book(cap=2)
    b.add("a", job(1), 1, 0, 0.0)
    b.add("b", job(2), 2, 0, 0.0)
    assert steps(b.time_out_all(0.1)) == [(Step.TIMED_OUT, 1), (Step.TIMED_OUT, 2)]
    assert b.in_flight() == 0 and sorted(e.job_id for e in b.held()) == [1, 2] and b.next_deadline() is None


def test_bad_input_raises_and_changes_nothing() -> None:
    with pytest.raises(ValueError):
        JobBook([("a", 1)], 0.0)
    with pytest.raises(ValueError):
        JobBook([("a", 0)], 1.0)
    b = book()
    b.add("a", job(1), 1, 0, 0.0)
    with pytest.raises(ValueError):
        b.add("zz", job(2), 2, 0, 0.0)
    with pytest.raises(ValueError):
        b.add("b", job(1), 1, 0, 0.0)  # already booked
    assert b.in_flight() == 1 and b.queued() == 0 and b.in_flight("b") == 0


# ------------------------------------------------------------ the state machine

TIERS = (("a", 1), ("b", 2))
TIMEOUT = 1.0


class JobBookMachine(RuleBasedStateMachine):
    """Random bookings, reports (right, wrong tier, unknown, duplicate, late), clock steps,
    drops and stops against a model: per tier a FIFO of queued ids and a set in flight,
    the held set, each job's deadline. After every operation the book's steps equal the
    model's; after each step a job is in exactly one place, caps hold, a tier with a
    queue has every slot busy, and no job in flight or queued is past a deadline once
    the clock was read; every job ends once (one terminal step; a late report only after
    a timeout, once)."""

    def __init__(self) -> None:
        super().__init__()
        self.dead: set[ReqContext] = set()
        self.book = JobBook(TIERS, TIMEOUT, live=lambda ctx: ctx not in self.dead)
        self.now = 0.0
        self.next_id = 1
        self.cap = dict(TIERS)
        self.m_queue: dict[str, list[int]] = {tier: [] for tier, _ in TIERS}
        self.m_flight: dict[str, set[int]] = {tier: set() for tier, _ in TIERS}
        self.m_held: set[int] = set()
        self.m_done: set[int] = set()
        self.m_tier: dict[int, str] = {}
        self.m_deadline: dict[int, float | None] = {}
        self.m_promo: dict[int, bool] = {}
        self.m_ctx: dict[int, ReqContext] = {}
        self.ends: dict[int, list[str]] = {}  # terminal steps and late reports seen per job

    # The model's own transitions, returning the steps it expects.
    def _m_start(self, job_id: int) -> tuple[Step, int]:
        if self.m_ctx[job_id] in self.dead:
            self.m_done.add(job_id)
            self.ends.setdefault(job_id, []).append("refused")
            return Step.REFUSED, job_id
        self.m_flight[self.m_tier[job_id]].add(job_id)
        if self.m_deadline[job_id] is None:
            self.m_deadline[job_id] = self.now + TIMEOUT
        return Step.STARTED, job_id

    def _m_pump(self, tier: str) -> list[tuple[Step, int]]:
        out = []
        while self.m_queue[tier] and len(self.m_flight[tier]) < self.cap[tier]:
            job_id = self.m_queue[tier].pop(0)
            deadline = self.m_deadline[job_id]
            if deadline is not None and deadline <= self.now:
                self.m_done.add(job_id)
                self.ends.setdefault(job_id, []).append("expired")
                out.append((Step.EXPIRED, job_id))
            else:
                out.append(self._m_start(job_id))
        return out

    def _m_time_out(self, job_id: int) -> list[tuple[Step, int]]:
        tier = self.m_tier[job_id]
        self.m_flight[tier].discard(job_id)
        self.m_held.add(job_id)
        self.ends.setdefault(job_id, []).append("timed_out")
        return [(Step.TIMED_OUT, job_id), *self._m_pump(tier)]

    def _known(self) -> list[int]:
        return sorted(self.m_tier)

    @rule(tier=st.sampled_from([t for t, _ in TIERS]), promotion=st.booleans(), req=st.sampled_from(["r", "s"]))
    def add(self, tier: str, promotion: bool, req: str) -> None:
        job_id = self.next_id
        self.next_id += 1
        ctx = ReqContext(req)
        self.m_tier[job_id], self.m_promo[job_id], self.m_ctx[job_id] = tier, promotion, ctx
        self.m_deadline[job_id] = self.now + TIMEOUT if promotion else None
        got = steps([self.book.add(tier, job(job_id, promotion, ctx=ctx), job_id, 0, self.now)])
        if len(self.m_flight[tier]) < self.cap[tier] and not self.m_queue[tier]:
            expected = [self._m_start(job_id)]
        else:
            self.m_queue[tier].append(job_id)
            expected = [(Step.QUEUED, job_id)]
        assert got == expected

    @rule(dt=st.sampled_from([0.0, 0.3, 0.6, 1.0, 2.5]))
    def tick(self, dt: float) -> None:
        self.now += dt
        got = steps(self.book.expire(self.now))
        expected: list[tuple[Step, int]] = []
        due = [j for tier in self.m_queue for j in self.m_queue[tier] + sorted(self.m_flight[tier])
               if (d := self.m_deadline[j]) is not None and d <= self.now]
        for job_id in due:
            tier = self.m_tier[job_id]
            if job_id in self.m_queue[tier]:
                self.m_queue[tier].remove(job_id)
                self.m_done.add(job_id)
                self.ends.setdefault(job_id, []).append("expired")
                expected.append((Step.EXPIRED, job_id))
        for job_id in due:
            if job_id in self.m_flight[self.m_tier[job_id]]:
                expected.extend(self._m_time_out(job_id))
        # Equal deadlines leave in the heap's order, not the model's: compare as multisets,
        # and every expiry of a queued job comes before the first timeout.
        assert Counter(got) == Counter(expected)
        kinds = [step for step, _ in got]
        assert Step.EXPIRED not in kinds[kinds.index(Step.TIMED_OUT):] if Step.TIMED_OUT in kinds else True

    @rule(data=st.data(), wrong_tier=st.booleans(), ok=st.booleans())
    def report(self, data: st.DataObject, wrong_tier: bool, ok: bool) -> None:
        job_id = data.draw(st.sampled_from([*self._known(), 999]), label="job")
        tier = self.m_tier.get(job_id, "a")
        if wrong_tier:
            tier = "b" if tier == "a" else "a"
        report = self.book.report(tier, JobResult(job_id, ok), self.now)
        right = job_id in self.m_tier and tier == self.m_tier[job_id]
        if right and job_id in self.m_flight[tier]:
            self.m_flight[tier].discard(job_id)
            self.m_done.add(job_id)
            self.ends.setdefault(job_id, []).append("ended")
            assert report.route is Route.ENDED and report.outcomes is not None
            assert report.outcomes.all_ok is ok
            assert steps(report.steps) == self._m_pump(tier)
        elif right and job_id in self.m_held:
            self.m_held.discard(job_id)
            self.m_done.add(job_id)
            self.ends[job_id].append("late")
            assert report.route is Route.LATE and report.steps == ()
        else:
            assert report.route is Route.UNEXPECTED and report.job is None

    @rule(tier=st.sampled_from([None, "a", "b"]))
    def drop_queued(self, tier: str | None) -> None:
        tiers = [t for t, _ in TIERS] if tier is None else [tier]
        expected = [j for t in tiers for j in self.m_queue[t]]
        assert [e.job_id for e in self.book.drop_queued(None if tier is None else (tier,))] == expected
        for t in tiers:
            self.m_queue[t].clear()
        for job_id in expected:
            self.m_done.add(job_id)
            self.ends.setdefault(job_id, []).append("dropped")

    @precondition(lambda self: any(self.m_flight.values()))
    @rule()
    def time_out_all(self) -> None:
        got = steps(self.book.time_out_all(self.now))
        order = [job_id for step, job_id in got if step is Step.TIMED_OUT]
        assert sorted(order) == sorted(set().union(*self.m_flight.values()))
        expected = []
        for job_id in order:  # each one's freed slot is given before the next times out
            expected.extend(self._m_time_out(job_id))
        assert got == expected

    @rule(req=st.sampled_from(["r", "s"]))
    def request_gone(self, req: str) -> None:
        self.dead.add(ReqContext(req))

    @invariant()
    def each_job_in_exactly_one_place(self) -> None:
        queued = {j for t in self.m_queue for j in self.book.queue(t)}
        flying = self.book.in_flight_ids()
        held = {e.job_id for e in self.book.held()}
        booked = {e.job_id for e in self.book.jobs()}
        assert booked == queued | flying and not queued & flying
        assert not held & booked
        done = set(self.m_tier) - booked - held
        assert done == self.m_done
        for tier in self.m_queue:
            assert list(self.book.queue(tier)) == self.m_queue[tier]
            assert {j for j in flying if self.m_tier[j] == tier} == self.m_flight[tier]
        assert held == self.m_held

    @invariant()
    def caps_hold_and_a_queue_means_every_slot_busy(self) -> None:
        for tier, cap in TIERS:
            assert self.book.in_flight(tier) <= cap
            if self.book.queued(tier):
                assert self.book.in_flight(tier) == cap

    @invariant()
    def every_job_ends_once(self) -> None:
        for job_id, ends in self.ends.items():
            terminal = [e for e in ends if e != "late"]
            assert len(terminal) == 1, (job_id, ends)
            assert ends.count("late") <= 1 and (ends.count("late") == 0 or terminal == ["timed_out"])

    @invariant()
    def no_deadline_passes_unseen(self) -> None:
        # Every deadline the clock passed ended in a report or a timeout (expire ran at every tick).
        for entry in self.book.jobs():
            if entry.submitted:
                assert self.m_deadline[entry.job_id] is not None
                assert self.m_deadline[entry.job_id] > self.now  # type: ignore[operator]
            elif entry.deadline is not None:
                assert entry.deadline > self.now


TestJobBookMachine = JobBookMachine.TestCase
TestJobBookMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
