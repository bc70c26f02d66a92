"""Explore the mailbox itself: senders that claim or tell, a colocated guest, a stop at any moment.

:func:`explore` (``explore.py``) drives the whole runtime through the manager.
It stops the runtime only once every client is done.
This module explores what that cannot reach, on the same :class:`~kvactors.actors.mailbox.Mailbox`
and :class:`~kvactors.testing.SimRuntime`.
That is a stop (``close``) that lands while a caller holds a claim,
while the actor's thread owns the mailbox, or while messages wait.

Per seed, a few client threads each send numbered messages the way the manager does.
They claim the idle actor and run the message here, or they tell it.
They pause between messages.
Now and then the host's handler tells a colocated guest.
That is a message put during a claim, as the primary tells the supervisor.
A task stops the host at a seed-chosen step.

The check runs once everything settled.

* Every message accepted was handled exactly once.
  A message is accepted when it was told without ``ActorStoppedError``, or claimed.
* Each sender's messages were handled in the order sent.
* No two handlers ran at once.
* No handler ran after ``on_stop``.
* ``on_stop`` ran once per actor.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvactors.actors.runtime import Actor, ActorStoppedError, handles
from kvactors.testing.scheduler import SimActorRef, SimRuntime, SimulationStuck


@dataclass(frozen=True, slots=True)
class _Msg:
    sender: int
    seq: int


@dataclass
class _Book:
    """What the actors saw, shared by the two."""

    running: int = 0
    handled: list[tuple[str, int, int]] = field(default_factory=list)
    stopped: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)


class _Recorder(Actor):
    def __init__(self, name: str, book: _Book, guest: SimActorRef | None = None, every: int = 3) -> None:
        self.name = name
        self.book = book
        self.guest = guest
        self.every = every
        self.forwarded: list[tuple[int, int]] = []

    @handles(_Msg)
    def _on_msg(self, msg: _Msg) -> None:
        book = self.book
        book.running += 1
        if book.running > 1:
            book.violations.append(f"{self.name}: two handlers at once ({msg})")
        if self.name in book.stopped:
            book.violations.append(f"{self.name}: {msg} handled after on_stop")
        book.handled.append((self.name, msg.sender, msg.seq))
        if self.guest is not None and msg.seq % self.every == 0:
            try:
                self.guest.tell(msg)
                self.forwarded.append((msg.sender, msg.seq))
            except ActorStoppedError:
                pass
        book.running -= 1

    def on_stop(self) -> None:
        if self.name in self.book.stopped:
            self.book.violations.append(f"{self.name}: on_stop twice")
        self.book.stopped.append(self.name)


def _sender(runtime: SimRuntime, ref: SimActorRef, index: int, count: int,
            accepted: list[tuple[int, int]]) -> None:
    for seq in range(count):
        msg = _Msg(index, seq)
        if ref.claim():
            accepted.append((index, seq))
            ref.run_claimed(msg)
        else:
            try:
                ref.tell(msg)
            except ActorStoppedError:
                return  # stopped: every later send is refused too
            accepted.append((index, seq))
        runtime.checkpoint()


def explore_mailbox_one(seed: int, *, trace: bool = False) -> list[str]:
    """Run one seed. Returns the violations found, empty when there are none."""
    rng = random.Random(f"mailbox/{seed}")
    runtime = SimRuntime(seed, time_jump_chance=0.0, claim_chance=rng.choice((0.3, 0.7, 1.0)), trace=trace)
    book = _Book()
    host = runtime.new_ref("host")
    guest = runtime.new_ref("guest", colocate_with=host)
    host_actor = _Recorder("host", book, guest)
    runtime.start(host, host_actor)
    runtime.start(guest, _Recorder("guest", book))
    accepted: list[tuple[int, int]] = []
    for index in range(rng.randint(1, 4)):
        count = rng.randint(1, 6)
        runtime.spawn_client(f"sender{index}", functools.partial(_sender, runtime, host, index, count, accepted))
    stop_after = rng.randint(0, 30)

    def stop() -> None:
        runtime.stop([host], None)

    out: list[str] = []
    try:
        for _ in range(stop_after):
            if not runtime.step():
                break
        runtime.defer("stop", stop)
        runtime.run(max_steps=10_000)
    except SimulationStuck as exc:
        out.append(f"stuck: {exc}")
    finally:
        runtime.close()
    out.extend(book.violations)
    out.extend(_check(book, accepted, host_actor.forwarded))
    return out


def _check(book: _Book, accepted: list[tuple[int, int]], forwarded: list[tuple[int, int]]) -> list[str]:
    out = []
    for name, expected in (("host", accepted), ("guest", forwarded)):
        handled = [(sender, seq) for actor, sender, seq in book.handled if actor == name]
        if sorted(handled) != sorted(expected):
            lost = sorted(set(expected) - set(handled))
            twice = sorted({item for item in handled if handled.count(item) > 1})
            extra = sorted(set(handled) - set(expected))
            out.append(f"{name}: accepted messages lost {lost[:5]}, handled twice {twice[:5]}, "
                       f"never accepted {extra[:5]}")
        for sender in {s for s, _ in handled}:
            seqs = [seq for s, seq in handled if s == sender]
            if seqs != sorted(seqs):
                out.append(f"{name}: sender {sender}'s messages out of order: {seqs}")
    if sorted(book.stopped) != ["guest", "host"]:
        out.append(f"on_stop ran for {book.stopped}, not once for each of host and guest")
    return out


@dataclass
class MailboxReport:
    runs: int
    failures: dict[int, list[str]]


def explore_mailbox(seeds: Iterable[int]) -> MailboxReport:
    """Run :func:`explore_mailbox_one` for every seed.

    Returns the failing seeds, with what they found.
    """
    failures = {}
    runs = 0
    for seed in seeds:
        runs += 1
        found = explore_mailbox_one(seed)
        if found:
            failures[seed] = found
    return MailboxReport(runs, failures)
