"""The lookup book and the gather book alone: every transition, and a hypothesis state machine."""

from __future__ import annotations

import json

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvactors.core.gathers import GatherBook, GatherKind
from kvactors.core.lookupbook import LookupBook, PendingLookup
from kvactors.types import LookupResult, ReqContext

HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY
CTX = ReqContext("r")
A, B, C = b"a", b"b", b"c"
TIERS = ("t1", "t2")


def begin(book: LookupBook[str], lookup_id: int = 1, keys: tuple[bytes, ...] = (A, B, A),
          skip: tuple[str, ...] = ()) -> PendingLookup[str]:
    return book.begin(lookup_id, CTX, keys, tuple(range(len(keys))), [MISS] * len(keys), f"reply{lookup_id}",
                      skip=skip)


def test_a_lookup_asks_each_key_once_and_resolves_with_its_last_answer() -> None:
    book: LookupBook[str] = LookupBook(TIERS, 1.0)
    pending = begin(book)
    assert pending.asked == (A, B) and pending.waiting == set(TIERS)
    assert pending.answer("t1", (MISS, HIT))  # inline
    assert book.wait(pending, 0.0) == 1.0 and book.is_open(1) and len(book) == 1
    assert book.answered(1, "t1", (HIT, HIT)) is None  # t1 is not waited for any more: ignored
    done = book.answered(1, "t2", (HIT, MISS))
    assert done is pending
    resolution = book.resolve(done)
    assert resolution.plan == {"t2": (A,), "t1": (B,)} and not book.is_open(1)
    assert book.allocating() == (1,) and book.oldest() == 1 and len(book) == 1
    assert book.allocated(1) == CTX and len(book) == 0 and book.oldest() is None
    assert book.answered(1, "t2", (HIT, HIT)) is None  # too late: nothing happens


def test_a_stuck_tier_is_not_waited_for_and_counts_as_failed() -> None:
    book: LookupBook[str] = LookupBook(TIERS, 1.0)
    pending = begin(book, skip=("t2",))
    assert pending.waiting == {"t1"}
    book.wait(pending, 0.0)
    assert book.tier_stuck("t2") == []
    other = begin(book, 2)
    book.wait(other, 0.0)
    assert book.tier_stuck("t1") == [pending]  # its last wait
    assert other.waiting == {"t2"}
    assert pending.answers == {"t2": None, "t1": None} and other.answers == {"t1": None}  # failed
    resolution = book.resolve(pending)
    assert resolution.results == [MISS, MISS, MISS] and resolution.plan == {}


def test_a_lookup_past_its_deadline_expires_once() -> None:
    book: LookupBook[str] = LookupBook(TIERS, 1.0)
    pending = begin(book)
    book.wait(pending, 0.0)
    assert book.next_deadline() == 1.0 and book.expire(0.99) == []
    assert book.expire(1.0) == [pending]
    book.resolve(pending)
    assert book.expire(5.0) == [] and book.next_deadline() is None


def test_a_resolved_lookup_leaves_its_deadline_behind() -> None:
    book: LookupBook[str] = LookupBook(TIERS, 1.0)
    pending = begin(book)
    book.wait(pending, 0.0)
    book.resolve(pending, promote=False)  # a reset
    assert book.expire(2.0) == [] and len(book) == 0


def test_quarantined_hits_are_misses_and_counted() -> None:
    book: LookupBook[str] = LookupBook(TIERS, 1.0)
    pending = begin(book, keys=(A, B))
    pending.answer("t1", (HIT, HIT))
    pending.answer("t2", (HIT, MISS))
    resolution = book.resolve(pending, blocked=lambda tier, key: tier == "t1" and key == A)
    assert resolution.hits_ignored == 1 and resolution.plan == {"t2": (A,), "t1": (B,)}


def test_without_promotion_a_hit_is_retry() -> None:
    book: LookupBook[str] = LookupBook(TIERS, 1.0)
    pending = begin(book, keys=(A, B))
    pending.answer("t1", (HIT, MISS))
    pending.answer("t2", (MISS, MISS))
    resolution = book.resolve(pending, promote=False, blocked=lambda tier, key: True)
    assert resolution.results == [RETRY, MISS] and resolution.plan == {} and resolution.hits_ignored == 0
    assert len(book) == 0


def test_bad_input_raises_and_changes_nothing() -> None:
    with pytest.raises(ValueError):
        LookupBook(TIERS, 0.0)
    book: LookupBook[str] = LookupBook(TIERS, 1.0)
    with pytest.raises(ValueError):
        book.begin(1, CTX, (A,), (3,), [MISS], "r")
    pending = begin(book)
    book.wait(pending, 0.0)
    with pytest.raises(ValueError):
        begin(book)  # its id is in the book
    done = begin(book, 2, skip=TIERS)
    with pytest.raises(ValueError):
        book.wait(done, 0.0)  # waits for nobody: resolve it instead
    assert len(book) == 1 and book.open_lookups() == [pending]


def test_a_gather_ends_once_and_late_payloads_wait_for_the_next() -> None:
    gathers: GatherBook[str] = GatherBook()
    first = gathers.begin(GatherKind.EVENTS, "done1", waiting=TIERS)
    gathers.wait(first, 1.0)
    assert gathers.answered(first.gather_id, "t1", ("e1",)) is None
    assert gathers.tier_stuck("t2") == [first] and first.missing == {"t2"}
    gathers.end(first)
    assert gathers.answered(first.gather_id, "t2", ("late",)) is None  # too late: kept
    patient = gathers.begin(GatherKind.BARRIER, "done2", waiting=TIERS, patient=True)
    gathers.wait(patient, None)
    assert gathers.tier_stuck("t2") == [] and patient.waiting == set(TIERS)  # a patient one waits
    assert gathers.expire(10.0) == [] and len(gathers) == 1
    assert gathers.take_late("t2") == ["late"] and gathers.take_late("t2") == []
    with pytest.raises(ValueError):
        gathers.wait(gathers.begin(GatherKind.EVENTS, "x", waiting=()), 1.0)
    timed = gathers.begin(GatherKind.EVENTS, "done3", waiting=("t1",))
    gathers.wait(timed, 2.0)
    assert gathers.expire(2.0) == [timed]
    assert gathers.end(timed) and timed.missing == {"t1"} and gathers.next_deadline() is None


def test_a_gather_ended_by_an_earlier_ones_callback_is_not_ended_twice() -> None:
    """A stop's gather that expires first ends every open gather from its callback; the
    later entries of the same expire() list are then ended already (a reply set twice)."""
    gathers: GatherBook[str] = GatherBook()
    stop = gathers.begin(GatherKind.SHUTDOWN, "stop", waiting=TIERS)
    events = gathers.begin(GatherKind.EVENTS, "take_events", waiting=TIERS)
    gathers.wait(stop, 1.0)
    gathers.wait(events, 1.5)
    ended: list[str] = []
    for gather in gathers.expire(2.0):
        if not gathers.end(gather):
            continue
        ended.append(gather.on_done)
        if gather is stop:
            for other in gathers.open_gathers():
                assert gathers.end(other)
                ended.append(other.on_done)
    assert ended == ["stop", "take_events"] and len(gathers) == 0
    # A gather that waits for no tier is never open: it is ended at once, once.
    empty = gathers.begin(GatherKind.EVENTS, "no tiers", waiting=())
    assert gathers.end(empty) and not gathers.end(empty)


# ------------------------------------------------------------ the state machine


class LookupBookMachine(RuleBasedStateMachine):
    """Random fan-outs (some tiers stuck, some answering inline), answers (right, late,
    from a tier not waited for), stuck tiers, clock steps, resets and allocations against
    a model: per lookup the tiers it still waits for, and its deadline. After each step
    the book's open lookups equal the model's, none waits for nothing, none is past its
    deadline once the clock was read, and every lookup resolved exactly once."""

    def __init__(self) -> None:
        super().__init__()
        self.book: LookupBook[int] = LookupBook(TIERS, 1.0)
        self.now = 0.0
        self.next_id = 1
        self.m_waiting: dict[int, set[str]] = {}
        self.m_deadline: dict[int, float] = {}
        self.m_allocating: set[int] = set()
        self.resolved: dict[int, int] = {}

    def _resolve(self, pending: PendingLookup[int], promote: bool = True) -> None:
        assert pending.lookup_id in self.m_waiting or pending.lookup_id not in self.resolved
        self.resolved[pending.lookup_id] = self.resolved.get(pending.lookup_id, 0) + 1
        self.m_waiting.pop(pending.lookup_id, None)
        self.m_deadline.pop(pending.lookup_id, None)
        resolution = self.book.resolve(pending, promote=promote)
        assert len(resolution.results) == len(pending.keys)
        assert all(key in pending.asked for keys in resolution.plan.values() for key in keys)
        if resolution.plan:
            assert promote
            self.m_allocating.add(pending.lookup_id)

    @rule(skip=st.sets(st.sampled_from(TIERS)), inline=st.sets(st.sampled_from(TIERS)),
          answer=st.sampled_from([HIT, MISS, RETRY, None]))
    def lookup(self, skip: set[str], inline: set[str], answer: LookupResult | None) -> None:
        lookup_id = self.next_id
        self.next_id += 1
        pending = self.book.begin(lookup_id, CTX, (A, B), (0, 1), [MISS, MISS], lookup_id, skip=skip)
        assert pending.waiting == set(TIERS) - skip
        for tier in sorted(inline - skip):
            assert pending.answer(tier, None if answer is None else (answer, MISS))
        if not pending.waiting:
            self._resolve(pending)
            return
        self.m_waiting[lookup_id] = set(pending.waiting)
        self.m_deadline[lookup_id] = self.book.wait(pending, self.now)
        assert self.m_deadline[lookup_id] == self.now + 1.0

    @rule(data=st.data(), tier=st.sampled_from(TIERS), hit=st.booleans())
    def answered(self, data: st.DataObject, tier: str, hit: bool) -> None:
        lookup_id = data.draw(st.sampled_from([*range(1, self.next_id), 999]), label="lookup")
        before = {p.lookup_id: dict(p.answers) for p in self.book.open_lookups()}
        done = self.book.answered(lookup_id, tier, (HIT if hit else MISS, MISS))
        waiting = self.m_waiting.get(lookup_id)
        if waiting is None or tier not in waiting:  # too late, or not waited for: ignored
            assert {p.lookup_id: p.answers for p in self.book.open_lookups()} == before
        if waiting is not None and tier in waiting and len(waiting) == 1:
            assert done is not None and done.lookup_id == lookup_id
            self._resolve(done)
        else:
            assert done is None
            if waiting is not None:
                waiting.discard(tier)

    @rule(tier=st.sampled_from(TIERS))
    def tier_stuck(self, tier: str) -> None:
        done = self.book.tier_stuck(tier)
        expected = [i for i, waiting in self.m_waiting.items() if waiting == {tier}]
        assert sorted(p.lookup_id for p in done) == sorted(expected)
        for waiting in self.m_waiting.values():
            waiting.discard(tier)
        for pending in done:
            self._resolve(pending)

    @rule(dt=st.sampled_from([0.0, 0.4, 1.0, 3.0]))
    def tick(self, dt: float) -> None:
        self.now += dt
        expired = self.book.expire(self.now)
        expected = [i for i, due in self.m_deadline.items() if due <= self.now]
        assert sorted(p.lookup_id for p in expired) == sorted(expected)
        for pending in expired:
            self._resolve(pending)

    @rule()
    def reset(self) -> None:
        for pending in self.book.open_lookups():
            self._resolve(pending, promote=False)

    @precondition(lambda self: self.m_allocating)
    @rule(data=st.data())
    def allocated(self, data: st.DataObject) -> None:
        lookup_id = data.draw(st.sampled_from(sorted(self.m_allocating)))
        assert self.book.allocated(lookup_id) == CTX
        self.m_allocating.discard(lookup_id)
        assert self.book.allocated(lookup_id) is None

    @invariant()
    def the_book_is_the_model(self) -> None:
        assert {p.lookup_id: p.waiting for p in self.book.open_lookups()} == self.m_waiting
        assert set(self.book.allocating()) == self.m_allocating
        assert len(self.book) == len(self.m_waiting) + len(self.m_allocating)
        in_flight = [*self.m_waiting, *self.m_allocating]
        assert self.book.oldest() == (min(in_flight) if in_flight else None)

    @invariant()
    def no_open_lookup_waits_for_nothing_or_is_overdue(self) -> None:
        for pending in self.book.open_lookups():
            assert pending.waiting
            assert self.m_deadline[pending.lookup_id] > self.now

    @invariant()
    def every_lookup_resolves_once(self) -> None:
        assert all(count == 1 for count in self.resolved.values()), self.resolved
        assert set(self.resolved) | set(self.m_waiting) == set(range(1, self.next_id))
        assert not set(self.resolved) & set(self.m_waiting)


TestLookupBookMachine = LookupBookMachine.TestCase
TestLookupBookMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_a_gather_kind_is_logged_as_its_value() -> None:
    """GatherKind replaced plain strings: the JSON log and the text log still read ``events``."""
    assert json.dumps({"what": GatherKind.EVENTS}) == '{"what": "events"}'
    assert f"what={GatherKind.SHUTDOWN}" == "what=shutdown"
    assert [kind.value for kind in GatherKind] == ["barrier", "events", "shutdown"]
