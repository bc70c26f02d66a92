"""The index of a :class:`~kvactors.tiers.disk.DiskTier`: keys, files, LRU order, bytes, pins.

Each key lives in one slot of one file.
A group file holds one or more slots.
A ``KVA2`` block file of an older version holds exactly one.
A file's bytes are counted from the moment it is reserved until its last live key leaves the index.
The file is unlinked then.
Slots whose key left (dropped, or stored by another job first) are dead.
They still count until their file goes.
So eviction for room takes whole files, because a key whose file would stay frees nothing.
Each file is as recent as its most recent key (stored, loaded, touched or hit).
The files are kept in that order, so the least recent file is found in O(1).

A plain class with no threads and no locks.
It is not thread-safe, so the tier calls it under its lock.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from kvactors.types import OffloadKey


class NoRoomError(RuntimeError):
    """No room for a file.

    Either the file is larger than the capacity, or the files that could go free too little.
    A file can go when none of its keys is pinned.
    """


@dataclass(slots=True, eq=False)
class DiskFile:
    """One file of the tier.

    ``head`` is a group file's head and table, and a reader checks that the file still begins with it.
    It is empty for a ``KVA2`` block file (``legacy``).
    """

    name: str
    size: int
    block_bytes: int
    head: bytes = b""
    legacy: bool = False
    keys: dict[OffloadKey, None] = field(default_factory=dict)  # its keys in the index, in slot order


@dataclass(frozen=True, slots=True)
class Slot:
    """Where a key's payload is: its file, the payload's offset and a checksum.

    The checksum is the XXH3-64 of key and payload.
    It is 0 for a ``KVA2`` file, whose record carries its own.
    """

    file: DiskFile
    offset: int
    checksum: int


Entry = tuple[OffloadKey, int, int]
"""``(key, payload offset, checksum)``: one slot of a file being added."""


class DiskIndex:
    """Keys -> slots, files in LRU order (least recent first), the bytes of the files, the pins.

    ``unlink(name)`` is called for each file whose last key leaves, at that moment.
    It says whether the file is gone, and the file's bytes stop counting only then.
    A file that could not be removed (EBUSY, EPERM, ...) keeps counting.
    It is tried again before the next eviction.
    So the files on disk never exceed ``capacity``, which bounds ``used + reserved``.
    Files the tier keeps but cannot read (:meth:`keep_unreadable`) count too, and are never unlinked.
    """

    def __init__(self, capacity: int, unlink: Callable[[str], bool]) -> None:
        self.capacity = capacity
        self._unlink = unlink
        self._slots: dict[OffloadKey, Slot] = {}
        self._files: collections.OrderedDict[DiskFile, None] = collections.OrderedDict()
        self._pins: collections.Counter[OffloadKey] = collections.Counter()
        self.used = 0  # bytes of the files that hold keys of the index, could not be removed, or cannot be read
        self.reserved = 0  # bytes of files being written
        self._stuck: list[tuple[str, int]] = []  # (name, bytes) of files without keys still on disk
        self.unreadable = 0  # files on disk the tier cannot read (their bytes are in used)

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, key: object) -> bool:
        return key in self._slots

    def get(self, key: OffloadKey) -> Slot | None:
        return self._slots.get(key)

    def touch(self, key: OffloadKey) -> bool:
        """Make ``key``, and so its file, the most recent. Returns whether it is present."""
        slot = self._slots.get(key)
        if slot is None:
            return False
        self._files.move_to_end(slot.file)
        return True

    def files(self) -> Iterator[DiskFile]:
        """Each file of the index once, least recent first."""
        return iter(list(self._files))

    # -------------------------------------------------------------- changes

    def add(self, file: DiskFile, entries: Iterable[Entry], *, reserved: int = 0,
            replace: bool = False) -> list[OffloadKey]:
        """Index ``file`` (the most recent now) with the keys of ``entries``. Returns the keys indexed.

        With ``replace=False``, a key already present keeps its slot, because another job stored it first.
        With ``replace=True``, such a key moves here, as at a restart, which adds files oldest first.
        ``reserved`` bytes leave the reservation.
        With no key indexed, nothing else changes, and the caller removes the file.
        Otherwise the file's size is counted.
        """
        added: list[OffloadKey] = []
        for key, offset, checksum in entries:
            slot = self._slots.get(key)
            if slot is not None:
                if not replace or slot.file is file:  # stored first elsewhere, or twice in this file
                    continue
                self.remove(key)
            self._slots[key] = Slot(file, offset, checksum)
            file.keys[key] = None
            added.append(key)
        if added:
            self.reserved -= reserved
            self.used += file.size
            self._files[file] = None
        return added

    def remove(self, key: OffloadKey) -> bool:
        """Take ``key`` out. Returns whether it was present.

        Its file is unlinked if it was the last key there.
        """
        slot = self._slots.pop(key, None)
        if slot is None:
            return False
        file = slot.file
        del file.keys[key]
        if not file.keys:
            del self._files[file]
            self._drop_file(file.name, file.size)
        return True

    def _drop_file(self, name: str, size: int) -> None:
        if self._unlink(name):
            self.used -= size
        else:
            self._stuck.append((name, size))

    def abandon(self, name: str, size: int) -> None:
        """End the reservation of a reserved file that will not be indexed.

        That happens when its write failed, or another job won.
        Its bytes count until it is gone from the disk.
        """
        self.reserved -= size
        self.used += size
        self._drop_file(name, size)

    def keep_stuck(self, name: str, size: int) -> None:
        """Count a file without keys that could not be removed, such as a restart's bad file.

        It counts until it is gone, and is tried again before the next eviction.
        """
        self.used += size
        self._stuck.append((name, size))

    def keep_unreadable(self, size: int) -> None:
        """Count a file of the tier that cannot be read now, as a restart found it.

        It is left on disk and never unlinked here.
        Its bytes count against the capacity.
        """
        self.unreadable += 1
        self.used += size

    @property
    def stuck_files(self) -> int:
        """Files without keys that could not be removed yet (their bytes still count)."""
        return len(self._stuck)

    def _retry_stuck(self) -> None:
        stuck, self._stuck = self._stuck, []
        for name, size in stuck:
            self._drop_file(name, size)

    def remove_files(self, pred: Callable[[DiskFile], bool]) -> list[OffloadKey]:
        """Take out every key whose file matches ``pred``, and unlink those files. Returns those keys."""
        keys = [key for file in list(self._files) if pred(file) for key in list(file.keys)]
        for key in keys:
            self.remove(key)
        return keys

    def reserve(self, size: int, evicted: list[OffloadKey]) -> None:
        """Count ``size`` more bytes, evicting first (appended to ``evicted``) the keys of the
        least recent files without a pinned key, whole, until they free the room.
        ``NoRoomError``, with nothing evicted by this call (unless an unlink failed midway),
        when even all those files do not free it."""
        if size > self.capacity:
            raise NoRoomError(f"file of {size} bytes exceeds capacity_bytes={self.capacity}")
        if self._stuck and self.used + self.reserved + size > self.capacity:
            self._retry_stuck()
        while (need := self.used + self.reserved + size - self.capacity) > 0:
            victims = self._victims(need)
            if victims is None:
                raise NoRoomError(
                    f"no room: {self.reserved} bytes being written, {self.unreadable} files that cannot "
                    f"be read, and the files without a block being read free too little"
                )
            for file in victims:  # an unlink that fails leaves its bytes counted: plan again
                for key in list(file.keys):
                    self.remove(key)
                    evicted.append(key)
        self.reserved += size

    def _victims(self, need: int) -> list[DiskFile] | None:
        """The least recent files without a pinned key that free ``need`` bytes.

        Returns None if all of them together free less.
        O(files taken + files skipped for a pin).
        """
        victims: list[DiskFile] = []
        room = 0
        pins = self._pins
        for file in self._files:
            if pins and any(key in pins for key in file.keys):
                continue
            victims.append(file)
            room += file.size
            if room >= need:
                return victims
        return None

    def release(self, size: int) -> None:
        """Give back a reservation whose file was not indexed (and is gone from the disk)."""
        self.reserved -= size

    def shrink(self) -> list[OffloadKey]:
        """Evict whole files, least recent first, until the files fit the capacity. Returns the keys evicted.

        A restart with a smaller capacity needs this.
        Files whose unlink failed are tried first.
        """
        evicted: list[OffloadKey] = []
        if self._stuck:
            self._retry_stuck()
        need = self.used + self.reserved - self.capacity
        if need > 0:
            # None: files the tier cannot read or remove hold the room. Evicting every block would
            # not make it, so none is evicted. The blocks still load, and stores fail until room comes back.
            for file in self._victims(need) or ():
                for key in list(file.keys):
                    self.remove(key)
                    evicted.append(key)
        return evicted

    # -------------------------------------------------------------- pins

    def pin(self, keys: Iterable[OffloadKey]) -> None:
        """Protect ``keys`` from eviction. Pins are counted, so each pin needs one unpin."""
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
