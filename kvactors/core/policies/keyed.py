"""A policy that orders keys, seen by the pool through its rows."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence

from kvactors.core.policies.base import EvictionPolicy
from kvactors.types import OffloadKey


class KeyedRowPolicy:
    """The :class:`~kvactors.core.policies.base.RowPolicy` over an
    :class:`~kvactors.core.policies.base.EvictionPolicy` that keeps its own map of keys (ARC).

    Each row is turned into the key at it, and the key policy is called once per key, in
    the order of the rows. It sees the calls a pool working by key would make, less
    those it ignores (the use or discard of a key it does not track).
    Not thread-safe: it lives inside its pool.
    """

    __slots__ = ("_key_of", "_row_of", "policy")

    peeks = False  # a victim changes ARC's ghost lists and target: it cannot be asked ahead

    def __init__(self, policy: EvictionPolicy, row_of: Callable[[OffloadKey], int | None],
                 key_of: Sequence[OffloadKey | None]) -> None:
        self.policy = policy
        """The key policy adapted (tests read what it saw)."""
        self._row_of = row_of
        self._key_of = key_of

    def add_row(self, row: int) -> None:
        key = self._key_of[row]
        if key not in self.policy:
            self.policy.add(key)  # type: ignore[arg-type]  # a row the pool adds holds its key

    def discard_row(self, row: int) -> None:
        self.policy.discard(self._key_of[row])  # type: ignore[arg-type]  # a row the pool discards holds its key

    def add_rows(self, rows: Iterable[int]) -> None:
        policy, key_of = self.policy, self._key_of
        for row in rows:
            key = key_of[row]
            if key not in policy:
                policy.add(key)  # type: ignore[arg-type]  # a row the pool adds holds its key

    def discard_rows(self, rows: Iterable[int]) -> None:
        discard, key_of = self.policy.discard, self._key_of
        for row in rows:
            discard(key_of[row])  # type: ignore[arg-type]  # a row the pool discards holds its key

    def access_rows(self, rows: Iterable[int]) -> None:
        access, key_of = self.policy.access, self._key_of
        for row in rows:
            access(key_of[row])  # type: ignore[arg-type]  # a row the pool uses holds its key

    def take_victims(self, count: int, spare: Collection[int]) -> list[int]:
        key_of, row_of, victim = self._key_of, self._row_of, self.policy.victim
        exclude = frozenset([key_of[row] for row in spare])
        taken: list[int] = []
        while len(taken) < count:
            key = victim(exclude)  # type: ignore[arg-type]  # no None: spared rows are tracked
            if key is None:
                break
            row = row_of(key)
            assert row is not None, "the policy tracks indexed keys only"
            taken.append(row)
        return taken

    def peek_victims(self, count: int, spare: Collection[int]) -> list[int]:
        return []

    def has_row(self, row: int) -> bool:
        key = self._key_of[row]
        # A detached row keeps its key, which may be tracked again at a new row.
        return key is not None and self._row_of(key) == row and key in self.policy

    def __len__(self) -> int:
        return len(self.policy)

    def snapshot(self) -> tuple[object, ...]:
        return self.policy.snapshot()

    def check(self) -> None:
        """Nothing of its own to check: the pool checks which keys the key policy tracks."""
