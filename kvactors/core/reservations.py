"""Blocks kept for the request that waits for them: which keys each attempt holds, until when.

A request may wait for promotions, blocks coming back from a secondary tier.
Once they are ready, it must find both them and the ready blocks before them still in the pool.
Otherwise other requests' promotions and stores evict them first, and the request promotes them again.
Under pool pressure the pool then thrashes while nobody loads anything.
Issue 26 saw 14,250 promotions for 12 loads.
So the primary *reserves* those blocks for the requester,
with a pin of the requester's own (:func:`reservation_owner`).
The reservation lasts until the first of these.

* The requester pins the key for a load (``prepare_load``), and its load pin takes over the protection.
* The requester finishes (``on_request_finished``), or the cache is reset.
* The reservation's deadline (the lookup deadline) passes.
  A request that never comes back for its blocks cannot keep them from everyone else.

A reservation is granted whole, at one moment.
That moment is the lookup that starts the promotions, then each promotion as it ends.
A reservation never waits for more room.
A promotion the pool cannot hold now is not started, and its key is a miss.
So no request holds part of the pool while waiting for another part.
And the pool cannot deadlock on partial grants.

This book only records who holds which key until when.
The pins themselves live in the :class:`~kvactors.core.pool.BlockPool`.
Plain data, with no threads. One book lives inside one actor.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvactors.core.deadlines import DeadlineQueue
from kvactors.core.pool_types import Identity, PinOwner
from kvactors.types import OffloadKey


def reservation_owner(identity: Identity) -> PinOwner:
    """The pool pin owner of ``identity``'s reservations.

    It is apart from the owner of its load pins.
    """
    return (identity[0], identity[1], "reserved")


class Reservations:
    """The keys reserved for each request attempt, and each attempt's deadline.

    There is one deadline per attempt.
    Each grant of a key the attempt did not hold moves it later.
    The blocks of one request are wanted together, so they are kept together.
    """

    __slots__ = ("_deadlines", "_keys")

    def __init__(self) -> None:
        self._keys: dict[Identity, set[OffloadKey]] = {}
        self._deadlines: DeadlineQueue[Identity] = DeadlineQueue()

    def __len__(self) -> int:
        """Keys reserved, over every attempt. O(attempts holding some)."""
        return sum(len(keys) for keys in self._keys.values())

    def __bool__(self) -> bool:
        """Whether any attempt holds a reservation. O(1), as it is asked on every load."""
        return bool(self._keys)

    def held_by(self, identity: Identity) -> frozenset[OffloadKey]:
        return frozenset(self._keys.get(identity, ()))

    def grant(self, identity: Identity, keys: Iterable[OffloadKey], deadline: float) -> list[OffloadKey]:
        """Reserve ``keys`` for ``identity`` until ``deadline``.

        Returns the keys it did not hold already, in order.
        Each key is reserved at most once per attempt.
        """
        mine = self._keys.setdefault(identity, set())
        new = [key for key in dict.fromkeys(keys) if key not in mine]
        if new:
            mine.update(new)
            self._deadlines.add(identity, deadline)
        elif not mine:
            del self._keys[identity]
        return new

    def release(self, identity: Identity, keys: Iterable[OffloadKey]) -> list[OffloadKey]:
        """End the reservations of ``keys`` that ``identity`` holds. Returns those keys, in order."""
        mine = self._keys.get(identity)
        if not mine:
            return []
        ended = [key for key in dict.fromkeys(keys) if key in mine]
        mine.difference_update(ended)
        if not mine:
            del self._keys[identity]
            self._deadlines.discard(identity)
        return ended

    def release_all(self, identity: Identity) -> list[OffloadKey]:
        """End every reservation of ``identity``. Returns its keys."""
        self._deadlines.discard(identity)
        return sorted(self._keys.pop(identity, ()))

    def expire(self, now: float) -> list[tuple[Identity, list[OffloadKey]]]:
        """End the reservations whose deadline is ``<= now``. Returns ``(identity, keys)`` for each."""
        return [(identity, sorted(self._keys.pop(identity, ()))) for identity in self._deadlines.pop_expired(now)]

    def clear(self) -> list[tuple[Identity, list[OffloadKey]]]:
        """End every reservation. Returns ``(identity, keys)`` for each."""
        ended = [(identity, sorted(keys)) for identity, keys in self._keys.items()]
        self._keys.clear()
        self._deadlines.clear()
        return ended

    def next_deadline(self) -> float | None:
        return self._deadlines.next_deadline()
