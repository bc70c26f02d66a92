"""The mailbox explored by seed: a clean run, and planted bugs of the mailbox and the claims found.

Each planted bug is switched on with ``monkeypatch`` (test-only) in the one
:class:`~kvactors.actors.mailbox.Mailbox` both runtimes use; the mailbox
explorer (and, where the manager's workload reaches it, the main explorer)
must find it within a bounded number of seeds, and a failing seed replays.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvactors.actors import mailbox
from kvactors.actors.mailbox import CLAIMER, Mailbox
from kvactors.actors.runtime import Actor
from kvactors.testing.mailbox_explore import explore_mailbox, explore_mailbox_one

SEEDS = 300


def claim_ignoring_the_owner(self: Mailbox) -> bool:
    """A claim granted while the actor's thread owns the mailbox (only closed and the turn checked)."""
    with self.lock:
        if self.closed or not self.turn.acquire(blocking=False):
            return False
        self.owner = CLAIMER
        return True


def follow_running_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """The claimer handles what was told meanwhile, and leaves it for the thread too."""

    def twice(self: Mailbox, actor: Actor, message: object, until: Callable[[], bool] | None = None) -> None:
        try:
            self.deliver(actor, message)
            for item in list(self.pending):
                self.deliver(*item)
        finally:
            self.end_claim()

    monkeypatch.setattr(Mailbox, "run_claimed", twice)


def end_claim_dropping_when_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Closed while claimed: what waited for the claimer is dropped, not handled (with the
    claimer following nothing, what it leaves all reaches ``end_claim``)."""
    end_claim = Mailbox.end_claim

    def dropping(self: Mailbox) -> None:
        with self.lock:
            if self.closed:
                self.pending.clear()
        end_claim(self)

    monkeypatch.setattr(Mailbox, "end_claim", dropping)
    monkeypatch.setattr(mailbox, "CLAIM_FOLLOW_LIMIT", 0)


def follow_dropping_when_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Closed while claimed: the claimer stops following and drops what was told meanwhile."""
    run_claimed = Mailbox.run_claimed

    def dropping(self: Mailbox, actor: Actor, message: object, until: Callable[[], bool] | None = None) -> None:
        def stop() -> bool:
            if self.closed:
                with self.lock:
                    self.pending.clear()
                return True
            return until is not None and until()

        run_claimed(self, actor, message, stop)

    monkeypatch.setattr(Mailbox, "run_claimed", dropping)


def _hunt(needle: str, min_fraction: float) -> None:
    report = explore_mailbox(range(SEEDS))
    found = {seed: v for seed, v in report.failures.items() if any(needle in text for text in v)}
    print(f"\nplanted bug found by {len(found)}/{report.runs} seeds; first: {next(iter(found.items()), None)}")
    assert len(found) / report.runs >= min_fraction, report.failures
    seed = next(iter(found))
    assert explore_mailbox_one(seed) == found[seed]  # replays


@pytest.mark.parametrize("follow_limit", [0, 1, mailbox.CLAIM_FOLLOW_LIMIT])
def test_mailbox_exploration_finds_no_violation(monkeypatch: pytest.MonkeyPatch, follow_limit: int) -> None:
    monkeypatch.setattr(mailbox, "CLAIM_FOLLOW_LIMIT", follow_limit)  # what a claimer leaves to end_claim
    report = explore_mailbox(range(2000))
    assert report.runs == 2000 and not report.failures, report.failures


def test_planted_claim_while_the_thread_owns_the_mailbox(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Mailbox, "claim", claim_ignoring_the_owner)
    _hunt("out of order", 0.05)


def test_planted_message_run_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    follow_running_twice(monkeypatch)
    _hunt("handled twice", 0.05)


def test_planted_close_while_claimed_losing_a_message(monkeypatch: pytest.MonkeyPatch) -> None:
    end_claim_dropping_when_closed(monkeypatch)
    _hunt("lost", 0.01)


def test_planted_follow_dropping_what_waited_when_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    follow_dropping_when_closed(monkeypatch)
    _hunt("lost", 0.01)
