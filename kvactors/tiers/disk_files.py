"""The ``KVA2`` block files of :class:`~kvactors.tiers.disk.DiskTier`, and its shared file helpers.

Versions before group files (:mod:`kvactors.tiers.disk_group`) wrote one file per block.
The file is named after its key: ``<key hex>.kvb``, or ``h-<blake2b of key>.kvb`` when
the hex name would be too long.
It holds one record of :mod:`kvactors.tiers.codec` (header, key, payload, XXH3-64 checksum).
A tier still finds and reads them, so a directory survives an upgrade.
It no longer writes them.
Files appear under their final name only once complete (temporary file plus ``os.replace``).
So a crash leaves either the whole file or a ``.tmp-*`` file.
The next tier opening the directory deletes such a file.

Plain functions on file descriptors and paths, with no state and no locks. Thread-safe.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat

from kvactors.tiers import codec
from kvactors.types import OffloadKey

SUFFIX = ".kvb"
"""Suffix of ``KVA2`` block files; files with neither it nor the group suffix are left alone."""
TMP_PREFIX = ".tmp-"
"""Prefix of files being written; leftovers are deleted when a tier opens the directory."""
MAX_NAME_CHARS = 200
"""Longest file name used; longer hex names are replaced by a hash (the record keeps the key)."""

O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
O_DIRECT = getattr(os, "O_DIRECT", 0)
# Without it, opening a FIFO put where a file was would wait for a writer, for ever.
_OPEN_READ = os.O_RDONLY | O_CLOEXEC | O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0)


class DiskTierError(RuntimeError):
    """A job of a :class:`~kvactors.tiers.disk.DiskTier` could not be done (the message says why)."""


def file_name(key: OffloadKey) -> str:
    """The name of the file that holds ``key``, made of the hex of the key or a hash of it.

    Only ``[0-9a-f]`` and ``h-`` appear, so no key can steer the path out of
    the tier's directory.
    """
    name = key.hex() + SUFFIX
    if len(name) > MAX_NAME_CHARS:
        name = "h-" + hashlib.blake2b(key, digest_size=32).hexdigest() + SUFFIX
    return name


def describe(exc: BaseException) -> str:
    """A one-line error for a JobResult. For OS errors it names the errno and the file."""
    if isinstance(exc, OSError) and exc.errno is not None:
        code = errno.errorcode.get(exc.errno, str(exc.errno))
        where = f": {exc.filename}" if exc.filename else ""
        return f"{type(exc).__name__} [{code}] {exc.strerror}{where}"
    return f"{type(exc).__name__}: {exc}"


def open_to_read(path: str) -> int:
    """A descriptor of the regular file ``path``, opened to read. Never waits.

    A symlink (``O_NOFOLLOW``), a FIFO, a device or a socket where a tier file was is an ``OSError``.
    Once opened, such a file raises ``EINVAL``, as an unreadable file does.
    It is never a wait or a read of something else.
    The caller fails what it meant to read from it.
    """
    fd = os.open(path, _OPEN_READ)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, f"not a regular file (mode {stat.filemode(mode)})", path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_key(path: str, fname: str, size: int) -> OffloadKey | None:
    """The key of the block file ``path`` (named ``fname``, ``size`` bytes) if its header,
    name and size agree, else None. Raises ``OSError``/``CorruptRecordError`` if unreadable."""
    fd = open_to_read(path)
    try:
        head = os.pread(fd, codec.HEADER_SIZE, 0)
        key_len, payload_len = codec.decode_header(head)
        key = os.pread(fd, key_len, codec.HEADER_SIZE)
    finally:
        os.close(fd)
    if len(key) != key_len or size != codec.HEADER_SIZE + key_len + payload_len:
        return None
    if file_name(key) != fname:
        return None
    return key


def read_record_into(path: str, key: OffloadKey, head: memoryview, row: memoryview) -> None:
    """Read ``key``'s record at ``path`` into ``row`` and ``head``, and verify it.

    ``row`` takes the payload.
    ``head`` is a scratch buffer of ``HEADER_SIZE + len(key) + 1`` bytes.
    The payload goes straight into the pool row and is checked there, with no bounce buffer.
    A failed check fails the job, whose rows the runtime then discards.
    The spare byte of ``head`` tells a long file without an fstat.
    Raises ``CorruptRecordError`` if the record is bad.
    """
    block_bytes = row.nbytes
    head_size = codec.HEADER_SIZE + len(key)
    expected = head_size + block_bytes
    fd = open_to_read(path)
    try:
        got = _read_full(fd, [head[:head_size], row, head[head_size:]], expected)
        if got != expected:
            raise codec.CorruptRecordError(f"file is {got}{'+' if got > expected else ''} bytes, "
                                           f"expected {expected}")
        codec.verify_split(head[:head_size], row, key, block_bytes)
    finally:
        os.close(fd)


def fsync_dir(root: str) -> None:
    """Make the directory's entries (new names) durable."""
    fd = os.open(root, os.O_RDONLY | O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_full(fd: int, bufs: list[memoryview], need: int) -> int:
    """Read ``fd`` into ``bufs`` until at least ``need`` bytes came or the file ends. Returns the bytes read.

    It takes one ``readv`` when the file holds ``need`` bytes.
    A spare buffer beyond ``need`` catches a longer file without a second call to find the end.
    """
    got = os.readv(fd, bufs)
    while got < need:
        # Short read: go on from where it stopped, one buffer at a time.
        skip = got
        rest: list[memoryview] = []
        for b in bufs:
            if skip >= b.nbytes:
                skip -= b.nbytes
            else:
                rest.append(b[skip:])
                skip = 0
        n = os.readv(fd, rest)
        if n == 0:
            break
        got += n
    return got
