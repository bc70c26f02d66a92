"""Reading the files of a :class:`~kvactors.tiers.disk.DiskTier`.

It scans the directory at a restart.
It reads blocks into pool rows, from group files and ``KVA2`` block files.

Plain functions, with no state and no locks. Thread-safe.
Errors come back as one-line reasons per key, as a ``JobResult`` says them, never as torn data.
A key is reported good only once its bytes, in its row, matched its checksum.
"""

from __future__ import annotations

import errno
import fcntl
import os
from collections.abc import Callable, Sequence
from typing import NamedTuple

from kvactors.tiers import codec
from kvactors.tiers.disk_files import O_DIRECT, SUFFIX, TMP_PREFIX, describe, open_to_read, read_key, read_record_into
from kvactors.tiers.disk_group import GROUP_SUFFIX, key_checksum, read_run, read_table
from kvactors.tiers.disk_index import DiskFile, Entry, Slot
from kvactors.types import OffloadKey

VERIFY_BYTES = 2 << 20
"""A load reads at most this many bytes per ``preadv`` (at least one block), and verifies them at once.

The bytes are then still in the core's cache.
Each ``preadv`` gives up the GIL and takes it back, which the tier's other workers contend for.
So reads are fewer and larger (docs/performance.md).
"""


Item = tuple[int, Slot, OffloadKey, memoryview]
"""One key to load: its position in the job, its slot, the key, the view of its row."""


class Scan(NamedTuple):
    """What a restart found in the tier's directory."""

    files: list[tuple[DiskFile, list[Entry]]]
    """The valid files, oldest first."""
    discarded: int
    """Bad files unlinked, or tried (see ``undeleted``). Temporary ones are not counted."""
    unreadable: list[int]
    """The sizes of files that could not be read (0 where even the size could not be)."""
    undeleted: list[tuple[str, int]]
    """``(name, bytes)`` of bad or temporary files whose unlink failed (to retry; they count)."""


def scan(root: str, unlink: Callable[[str], bool]) -> Scan:
    """What is in ``root``. ``unlink(name)`` removes a file and says whether it is gone.

    Temporary files, left by a crash mid-write, are unlinked.
    So are files of the tier's suffixes that are not valid.
    Such a file is a group table that fails its checksum or disagrees with the file's size,
    or a ``KVA2`` record whose name, header or size disagree.
    A file that cannot be read at all (``EACCES``, ``EIO``) says nothing of its content.
    It is left alone, unindexed, and a later restart may read it.
    Other files are left alone.
    """
    found: list[tuple[int, str, DiskFile, list[Entry]]] = []
    unreadable: list[int] = []
    undeleted: list[tuple[str, int]] = []

    def drop(dirent: os.DirEntry[str]) -> None:
        try:
            size = dirent.stat(follow_symlinks=False).st_size
        except OSError:
            size = 0
        if not unlink(dirent.name):
            undeleted.append((dirent.name, size))

    discarded = 0
    with os.scandir(root) as it:
        for dirent in it:
            fname = dirent.name
            if fname.startswith(TMP_PREFIX):
                if dirent.is_file(follow_symlinks=False):
                    drop(dirent)
                continue
            group = fname.endswith(GROUP_SUFFIX)
            if not (group or fname.endswith(SUFFIX)) or not dirent.is_file(follow_symlinks=False):
                continue
            path = os.path.join(root, fname)
            try:
                st = dirent.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # gone meanwhile
            except OSError:
                unreadable.append(0)
                continue
            try:
                opened = _open_group(path, fname) if group else _open_legacy(path, fname, st.st_size)
            except codec.CorruptRecordError:
                opened = None
            except FileNotFoundError:
                continue
            except OSError:
                unreadable.append(st.st_size)
                continue
            if opened is None:
                discarded += 1
                drop(dirent)
                continue
            found.append((st.st_mtime_ns, fname, *opened))
    found.sort(key=lambda item: (item[0], item[1]))
    return Scan([(file, entries) for _, _, file, entries in found], discarded, unreadable, undeleted)


def _open_group(path: str, fname: str) -> tuple[DiskFile, list[Entry]]:
    table = read_table(path)
    file = DiskFile(fname, table.file_size, table.block_bytes, head=table.head_bytes)
    return file, list(zip(table.keys, table.offsets, table.checksums, strict=True))


def _open_legacy(path: str, fname: str, size: int) -> tuple[DiskFile, list[Entry]] | None:
    key = read_key(path, fname, size)
    if key is None:
        return None
    head = codec.HEADER_SIZE + len(key)
    return DiskFile(fname, size, size - head, legacy=True), [(key, head, 0)]


def load_group(path: str, file: DiskFile, items: list[Item], *, direct: bool = False) -> dict[int, str]:
    """Read and verify ``items`` into their rows, with one ``open``. Returns the failed positions and why.

    ``items`` are slots of the group ``file`` at ``path``.
    The file must still begin with the head it was indexed with.
    It must be no longer than it was written.
    A file cut short fails the keys past the cut only.
    With ``direct`` the payloads are read with ``O_DIRECT``, which skips the page cache's copy and page allocation.
    The rows must then start on an ``ALIGN`` boundary in memory and be multiples of ``ALIGN``.
    The head is read through the page cache, where it stays for the file's later loads.
    A file system that refuses ``O_DIRECT`` is read through the page cache.
    """
    try:
        fd = open_to_read(path)
    except (FileNotFoundError, NotADirectoryError) as exc:
        return dict.fromkeys((i for i, *_ in items), f"DiskTierError: file is missing: {describe(exc)}")
    except Exception as exc:
        return dict.fromkeys((i for i, *_ in items), f"DiskTierError: unreadable file {file.name}: {describe(exc)}")
    failed: dict[int, str] = {}
    try:
        size = os.fstat(fd).st_size
        if size > file.size:
            raise codec.CorruptRecordError(f"file is {size} bytes, expected {file.size}")
        if os.pread(fd, len(file.head), 0) != file.head:
            raise codec.CorruptRecordError("its table changed")
        if direct:
            _read_direct(fd)
        items.sort(key=lambda item: item[1].offset)
        step = max(1, VERIFY_BYTES // file.block_bytes)
        run: list[Item] = []
        for item in items:
            if run and (len(run) >= step or item[1].offset != run[-1][1].offset + file.block_bytes):
                _read_verify(fd, file, run, failed)
                run = []
            run.append(item)
        _read_verify(fd, file, run, failed)
    except codec.CorruptRecordError as exc:
        return dict.fromkeys((i for i, *_ in items), f"DiskTierError: corrupt file {file.name}: {exc}")
    except Exception as exc:
        return dict.fromkeys((i for i, *_ in items), f"DiskTierError: unreadable file {file.name}: {describe(exc)}")
    finally:
        os.close(fd)
    return failed


def _read_direct(fd: int) -> None:
    """Switch ``fd`` to ``O_DIRECT`` for the reads that follow, where the file system allows it."""
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | O_DIRECT)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise


def _drop_direct(fd: int) -> bool:
    """Switch ``fd`` back to the page cache. Returns whether it was reading with ``O_DIRECT``."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    if not O_DIRECT or not flags & O_DIRECT:
        return False
    fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~O_DIRECT)
    return True


def _read_verify(fd: int, file: DiskFile, run: Sequence[Item], failed: dict[int, str]) -> None:
    """One ``preadv`` of consecutive slots into their rows, then each key verified in place
    (its row still in the CPU's cache). A read that fails for several keys is retried key
    by key, so that a bad key fails alone."""
    start = run[0][1].offset
    block = file.block_bytes
    try:
        end = start + read_run(fd, start, [view for *_, view in run], len(run) * block)
    except OSError as exc:
        if exc.errno == errno.EINVAL and _drop_direct(fd):  # took the flag, not the read: the page cache then
            _read_verify(fd, file, run, failed)
            return
        if len(run) == 1:
            failed[run[0][0]] = f"DiskTierError: unreadable file {file.name}: {describe(exc)}"
        else:
            for item in run:
                _read_verify(fd, file, [item], failed)
        return
    for i, slot, key, view in run:
        if slot.offset + block > end:
            failed[i] = (f"DiskTierError: corrupt file {file.name}: truncated, file is {end} "
                         f"bytes, expected {file.size}")
        elif key_checksum(key, view) != slot.checksum:
            failed[i] = f"DiskTierError: block {key.hex()[:32]}: corrupt file {file.name}: checksum mismatch"


def load_legacy(path: str, name: str, key: OffloadKey, head: memoryview, row: memoryview) -> str | None:
    """Read and verify the ``KVA2`` record of ``key`` at ``path`` into ``row``. Returns None, or why it failed.

    ``head`` is a scratch buffer of ``HEADER_SIZE + len(key) + 1`` bytes.
    """
    try:
        read_record_into(path, key, head, row)
    except codec.CorruptRecordError as exc:
        return f"DiskTierError: block {key.hex()[:32]}: corrupt file {name}: {exc}"
    except (FileNotFoundError, NotADirectoryError) as exc:
        return f"DiskTierError: block {key.hex()[:32]}: file is missing: {describe(exc)}"
    except Exception as exc:
        return f"DiskTierError: block {key.hex()[:32]}: unreadable file {name}: {describe(exc)}"
    return None
