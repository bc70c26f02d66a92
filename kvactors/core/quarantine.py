"""Which keys a tier is not asked to promote again for a while.

A tier's lookup may answer ``HIT`` for a key that the tier then fails to load.
The cause may be a file it cannot read, a value it cannot decode, or a job it never reports.
Without a quarantine, the tier would be asked to promote that key on every lookup, forever.
After each failed promotion of a key from a tier, that tier's ``HIT`` for the key is ignored for a back-off.
It is taken as ``MISS``, and another tier may still promote the key.
The back-off doubles with each consecutive failure, from ``base_s`` up to ``max_s``.
A successful promotion of the key from that tier clears it.
At most ``capacity`` pairs are remembered, and the oldest failure is forgotten first.
So the memory is bounded whatever the tiers do.

Not thread-safe: one lives inside the supervisor.
Times are the owner's clock.
"""

from __future__ import annotations

from collections import OrderedDict

from kvactors.types import OffloadKey

BASE_S = 1.0
"""The first back-off after a failed promotion, seconds."""
MAX_S = 300.0
"""The longest back-off, seconds."""
CAPACITY = 16384
"""Pairs (tier, key) remembered at most."""


class PromotionQuarantine:
    """Back-offs per ``(tier, key)`` (see the module docstring)."""

    __slots__ = ("_entries", "base_s", "capacity", "max_s")

    def __init__(self, *, base_s: float = BASE_S, max_s: float = MAX_S, capacity: int = CAPACITY) -> None:
        if not base_s > 0 or not max_s >= base_s:
            raise ValueError(f"need 0 < base_s <= max_s, got base_s={base_s!r}, max_s={max_s!r}")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity!r}")
        self.base_s = base_s
        self.max_s = max_s
        self.capacity = capacity
        # (tier, key) -> (consecutive failures, blocked until); oldest failure first.
        self._entries: OrderedDict[tuple[str, OffloadKey], tuple[int, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __bool__(self) -> bool:
        return bool(self._entries)

    def failed(self, tier: str, key: OffloadKey, now: float) -> float:
        """Block ``key`` at ``tier``, after a promotion of it from there failed.

        Returns the back-off, in seconds.
        """
        pair = (tier, key)
        strikes = self._entries.pop(pair, (0, 0.0))[0] + 1
        backoff = min(self.base_s * 2.0 ** min(strikes - 1, 64), self.max_s)
        self._entries[pair] = (strikes, now + backoff)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        return backoff

    def succeeded(self, tier: str, key: OffloadKey) -> None:
        """Forget the failures of ``key`` at ``tier``, after a promotion of it from there succeeded."""
        self._entries.pop((tier, key), None)

    def blocked(self, tier: str, key: OffloadKey, now: float) -> bool:
        """Whether ``tier`` must not be asked to promote ``key`` now."""
        entry = self._entries.get((tier, key))
        return entry is not None and now < entry[1]

    def strikes(self, tier: str, key: OffloadKey) -> int:
        """Consecutive failed promotions of ``key`` from ``tier`` remembered."""
        entry = self._entries.get((tier, key))
        return 0 if entry is None else entry[0]

    def clear(self) -> None:
        self._entries.clear()
