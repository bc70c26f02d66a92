"""Blocks kept for the request that waits for them: which keys each attempt holds, until when.

A request that waits for promotions (blocks coming back from a secondary
tier) must find, once they are ready, both them and the ready blocks before
them still in the pool: otherwise other requests' promotions and stores evict
them first, the request promotes them again, and under pool pressure the pool
thrashes while nobody loads anything (issue 26: 14,250 promotions for 12
loads). So the primary *reserves* those blocks for the requester, with a pin
of the requester's own (:func:`reservation_owner`), until the first of:

* the requester pins the key for a load (``prepare_load``): its load pin
  takes over the protection;
* the requester finishes (``on_request_finished``), or the cache is reset;
* the reservation's deadline passes (the lookup deadline): a request that
  never comes back for its blocks cannot keep them from everyone else.

A reservation is granted whole, at one moment (the lookup that starts the
promotions, then each promotion as it ends), and never waits for more room:
a promotion the pool cannot hold now is not started and its key is a miss.
So no request holds part of the pool while waiting for another part, and
the pool cannot deadlock on partial grants.

This book only records who holds which key until when; the pins themselves
live in the :class:`~kvactors.core.pool.BlockPool`. Plain data, no threads:
one book lives inside one actor.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvactors.core.deadlines import DeadlineQueue
from kvactors.core.pool_types import Identity, PinOwner
from kvactors.types import OffloadKey


def reservation_owner(identity: Identity) -> PinOwner:
    """The pool pin owner of ``identity``'s reservations: apart from its load pins."""
    return (identity[0], identity[1], "reserved")


class Reservations:
    """The keys reserved for each request attempt, and each attempt's deadline.

    One deadline per attempt, moved later by each grant of a key it did not
    hold: the blocks of one request are wanted together, so they are kept
    together.
    """

    __slots__ = ("_deadlines", "_keys")

    def __init__(self) -> None:
        self._keys: dict[Identity, set[OffloadKey]] = {}
        self._deadlines: DeadlineQueue[Identity] = DeadlineQueue()

    def __len__(self) -> int:
        """Keys reserved, over every attempt. O(attempts holding some)."""
        return sum(len(keys) for keys in self._keys.values())

    def __bool__(self) -> bool:
        """Whether any attempt holds a reservation. O(1): asked on every load."""
        return bool(self._keys)

    def held_by(self, identity: Identity) -> frozenset[OffloadKey]:
        return frozenset(self._keys.get(identity, ()))

    def grant(self, identity: Identity, keys: Iterable[OffloadKey], deadline: float) -> list[OffloadKey]:
        """Reserve ``keys`` for ``identity`` until ``deadline``; the keys it did not hold
        already (each key is reserved at most once per attempt), in order."""
        mine = self._keys.setdefault(identity, set())
        new = [key for key in dict.fromkeys(keys) if key not in mine]
        if new:
            mine.update(new)
            self._deadlines.add(identity, deadline)
        elif not mine:
            del self._keys[identity]
        return new

    def release(self, identity: Identity, keys: Iterable[OffloadKey]) -> list[OffloadKey]:
        """End the reservations of ``keys`` that ``identity`` holds; those keys, in order."""
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
        """End every reservation of ``identity``; its keys."""
        self._deadlines.discard(identity)
        return sorted(self._keys.pop(identity, ()))

    def expire(self, now: float) -> list[tuple[Identity, list[OffloadKey]]]:
        """End the reservations whose deadline is ``<= now``: ``(identity, keys)`` each."""
        return [(identity, sorted(self._keys.pop(identity, ()))) for identity in self._deadlines.pop_expired(now)]

    def clear(self) -> list[tuple[Identity, list[OffloadKey]]]:
        """End every reservation: ``(identity, keys)`` each."""
        ended = [(identity, sorted(keys)) for identity, keys in self._keys.items()]
        self._keys.clear()
        self._deadlines.clear()
        return ended

    def next_deadline(self) -> float | None:
        return self._deadlines.next_deadline()
