"""Group files of :class:`~kvactors.tiers.disk.DiskTier`: the blocks of one store in one file.

Layout (format ``KVA3``, little-endian)::

    head   magic "KVA3" | count u32 | block bytes u32 | data offset u32
    table  count x (payload offset u64 | XXH3-64 of key+payload u64 | key length u16 | key)
    digest XXH3-64 of head and table, u64
    zeros  up to the data offset (a multiple of ALIGN)
    data   count payloads of block bytes each, payload i at data offset + i * block bytes

The file is ``data offset + count * block bytes`` bytes long.
A file of any other length is not a group file.
The payloads start on a page boundary.
So a block whose size is a multiple of the page size maps onto whole page-cache pages.
Each key's checksum covers the key and its payload.
So a key fails on its own bytes, and the others of the file still verify.
A file is written under a temporary name and renamed once complete.

Plain functions on descriptors and paths, with no state and no locks. Thread-safe.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import xxhash

from kvactors.tiers.codec import CorruptRecordError
from kvactors.tiers.codec import checksum as key_checksum  # XXH3-64 of key then payload, as in KVA2
from kvactors.tiers.disk_files import O_CLOEXEC, O_DIRECT, open_to_read
from kvactors.types import OffloadKey

__all__ = ["ALIGN", "ENTRY_BYTES", "GROUP_MAGIC", "GROUP_SUFFIX", "HEAD_BYTES", "MAX_KEYS", "GroupTable", "data_offset",
           "decode_head", "encode_head", "group_size", "key_checksum", "plan_groups", "read_run", "read_table",
           "write_group"]

GROUP_MAGIC = b"KVA3"
GROUP_SUFFIX = ".kvg"
"""Suffix of group files (their names are otherwise arbitrary: the table holds the keys)."""
ALIGN = 4096
"""The data offset is a multiple of this (a page)."""
MAX_KEYS = 1000
"""Keys per file at most: head and payloads go out in one ``writev`` (IOV_MAX is 1024)."""
MAX_HEAD_BYTES = 64 << 20
"""A data offset above this is not believed (a garbage file would make a reader allocate it)."""

_HEAD = struct.Struct("<4sIII")
_ENTRY = struct.Struct("<QQH")
_DIGEST = struct.Struct("<Q")
ENTRY_BYTES = _ENTRY.size
"""Bytes of a table entry, besides its key."""
HEAD_BYTES = _HEAD.size + _DIGEST.size
"""Bytes of a group file's head and digest, besides the table's entries."""


@dataclass(frozen=True, slots=True)
class GroupTable:
    """What a group file's head says: its keys with their payload offsets and checksums."""

    keys: tuple[OffloadKey, ...]
    offsets: tuple[int, ...]
    checksums: tuple[int, ...]
    block_bytes: int
    head_bytes: bytes  # head, table and digest: a reader compares it to find the same file
    file_size: int


def data_offset(keys: Sequence[OffloadKey]) -> int:
    """Where the payloads of a group file of ``keys`` begin."""
    head = HEAD_BYTES + sum(_ENTRY.size + len(k) for k in keys)
    return -(-head // ALIGN) * ALIGN


def group_size(keys: Sequence[OffloadKey], block_bytes: int) -> int:
    """The bytes of a group file holding ``keys`` of ``block_bytes`` each."""
    return data_offset(keys) + len(keys) * block_bytes


def plan_groups(keys: Sequence[OffloadKey], positions: Sequence[int], block_bytes: int,
                capacity: int) -> Iterator[list[int]]:
    """``positions`` (of ``keys``) split, in order, into groups.

    Each group holds at most ``MAX_KEYS`` keys, and its file (:func:`group_size`, exactly) fits ``capacity``.
    A single key may not fit, and its store then fails.
    """
    group: list[int] = []
    head = HEAD_BYTES  # the head, the table and its digest so far
    for i in positions:
        entry = _ENTRY.size + len(keys[i])
        if group and (len(group) >= MAX_KEYS
                      or -(-(head + entry) // ALIGN) * ALIGN + (len(group) + 1) * block_bytes > capacity):
            yield group
            group, head = [], HEAD_BYTES
        group.append(i)
        head += entry
    if group:
        yield group


def encode_head(keys: Sequence[OffloadKey], checksums: Sequence[int], block_bytes: int) -> GroupTable:
    """The head, table and digest of a group file (padding not included)."""
    if not 0 < len(keys) <= MAX_KEYS:
        raise ValueError(f"a group file holds 1 to {MAX_KEYS} keys, got {len(keys)}")
    start = data_offset(keys)
    offsets = tuple(start + i * block_bytes for i in range(len(keys)))
    parts = [_HEAD.pack(GROUP_MAGIC, len(keys), block_bytes, start)]
    for key, off, digest in zip(keys, offsets, checksums, strict=True):
        parts.append(_ENTRY.pack(off, digest, len(key)))
        parts.append(key)
    body = b"".join(parts)
    head = body + _DIGEST.pack(xxhash.xxh3_64_intdigest(body))
    return GroupTable(tuple(keys), offsets, tuple(checksums), block_bytes, head, start + len(keys) * block_bytes)


def decode_head(data: bytes, file_size: int) -> GroupTable:
    """Parse and check a group file's first bytes (at least up to its digest) against its size.

    Raises ``CorruptRecordError`` when the magic, the digest, the offsets or the size disagree.
    """
    if len(data) < _HEAD.size:
        raise CorruptRecordError(f"group head truncated: {len(data)} bytes")
    magic, count, block_bytes, start = _HEAD.unpack_from(data)
    if magic != GROUP_MAGIC:
        raise CorruptRecordError("bad magic")
    if not 0 < count <= MAX_KEYS or block_bytes <= 0 or start % ALIGN:
        raise CorruptRecordError(f"bad group head: {count} keys of {block_bytes} bytes at {start}")
    keys: list[OffloadKey] = []
    offsets: list[int] = []
    checksums: list[int] = []
    pos = _HEAD.size
    for i in range(count):
        if pos + _ENTRY.size > len(data):
            raise CorruptRecordError("group table truncated")
        off, digest, key_len = _ENTRY.unpack_from(data, pos)
        pos += _ENTRY.size
        key = data[pos : pos + key_len]
        pos += key_len
        if len(key) != key_len or off != start + i * block_bytes:
            raise CorruptRecordError("bad group table entry")
        keys.append(key)
        offsets.append(off)
        checksums.append(digest)
    if pos + _DIGEST.size > len(data):
        raise CorruptRecordError("group digest truncated")
    (digest,) = _DIGEST.unpack_from(data, pos)
    if xxhash.xxh3_64_intdigest(data[:pos]) != digest:
        raise CorruptRecordError("group table checksum mismatch")
    if pos + _DIGEST.size > start or len(set(keys)) != count:
        raise CorruptRecordError("bad group table")
    expected = start + count * block_bytes
    if file_size != expected:
        raise CorruptRecordError(f"group file is {file_size} bytes, expected {expected}")
    return GroupTable(tuple(keys), tuple(offsets), tuple(checksums), block_bytes,
                      bytes(data[: pos + _DIGEST.size]), file_size)


def read_table(path: str) -> GroupTable:
    """Read and check the head of the group file at ``path`` (``OSError``/``CorruptRecordError``)."""
    fd = open_to_read(path)
    try:
        size = os.fstat(fd).st_size
        data = os.pread(fd, ALIGN, 0)
        if len(data) >= _HEAD.size:
            start = _HEAD.unpack_from(data)[3]
            if ALIGN < start <= min(size, MAX_HEAD_BYTES):
                data = os.pread(fd, start, 0)
        return decode_head(data, size)
    finally:
        os.close(fd)


def write_group(path: str, table: GroupTable, payloads: Sequence[memoryview], *, fsync: bool,
                direct: bool = False) -> bool:
    """Create ``path``, which must not exist, with mode 0600.

    It holds ``table``'s head, padding, then ``payloads``.
    One ``writev`` writes the head and the payload views.
    The views are the pool rows, so nothing is copied.
    With ``direct`` the file is opened with ``O_DIRECT``.
    The rows then go to the device without a copy into the page cache, which was most of a store's CPU.
    The caller must then pass views that start on an ``ALIGN`` boundary in memory and are multiples of ``ALIGN``.
    A file system that refuses ``O_DIRECT`` (``EINVAL``) gets the same bytes through the page cache.
    Returns whether the file was written with ``O_DIRECT``.
    """
    direct = direct and bool(O_DIRECT)
    start = table.offsets[0]
    head: bytes | mmap.mmap
    if direct:
        head = mmap.mmap(-1, start)  # page-aligned and zero-filled, as O_DIRECT needs
        head[: len(table.head_bytes)] = table.head_bytes
    else:
        head = table.head_bytes + bytes(start - len(table.head_bytes))
    bufs: list[bytes | mmap.mmap | memoryview] = [head, *payloads]
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_CLOEXEC
    try:
        try:
            fd = os.open(path, flags | (O_DIRECT if direct else 0), 0o600)
        except OSError as exc:
            if not (direct and exc.errno == errno.EINVAL):
                raise
            # Some file systems create the file, then refuse O_DIRECT: the name is ours, so no O_EXCL.
            direct = False
            fd = os.open(path, (flags & ~os.O_EXCL) | os.O_TRUNC, 0o600)
        try:
            try:
                _write_all(fd, bufs, table.file_size)
            except OSError as exc:
                if not (direct and exc.errno == errno.EINVAL):
                    raise
                direct = False  # the file system took the open but not the write: the same bytes, buffered
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~O_DIRECT)
                os.lseek(fd, 0, os.SEEK_SET)
                _write_all(fd, bufs, table.file_size)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
    finally:
        if isinstance(head, mmap.mmap):
            head.close()
    return direct


def _write_all(fd: int, bufs: Sequence[bytes | mmap.mmap | memoryview], total: int) -> None:
    """Write ``bufs`` from the start of ``fd``, whose position is 0, ``total`` bytes in all."""
    done = os.writev(fd, bufs)
    while done < total:  # short write (rare on regular files): go on from where it stopped
        n = os.pwritev(fd, _skip(bufs, done), done)
        if n <= 0:
            raise OSError(f"write returned {n}")
        done += n


def _skip(bufs: Sequence[bytes | mmap.mmap | memoryview], skip: int) -> list[memoryview]:
    """``bufs`` without their first ``skip`` bytes."""
    rest: list[memoryview] = []
    for b in bufs:
        view = memoryview(b)
        if skip >= view.nbytes:
            skip -= view.nbytes
        else:
            rest.append(view[skip:])
            skip = 0
    return rest


def read_run(fd: int, offset: int, rows: Sequence[memoryview], need: int) -> int:
    """``preadv`` the payloads at ``offset`` (consecutive slots) into ``rows``. Returns the bytes read.

    ``rows`` take ``need`` bytes in all.
    Fewer than ``need`` means the file ends early, because it was truncated.
    """
    got = os.preadv(fd, rows, offset)
    while 0 < got < need:  # short read: go on, from where it stopped
        try:
            n = os.preadv(fd, _skip(rows, got), offset + got)
        except OSError as exc:
            if exc.errno == errno.EINVAL and got % ALIGN:
                break  # O_DIRECT ended mid-page: the file ends there
            raise
        if n <= 0:
            break
        got += n
    return got
