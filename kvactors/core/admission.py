"""Admission to the secondary tiers: which ready blocks of the pool go to a tier, and when.

Plain values and one bounded table, with no threads, as they live in the primary's actor.

* :class:`Admission` is one tier's policy, parsed from the config by :func:`parse_admission`.

  - ``"write_through"`` admits every block once it is stored.
  - ``{"min_seen": N}`` admits a block once lookups of at least ``N`` distinct requests asked for it.
    The attempts of one request count once.
  - ``"write_back"`` admits a block when the pool is about to evict it.

* :class:`SeenTable` holds the distinct requests that asked for each key, for ``min_seen``.
  It is a bounded LRU (:func:`seen_table_size`), so its memory never grows with the traffic.
  A key that falls out of it starts again from zero.
  It may then be admitted later, or written twice.
  That costs only bytes, never lost data.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from kvactors.types import OffloadKey

AdmissionMode = Literal["write_through", "min_seen", "write_back"]

SEEN_TABLE_MIN = 4_096
SEEN_TABLE_MAX = 262_144


@dataclass(frozen=True, slots=True)
class Admission:
    """One tier's admission policy. ``min_seen`` is ``N`` for ``mode == "min_seen"``, else 1."""

    mode: AdmissionMode = "write_through"
    min_seen: int = 1

    def __post_init__(self) -> None:
        if self.mode not in ("write_through", "min_seen", "write_back"):
            raise ValueError(f"unknown admission mode {self.mode!r}")
        if not isinstance(self.min_seen, int) or isinstance(self.min_seen, bool) or self.min_seen < 1:
            raise ValueError(f"min_seen must be an int >= 1, got {self.min_seen!r}")

    @property
    def on_store(self) -> bool:
        """Whether a block goes to the tier when its store completes (it may have been seen enough)."""
        return self.mode != "write_back"

    def config(self) -> str | dict[str, int]:
        """The config value this policy was parsed from (its canonical form)."""
        return {"min_seen": self.min_seen} if self.mode == "min_seen" else self.mode


WRITE_THROUGH = Admission()
WRITE_BACK = Admission("write_back")


def parse_admission(value: Any, where: str = "admission") -> Admission:
    """An :class:`Admission` from ``"write_through"``, ``"write_back"``, ``{"min_seen": N}`` or an :class:`Admission`.

    ``N`` is an int >= 1.
    ``{"min_seen": 1}`` is write-through.
    A bad value raises ``ValueError`` naming ``where``.
    A value of the wrong type raises ``TypeError``.
    """
    if isinstance(value, Admission):
        return value
    if isinstance(value, str):
        if value == "write_through":
            return WRITE_THROUGH
        if value == "write_back":
            return WRITE_BACK
        raise ValueError(f"{where}: unknown admission {value!r}; use 'write_through', 'write_back' "
                         "or {'min_seen': N}")
    if isinstance(value, Mapping):
        if set(value) != {"min_seen"}:
            raise ValueError(f"{where}: an admission mapping has exactly one key, 'min_seen'; got {sorted(value)!r}")
        n = value["min_seen"]
        if not isinstance(n, int) or isinstance(n, bool):
            raise TypeError(f"{where}.min_seen must be an int, got {type(n).__name__}")
        if n < 1:
            raise ValueError(f"{where}.min_seen must be >= 1, got {n}")
        return WRITE_THROUGH if n == 1 else Admission("min_seen", n)
    raise TypeError(f"{where} must be 'write_through', 'write_back' or {{'min_seen': N}}, "
                    f"got {type(value).__name__}")


def seen_table_size(num_blocks: int) -> int:
    """Entries of the seen-count table for a pool of ``num_blocks``.

    That is 4 per block, within [:data:`SEEN_TABLE_MIN`, :data:`SEEN_TABLE_MAX`].
    """
    return max(SEEN_TABLE_MIN, min(SEEN_TABLE_MAX, 4 * num_blocks))


class SeenTable:
    """How many distinct requests asked for each key (up to ``cap``), for the latest ``size`` keys.

    ``see(keys, req_id)`` records one request's lookup.
    The attempts of one request have the same ``req_id`` and count once.
    Counts stop growing at ``cap``, the largest ``min_seen`` of the tiers.
    So no entry holds more than ``cap`` request ids.
    ``mark(key, tier)`` remembers that a key went to a tier, so that it is not sent twice while its entry lives.

    Not thread-safe: one table lives inside one actor.
    """

    __slots__ = ("_entries", "cap", "size")

    def __init__(self, size: int, cap: int) -> None:
        if size < 1 or cap < 1:
            raise ValueError("size and cap must be >= 1")
        self.size = size
        self.cap = cap
        # key -> [request ids that asked (at most cap), tiers it was sent to]
        self._entries: OrderedDict[OffloadKey, tuple[set[str], set[str]]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def _entry(self, key: OffloadKey) -> tuple[set[str], set[str]]:
        entries = self._entries
        entry = entries.get(key)
        if entry is None:
            entry = entries[key] = (set(), set())
            if len(entries) > self.size:
                entries.popitem(last=False)
        else:
            entries.move_to_end(key)
        return entry

    def see(self, keys: Iterable[OffloadKey], req_id: str) -> list[tuple[OffloadKey, int]]:
        """Record that ``req_id`` asked for ``keys``.

        Returns each key's count after it, in order, each key once.
        """
        counts = []
        for key in dict.fromkeys(keys):
            seen = self._entry(key)[0]
            if len(seen) < self.cap:
                seen.add(req_id)
            counts.append((key, len(seen)))
        return counts

    def count(self, key: OffloadKey) -> int:
        """The distinct requests that asked for ``key``, or 0 if it is not in the table.

        Recency does not change.
        """
        entry = self._entries.get(key)
        return 0 if entry is None else len(entry[0])

    def sent(self, key: OffloadKey, tier: str) -> bool:
        entry = self._entries.get(key)
        return entry is not None and tier in entry[1]

    def mark(self, key: OffloadKey, tier: str) -> None:
        """Record that ``key`` went to ``tier``.

        It is a no-op for a key not in the table.
        Such a key is not sent again unless it is asked for again, which adds it.
        """
        entry = self._entries.get(key)
        if entry is not None:
            entry[1].add(tier)

    def clear(self) -> None:
        self._entries.clear()
