"""BarrierBook: wait_idle barriers due once no work at or before their snapshot is left (plain class)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvactors.core.barriers import BarrierBook


def test_a_barrier_is_due_once_the_oldest_work_is_past_its_snapshot_and_only_once():
    book: BarrierBook[str] = BarrierBook()
    book.add(5, "b5")
    book.add(9, "b9")
    assert len(book) == 2
    assert book.due(5) == []  # work 5 itself is still in the books
    assert book.due(6) == ["b5"]
    assert book.due(6) == []  # handed out once
    assert book.due(None) == ["b9"]  # no work left: every barrier is due
    assert len(book) == 0 and not book


def test_a_stop_cuts_every_waiting_barrier_short_in_arrival_order():
    book: BarrierBook[str] = BarrierBook()
    for snapshot, reply in [(3, "a"), (1, "b"), (7, "c")]:
        book.add(snapshot, reply)
    assert book.due(2) == ["b"]
    assert book.cut_short() == ["a", "c"]
    assert book.cut_short() == [] and book.due(None) == []


ops = st.lists(st.one_of(st.tuples(st.just("add"), st.integers(0, 20)),
                         st.tuples(st.just("due"), st.none() | st.integers(0, 25)),
                         st.tuples(st.just("cut"), st.none())), max_size=40)


@given(ops)
def test_each_barrier_is_handed_out_exactly_once_when_nothing_at_or_before_it_is_left(steps):
    """Against a model: due means oldest > snapshot (or no work); every barrier leaves once, in order."""
    book: BarrierBook[int] = BarrierBook()
    model: list[tuple[int, int]] = []  # (snapshot, reply) in arrival order
    handed: list[int] = []
    for n, (op, arg) in enumerate(steps):
        if op == "add":
            assert arg is not None
            book.add(arg, n)
            model.append((arg, n))
        elif op == "due":
            expected = [r for s, r in model if arg is None or arg > s]
            got = book.due(arg)
            assert got == expected
            model = [(s, r) for s, r in model if r not in expected]
            handed += got
        else:
            assert book.cut_short() == [r for _, r in model]
            handed += [r for _, r in model]
            model = []
        assert len(book) == len(model)
    assert len(handed) == len(set(handed))
