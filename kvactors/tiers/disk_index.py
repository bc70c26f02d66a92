"""The index of a :class:`~kvactors.tiers.disk.DiskTier`: keys, files, LRU order, bytes, pins.

Each key lives in one slot of one file; a file holds one or more slots (a group file)
or exactly one (a ``KVA2`` block file of an older version). Recency is per key; a file's
bytes are counted from the moment it is reserved until its last live key leaves the
index, when it is unlinked. Slots whose key left (dropped, or stored by another job
first) are dead: they still count, until their file goes. So eviction for room takes
whole files, least recent keys first: a key whose file would stay frees nothing.

A plain class: no threads, no locks. Not thread-safe: the tier calls it under its lock.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from kvactors.types import OffloadKey


class NoRoomError(RuntimeError):
    """No room for a file: it is larger than the capacity, or every key that could go is pinned."""


@dataclass(slots=True, eq=False)
class DiskFile:
    """One file of the tier. ``head`` is a group file's head and table (a reader checks that the
    file still begins with it); empty for a ``KVA2`` block file (``legacy``)."""

    name: str
    size: int
    block_bytes: int
    head: bytes = b""
    legacy: bool = False
    live: int = field(default=0)  # keys of the index in this file


@dataclass(frozen=True, slots=True)
class Slot:
    """Where a key's payload is: its file, the payload's offset, the XXH3-64 of key and payload
    (0 for a ``KVA2`` file, whose record carries its own)."""

    file: DiskFile
    offset: int
    checksum: int


Entry = tuple[OffloadKey, int, int]
"""``(key, payload offset, checksum)``: one slot of a file being added."""


class DiskIndex:
    """Keys -> slots in LRU order (least recent first), the bytes of the files, the pins.

    ``unlink(name)`` is called for each file whose last key leaves, at that moment, and says
    whether the file is gone; its bytes stop counting only then. A file that could not be
    removed (EBUSY, EPERM, ...) keeps counting and is tried again before the next eviction,
    so the files on disk never exceed ``capacity``, which bounds ``used + reserved``.
    """

    def __init__(self, capacity: int, unlink: Callable[[str], bool]) -> None:
        self.capacity = capacity
        self._unlink = unlink
        self._slots: collections.OrderedDict[OffloadKey, Slot] = collections.OrderedDict()
        self._pins: collections.Counter[OffloadKey] = collections.Counter()
        self.used = 0  # bytes of the files that hold keys of the index, or could not be removed
        self.reserved = 0  # bytes of files being written
        self._stuck: list[tuple[str, int]] = []  # (name, bytes) of files without keys still on disk

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, key: object) -> bool:
        return key in self._slots

    def get(self, key: OffloadKey) -> Slot | None:
        return self._slots.get(key)

    def touch(self, key: OffloadKey) -> bool:
        """Make ``key`` the most recent; whether it is present."""
        if key in self._slots:
            self._slots.move_to_end(key)
            return True
        return False

    def files(self) -> Iterator[DiskFile]:
        """Each file of the index once."""
        return iter({id(s.file): s.file for s in self._slots.values()}.values())

    # -------------------------------------------------------------- changes

    def add(self, file: DiskFile, entries: Iterable[Entry], *, reserved: int = 0,
            replace: bool = False) -> list[OffloadKey]:
        """Index ``file`` with the keys of ``entries`` (the most recent, in order); the keys indexed.

        A key already present keeps its slot (``replace=False``: another job stored it first)
        or moves here (``replace=True``: a restart, files oldest first). ``reserved`` bytes
        leave the reservation. With no key indexed, nothing else changes (the caller removes
        the file); otherwise the file's size is counted.
        """
        added: list[OffloadKey] = []
        for key, offset, checksum in entries:
            if key in self._slots:
                if not replace:
                    continue
                self.remove(key)
            self._slots[key] = Slot(file, offset, checksum)
            file.live += 1
            added.append(key)
        if added:
            self.reserved -= reserved
            self.used += file.size
        return added

    def remove(self, key: OffloadKey) -> bool:
        """Take ``key`` out; unlink its file if it was the last key there. Whether it was present."""
        slot = self._slots.pop(key, None)
        if slot is None:
            return False
        slot.file.live -= 1
        if slot.file.live == 0:
            self._drop_file(slot.file.name, slot.file.size)
        return True

    def _drop_file(self, name: str, size: int) -> None:
        if self._unlink(name):
            self.used -= size
        else:
            self._stuck.append((name, size))

    def abandon(self, name: str, size: int) -> None:
        """A reserved file that will not be indexed (its write failed, or another job won):
        its reservation ends, and its bytes count until it is gone from the disk."""
        self.reserved -= size
        self.used += size
        self._drop_file(name, size)

    @property
    def stuck_files(self) -> int:
        """Files without keys that could not be removed yet (their bytes still count)."""
        return len(self._stuck)

    def _retry_stuck(self) -> None:
        stuck, self._stuck = self._stuck, []
        for name, size in stuck:
            self._drop_file(name, size)

    def remove_files(self, pred: Callable[[DiskFile], bool]) -> list[OffloadKey]:
        """Take out every key whose file matches ``pred`` (the files are unlinked); those keys."""
        keys = [k for k, s in self._slots.items() if pred(s.file)]
        for key in keys:
            self.remove(key)
        return keys

    def reserve(self, size: int, evicted: list[OffloadKey]) -> None:
        """Count ``size`` more bytes, evicting first (appended to ``evicted``) the keys of the
        files that free the room: least recent first, a file once every live key in it is
        unpinned and less recent than the room needs. A key whose file would stay on disk
        frees nothing, so it is never evicted for room. ``NoRoomError`` (nothing evicted by
        this call, unless an unlink failed midway) when even all those files do not free it."""
        if size > self.capacity:
            raise NoRoomError(f"file of {size} bytes exceeds capacity_bytes={self.capacity}")
        if self._stuck and self.used + self.reserved + size > self.capacity:
            self._retry_stuck()
        while (need := self.used + self.reserved + size - self.capacity) > 0:
            victims = self._victims(need)
            if victims is None:
                raise NoRoomError(
                    f"no room: {self.reserved} bytes being written, and the blocks not being read "
                    f"free too few whole files"
                )
            for key in victims:  # an unlink that fails leaves its bytes counted: plan again
                self.remove(key)
                evicted.append(key)
        self.reserved += size

    def _victims(self, need: int) -> list[OffloadKey] | None:
        """The keys, in LRU order, of the least recent whole files (no key pinned) that free
        ``need`` bytes; None if all such files together free less."""
        left: dict[int, int] = {}  # id(file) -> its live keys not walked yet
        walked: list[tuple[OffloadKey, int]] = []
        freed: set[int] = set()
        room = 0
        for key, slot in self._slots.items():
            if key in self._pins:
                continue
            file = slot.file
            fid = id(file)
            left[fid] = n = left.get(fid, file.live) - 1
            walked.append((key, fid))
            if n == 0:
                freed.add(fid)
                room += file.size
                if room >= need:
                    return [key for key, fid in walked if fid in freed]
        return None

    def release(self, size: int) -> None:
        """Give back a reservation whose file was not indexed (and is gone from the disk)."""
        self.reserved -= size

    def shrink(self) -> list[OffloadKey]:
        """Evict whole files, least recent keys first, until the files fit the capacity (a
        restart with a smaller one); the keys evicted."""
        need = self.used + self.reserved - self.capacity
        if need <= 0:
            return []
        victims = self._victims(need) or [k for k in self._slots if k not in self._pins]
        for key in victims:
            self.remove(key)
        return victims

    # -------------------------------------------------------------- pins

    def pin(self, keys: Iterable[OffloadKey]) -> None:
        """Protect ``keys`` from eviction (counted: each pin needs one unpin)."""
        self._pins.update(keys)

    def unpin(self, keys: Iterable[OffloadKey]) -> None:
        for key in keys:
            n = self._pins[key] - 1
            if n > 0:
                self._pins[key] = n
            else:
                del self._pins[key]

    def pinned(self, key: OffloadKey) -> bool:
        return key in self._pins
