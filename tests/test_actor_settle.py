"""Actor.settle: what must follow any message runs once after each handler, in one place."""

from __future__ import annotations

from concurrent.futures import Future
from typing import NamedTuple

from kvactors.actors.runtime import Actor, handles


class Ask(NamedTuple):
    reply: Future


class Settling(Actor):
    name = "settling"

    def __init__(self) -> None:
        self.trace: list[str] = []
        self.fail_settle = False

    @handles(int)
    def _on_int(self, value: int) -> None:
        if value < 0:
            raise ValueError("negative")
        self.trace.append(f"handle {value}")

    @handles(Ask)
    def _on_ask(self, msg: Ask) -> None:
        self.trace.append("handle ask")

    def settle(self) -> None:
        self.trace.append("settle")
        if self.fail_settle:
            raise RuntimeError("settle failed")


def test_settle_follows_every_handler_even_a_failed_one():
    """A handler cut short may have brought consequences about (a tick fired its alarm): settle acts on them."""
    actor = Settling()
    actor.deliver(1)
    actor.deliver(-1)  # the handler fails: contained, then settled
    actor.deliver(2)
    assert actor.trace == ["handle 1", "settle", "settle", "handle 2", "settle"]
    assert actor.internal_errors == 1


def test_a_failed_handler_and_a_failed_settle_are_each_counted():
    actor = Settling()
    actor.fail_settle = True
    actor.deliver(-1)
    assert actor.trace == ["settle"] and actor.internal_errors == 2


def test_each_contained_acts_on_every_item_and_counts_each_failure():
    actor = Settling()
    seen: list[int] = []

    def act(value: int) -> None:
        seen.append(value)
        if value % 2:
            raise ValueError("odd")

    assert actor.each_contained(range(5), act, "Tick") == [1, 3]
    assert seen == [0, 1, 2, 3, 4] and actor.internal_errors == 2


def test_a_failed_settle_is_the_handlers_failure():
    actor = Settling()
    actor.fail_settle = True
    actor.deliver(1)
    assert actor.internal_errors == 1
    reply: Future = Future()
    actor.deliver(Ask(reply))  # a message with a reply gets the exception instead
    assert isinstance(reply.exception(0), RuntimeError) and actor.internal_errors == 1


def test_the_base_settle_does_nothing():
    class Plain(Actor):
        @handles(int)
        def _on_int(self, value: int) -> None:
            pass

    actor = Plain()
    actor.deliver(1)
    assert actor.internal_errors == 0
