"""The reservation book (kvactors.core.reservations): who holds which key until when."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvactors.core.reservations import Reservations, reservation_owner

A, B = ("a", 0), ("b", 1)


def test_a_key_is_reserved_once_per_attempt_and_released_once():
    book = Reservations()
    assert book.grant(A, [b"1", b"2", b"1"], 10.0) == [b"1", b"2"]
    assert book.grant(A, [b"2", b"3"], 12.0) == [b"3"]  # only the new one: its pin is taken once
    assert book.grant(A, [b"2"], 99.0) == []  # nothing new: the deadline stays
    assert book.grant(B, [b"1"], 5.0) == [b"1"]  # another attempt reserves on its own
    assert len(book) == 4
    assert book.release(A, [b"1", b"9"]) == [b"1"]
    assert book.release(A, [b"1"]) == []
    assert book.held_by(A) == {b"2", b"3"}
    assert book.release_all(A) == [b"2", b"3"] and book.release_all(A) == []
    assert book.next_deadline() == 5.0


def test_the_deadline_is_the_attempts_latest_grant_and_expiry_ends_all_its_keys():
    book = Reservations()
    book.grant(A, [b"1"], 10.0)
    book.grant(A, [b"2"], 20.0)
    book.grant(B, [b"3"], 15.0)
    assert book.expire(12.0) == []
    assert book.expire(15.0) == [(B, [b"3"])]
    assert book.expire(30.0) == [(A, [b"1", b"2"])]
    assert len(book) == 0 and book.next_deadline() is None


def test_an_empty_grant_holds_nothing_and_arms_no_deadline():
    book = Reservations()
    assert book.grant(A, [], 1.0) == []
    assert book.next_deadline() is None and book.clear() == []


def test_the_pin_owner_of_reservations_is_apart_from_the_requests_own():
    assert reservation_owner(A) != A and reservation_owner(A) != reservation_owner(B)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["grant", "release", "release_all", "expire", "clear"]),
                          st.sampled_from([A, B]), st.lists(st.sampled_from([b"1", b"2", b"3"]), max_size=3),
                          st.integers(0, 20)), max_size=40))
def test_every_reservation_ends_exactly_once(ops):
    """Keys granted minus keys ended is what the book holds, whatever the order of calls."""
    book = Reservations()
    held: dict[tuple[str, int], set[bytes]] = {}
    for op, who, keys, t in ops:
        if op == "grant":
            new = book.grant(who, keys, float(t))
            assert not set(new) & held.get(who, set())
            held.setdefault(who, set()).update(new)
        elif op == "release":
            ended = book.release(who, keys)
            assert set(ended) <= held.get(who, set())
            held.get(who, set()).difference_update(ended)
        elif op == "release_all":
            assert set(book.release_all(who)) == held.pop(who, set())
        elif op == "expire":
            for identity, ended in book.expire(float(t)):
                assert set(ended) == held.pop(identity)
        else:
            for identity, ended in book.clear():
                assert set(ended) == held.pop(identity)
            held.clear()
        assert len(book) == sum(len(keys) for keys in held.values())
        for identity, keys in held.items():
            assert book.held_by(identity) == keys
