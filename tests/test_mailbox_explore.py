"""The mailbox explored by seed: a clean run, and planted bugs of the mailbox and the claims found.

Each planted bug is switched on with ``monkeypatch`` (test-only) in the one
:class:`~kvactors.actors.mailbox.Mailbox` both runtimes use; the mailbox
explorer (and, where the manager's workload reaches it, the main explorer)
must find it within a bounded number of seeds, and a failing seed replays.
"""

from __future__ import annotations

import pytest

from kvactors.actors.mailbox import CLAIMER, Mailbox
from kvactors.testing.mailbox_explore import explore_mailbox, explore_mailbox_one

SEEDS = 300


def claim_ignoring_the_owner(self: Mailbox) -> bool:
    """A claim granted while the actor's thread owns the mailbox (only closed and the turn checked)."""
    with self.lock:
        if self.closed or not self.turn.acquire(blocking=False):
            return False
        self.owner = CLAIMER
        return True


def end_claim_running_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """The claimer handles what was told meanwhile, and leaves it for the thread too."""
    end_claim = Mailbox.end_claim

    def twice(self: Mailbox) -> None:
        for actor, message in list(self.pending):
            self.deliver(actor, message)
        end_claim(self)

    monkeypatch.setattr(Mailbox, "end_claim", twice)


def end_claim_dropping_when_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Closed while claimed: what waited for the claimer is dropped, not handled."""
    end_claim = Mailbox.end_claim

    def dropping(self: Mailbox) -> None:
        with self.lock:
            if self.closed:
                self.pending.clear()
        end_claim(self)

    monkeypatch.setattr(Mailbox, "end_claim", dropping)


def _hunt(needle: str, min_fraction: float) -> None:
    report = explore_mailbox(range(SEEDS))
    found = {seed: v for seed, v in report.failures.items() if any(needle in text for text in v)}
    print(f"\nplanted bug found by {len(found)}/{report.runs} seeds; first: {next(iter(found.items()), None)}")
    assert len(found) / report.runs >= min_fraction, report.failures
    seed = next(iter(found))
    assert explore_mailbox_one(seed) == found[seed]  # replays


def test_mailbox_exploration_finds_no_violation() -> None:
    report = explore_mailbox(range(2000))
    assert report.runs == 2000 and not report.failures, report.failures


def test_planted_claim_while_the_thread_owns_the_mailbox(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Mailbox, "claim", claim_ignoring_the_owner)
    _hunt("out of order", 0.05)


def test_planted_message_run_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    end_claim_running_twice(monkeypatch)
    _hunt("handled twice", 0.05)


def test_planted_close_while_claimed_losing_a_message(monkeypatch: pytest.MonkeyPatch) -> None:
    end_claim_dropping_when_closed(monkeypatch)
    _hunt("lost", 0.01)
