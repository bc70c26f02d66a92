"""Colocated actors: separate logic and refs, one thread and mailbox."""

from __future__ import annotations

import threading

import pytest

from kvactors.actors.reply import Reply
from kvactors.actors.runtime import Actor, ActorStoppedError, handles
from kvactors.actors.threads import ThreadRuntime
from kvactors.testing import SimRuntime


class Recorder(Actor):
    """Appends (its name, the message, the thread) to a log shared by the test's actors."""

    def __init__(self, name: str, log: list[tuple[str, object, int]]) -> None:
        self.name = name
        self.entries = log
        self.stopped = False

    @handles(int)
    def _on_int(self, value: int) -> None:
        self.entries.append((self.name, value, threading.get_ident()))

    @handles(Reply)
    def _on_reply(self, reply: Reply) -> None:
        reply.set_result(self.name)

    def on_stop(self) -> None:
        self.stopped = True


def ask(ref) -> str:
    reply: Reply[str] = Reply()
    ref.tell(reply)
    assert reply.wait(10)
    return reply.result()


def test_colocated_actors_share_a_thread_and_one_order_and_stop_together():
    runtime = ThreadRuntime()
    log: list[tuple[str, object, int]] = []
    host_actor, guest_actor = Recorder("host", log), Recorder("guest", log)
    host = runtime.spawn(host_actor, "host")
    guest = runtime.spawn(guest_actor, "guest", colocate_with=host)
    def mine() -> set[str]:  # this runtime's threads (other tests' daemon threads may end meanwhile)
        return {t.name for t in threading.enumerate() if t.name.startswith(runtime.name + "-")}

    assert ask(host) == "host"  # the host's thread has started (and named itself)
    log.clear()
    before = mine()
    for n in range(200):
        (host if n % 3 else guest).tell(n)
    assert ask(guest) == "guest"
    assert ask(host) == "host"
    assert mine() == before and len(before) == 2  # the host's thread and the timer: no thread of its own
    assert [value for _, value, _ in log] == list(range(200))  # one order across both
    assert {name for name, value, _ in log if value % 3 == 0} == {"guest"}
    assert len({thread for _, _, thread in log}) == 1

    assert guest.claim()  # the shared turn: while the guest's caller holds it, the host is busy too
    assert not host.claim()
    guest.run_claimed(-1)
    assert log[-1] == ("guest", -1, threading.get_ident())

    runtime.stop([host, guest], 5)
    assert host_actor.stopped and guest_actor.stopped
    with pytest.raises(ActorStoppedError):
        guest.tell(1)


def test_without_colocation_each_actor_has_its_own_thread():
    runtime = ThreadRuntime(colocation=False)
    log: list[tuple[str, object, int]] = []
    host = runtime.spawn(Recorder("host", log), "host")
    guest = runtime.spawn(Recorder("guest", log), "guest", colocate_with=host)
    host.tell(1)
    guest.tell(2)
    ask(host)
    ask(guest)
    assert len({thread for _, _, thread in log}) == 2
    runtime.stop([host, guest], 5)


def test_sim_colocated_actor_uses_its_hosts_inbox():
    runtime = SimRuntime(seed=3, claim_chance=0.0)
    log: list[tuple[str, object, int]] = []
    host = runtime.spawn(Recorder("host", log), "host")
    guest = runtime.spawn(Recorder("guest", log), "guest", colocate_with=host)
    assert runtime.ref("guest") is guest
    host.tell(1)
    guest.tell(2)
    host.tell(3)
    assert guest.mailbox is host.mailbox and len(host.mailbox.pending) == 3
    runtime.run()
    assert [(name, value) for name, value, _ in log] == [("host", 1), ("guest", 2), ("host", 3)]
    runtime.stop([guest], None)  # stopping a guest stops its host too
    assert host.closed and guest.closed
    with pytest.raises(ActorStoppedError):
        guest.tell(4)
