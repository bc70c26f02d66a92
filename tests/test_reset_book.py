"""ResetBook: reset_cache calls answered once their jobs ended and their round ended (plain class)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvactors.core.resets import ResetBook


def test_a_reset_is_answered_once_its_jobs_and_its_round_are_over_in_either_order():
    book: ResetBook[str] = ResetBook()
    first = book.begin({1, 2}, "r1")
    second = book.begin({2}, "r2")
    assert book.job_over(2) == []  # neither round ended
    assert book.gathered(second) == ["r2"]  # its one job had ended
    assert book.gathered(first) == []  # job 1 is still in flight
    assert book.job_over(3) == []  # a job no reset waits for
    assert book.job_over(1) == ["r1"]
    assert len(book) == 0


def test_a_reset_with_no_job_in_flight_waits_only_for_its_round():
    book: ResetBook[str] = ResetBook()
    wait = book.begin((), "r")
    assert book.job_over(7) == []
    assert book.gathered(wait) == ["r"]


def test_a_stop_stops_waiting_for_jobs_but_not_for_the_round():
    book: ResetBook[str] = ResetBook()
    gathered = book.begin({1}, "gathered")
    waiting = book.begin({2}, "waiting")
    assert book.gathered(gathered) == []
    assert book.cut_short() == ["gathered"]
    assert book.gathered(waiting) == ["waiting"]
    assert len(book) == 0


ops = st.lists(st.one_of(st.tuples(st.just("begin"), st.sets(st.integers(0, 4), max_size=3)),
                         st.tuples(st.just("job_over"), st.integers(0, 4)),
                         st.tuples(st.just("gathered"), st.integers(0, 9)),
                         st.tuples(st.just("cut"), st.none())), max_size=40)


@given(ops)
def test_a_reset_is_answered_exactly_once_and_exactly_when_its_round_and_jobs_are_over(steps):
    book: ResetBook[int] = ResetBook()
    waits = []  # (wait, model jobs, gathered) per reset, by its reply (its index)
    jobs: list[set[int]] = []
    rounds: list[bool] = []
    answered: list[int] = []
    for op, arg in steps:
        if op == "begin":
            assert isinstance(arg, set)
            waits.append(book.begin(arg, len(waits)))
            jobs.append(set(arg))
            rounds.append(False)
            got = []
        elif op == "job_over":
            for model in jobs:
                model.discard(arg)
            got = book.job_over(arg)
        elif op == "gathered":
            if not waits:
                continue
            index = arg % len(waits)
            if index in answered:
                continue  # a round ends once; the owner never reports it after the answer
            rounds[index] = True
            got = book.gathered(waits[index])
        else:
            for model in jobs:
                model.clear()
            got = book.cut_short()
        due = [i for i in range(len(waits)) if i not in answered and rounds[i] and not jobs[i]]
        assert got == due  # in the order the resets began
        answered += got
    assert len(answered) == len(set(answered))
    assert len(book) == len(waits) - len(answered)
