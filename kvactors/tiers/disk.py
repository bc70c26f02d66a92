"""``DiskTier``: blocks as files in one local directory.

The file layout (one record of :mod:`kvactors.tiers.codec` per block, written
under a temporary name and renamed once complete) is
:mod:`kvactors.tiers.disk_files`. The index (key -> file, LRU order, bytes
used) lives in memory; it is rebuilt from the directory when a tier is
constructed, so blocks survive a restart of the process. Lookups never touch
the disk.

Threading: the tier's methods are called on its actor's thread (or, for its
``inline_calls``, on the thread that sends them), one at a time; the file I/O
runs on the workers of a :class:`~kvactors.tiers.runner.JobRunner`,
concurrently with those methods and with each other. One lock guards the
index, the byte accounting, the pins and the event list; it is held for index
updates and for the cheap metadata calls that must agree with the index
(``os.replace`` of a finished file, ``os.unlink`` of an evicted one), never
for reading or writing block data.
"""

from __future__ import annotations

import collections
import itertools
import os
import threading
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvactors.core.arguments import check_int
from kvactors.logs import component_logger
from kvactors.tiers import codec
from kvactors.tiers.base import ReportFn, SecondaryTier
from kvactors.tiers.disk_files import (
    MAX_NAME_CHARS,
    SUFFIX,
    TMP_PREFIX,
    DiskTierError,
    describe,
    file_name,
    fsync_dir,
    read_key,
    read_record_into,
    write_record,
)
from kvactors.tiers.runner import JobRunner, Outcome, RunningJob
from kvactors.types import LookupResult, OffloadingEvent, OffloadKey, ReqContext, TransferJob

if TYPE_CHECKING:
    from kvactors.logs import EventLogger

__all__ = ["MAX_NAME_CHARS", "SUFFIX", "TMP_PREFIX", "DiskTier", "DiskTierError", "file_name"]

_MIN_CHUNK_BYTES = 4 << 20
"""A job is split across workers in chunks of at least this many record bytes:
below it, the per-chunk overhead costs more than the parallelism wins."""

_SHUTDOWN_DRAIN_S = 1.0
"""How long :meth:`DiskTier.shutdown` lets running and queued jobs finish before cancelling."""


@dataclass(slots=True)
class _Entry:
    name: str
    size: int


class DiskTier(SecondaryTier):
    """A bounded secondary tier in one directory on local disk.

    ``root`` is created if missing (mode 0700); block files are created with
    mode 0600. ``capacity_bytes`` bounds the bytes of the tier's block files
    (each is ``codec.HEADER_SIZE + len(key) + block_bytes``); storing past it
    evicts the least recently used blocks (stored, loaded, touched or hit by a
    lookup) first, and a block larger than the capacity fails its store. At no
    moment do the tier's files (finished or being written) exceed the capacity.

    ``io_workers`` threads (named ``kvactors-disk-<name>-N``) do the I/O;
    ``submit_store``/``submit_load`` return at once and every job is reported
    exactly once, from a worker (or from the thread that shut the tier down,
    for a job cancelled by :meth:`shutdown`). ``fsync=True`` makes a store
    durable before it is reported (the file and the directory entry are
    synced); the default leaves that to the OS, which survives a crash of the
    process but not of the machine.

    A new tier on the same ``root`` finds the blocks stored before (recency
    then follows the files' modification times); files that are not valid
    records are deleted. A block whose file is missing, short or fails its
    checksum fails the load and is removed from the tier: a later lookup is a
    miss, and bad bytes are never reported as a success. So does a block whose
    read fails for any other reason (an I/O error, a directory or a symlink
    where its file was, a file it may not open, a record of another format).

    Jobs end per key: a key that fails (its read or write, or the directory
    sync of ``fsync=True``) fails alone, the job's other keys are still done,
    and the report names the keys that succeeded (``JobResult.successful_keys``).
    After a store, exactly the keys reported successful are in the tier.

    One live tier per directory: two tiers (or processes) sharing a root keep
    separate indexes and would evict and clean up each other's files.

    Events: ``take_events`` returns the keys stored (``removed=False``) and
    removed (evicted or dropped as corrupt, ``removed=True``) since the last
    call, in the order they happened. Blocks found or discarded when a tier
    opens its directory produce no events.
    """

    # The index is in memory, and submits hand their I/O to the workers.
    inline_calls = frozenset(("lookup", "touch", "submit_store", "submit_load"))

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        name: str = "disk",
        capacity_bytes: int,
        io_workers: int = 4,
        fsync: bool = False,
    ) -> None:
        super().__init__(name=name)
        if not isinstance(capacity_bytes, int) or isinstance(capacity_bytes, bool) or capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be an int > 0, got {capacity_bytes!r}")
        check_int(io_workers, "io_workers")
        self.root = os.path.abspath(os.fspath(root))
        self._prefix = os.path.join(self.root, "")
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self._io_workers = io_workers
        self._log: EventLogger = component_logger("tiers.disk", tier=name)

        self._lock = threading.Lock()
        # LRU first. Guarded by _lock, like everything below.
        self._index: collections.OrderedDict[OffloadKey, _Entry] = collections.OrderedDict()
        self._used = 0  # bytes of indexed files
        self._reserved = 0  # bytes of files being written
        self._pins: collections.Counter[OffloadKey] = collections.Counter()  # keys being loaded
        self._events: list[tuple[bool, list[OffloadKey]]] = []
        self._flat = memoryview(b"")  # the pool's bytes, flat (set by attach)
        self._row_bytes = 0
        # Unique temp names without a syscall per file: a random tag per tier, then a counter.
        self._tmp_tag = uuid.uuid4().hex[:16]
        self._tmp_seq = itertools.count()

        os.makedirs(self.root, mode=0o700, exist_ok=True)
        self._scan()
        self._tls = threading.local()
        self._runner = JobRunner(name=name, workers=io_workers, thread_name=f"kvactors-disk-{name}",
                                 report=self.report, log=self._log)

    # ------------------------------------------------------------------ info

    @property
    def used_bytes(self) -> int:
        """Bytes of the block files in the index (files being written not included)."""
        with self._lock:
            return self._used

    def __len__(self) -> int:
        """Number of blocks in the tier."""
        with self._lock:
            return len(self._index)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._index

    def _path(self, name: str) -> str:
        return self._prefix + name  # names never hold a separator (see file_name)

    # ------------------------------------------------------------- restart

    def _scan(self) -> None:
        """Rebuild the index from the directory (constructor only: no other thread yet)."""
        found: list[tuple[int, OffloadKey, _Entry]] = []
        discarded = 0
        with os.scandir(self.root) as it:
            for dirent in it:
                fname = dirent.name
                if fname.startswith(TMP_PREFIX):
                    self._unlink_quietly(fname)
                    continue
                if not fname.endswith(SUFFIX) or not dirent.is_file(follow_symlinks=False):
                    continue
                try:
                    st = dirent.stat(follow_symlinks=False)
                    key = read_key(self._path(fname), fname, st.st_size)
                except (OSError, codec.CorruptRecordError):
                    key = None
                if key is None:
                    discarded += 1
                    self._unlink_quietly(fname)
                    continue
                found.append((st.st_mtime_ns, key, _Entry(fname, st.st_size)))
        found.sort(key=lambda item: item[0])
        for _, key, entry in found:
            self._index[key] = entry
            self._used += entry.size
        evicted = 0
        while self._used > self.capacity_bytes:
            key, entry = self._index.popitem(last=False)
            self._used -= entry.size
            self._unlink_quietly(entry.name)
            evicted += 1
        self._log.debug(
            "tier_opened", root=self.root, blocks=len(self._index), used_bytes=self._used,
            discarded=discarded, evicted=evicted,
        )

    def _unlink_quietly(self, fname: str) -> None:
        try:
            os.unlink(self._path(fname))
        except (FileNotFoundError, NotADirectoryError):
            pass
        except OSError as exc:
            self._log.warning("unlink_failed", file=fname, error=describe(exc))

    # ------------------------------------------------------------ tier API

    def attach(self, pool: torch.Tensor, report: ReportFn) -> None:
        """Attach to the primary pool; blocks of another block size are deleted."""
        if pool.device.type != "cpu" or pool.dtype != torch.uint8 or pool.dim() != 2:
            raise ValueError(f"DiskTier needs a 2-D uint8 CPU pool, got {pool.dtype} {tuple(pool.shape)} "
                             f"on {pool.device}")
        if not pool.is_contiguous():
            raise ValueError("DiskTier needs a contiguous pool")
        super().attach(pool, report)
        block_bytes = self.block_bytes
        # One flat byte view of the pool, made once: a row's view is then a slice
        # (``pool[row].numpy().data`` per block is a measurable part of a load).
        self._flat = pool.numpy().data.cast("B")
        self._row_bytes = block_bytes
        with self._lock:
            stale = [k for k, e in self._index.items() if e.size != codec.HEADER_SIZE + len(k) + block_bytes]
            for key in stale:
                entry = self._index.pop(key)
                self._used -= entry.size
                self._unlink_quietly(entry.name)
        if stale:
            self._log.warning("blocks_discarded", reason="block size differs", blocks=len(stale))

    def lookup(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[LookupResult]:
        """HIT for keys in the index (their recency is refreshed), else MISS. No disk I/O."""
        out: list[LookupResult] = []
        with self._lock:
            for key in keys:
                if key in self._index:
                    self._index.move_to_end(key)
                    out.append(LookupResult.HIT)
                else:
                    out.append(LookupResult.MISS)
        return out

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """Refresh the recency of the keys present."""
        with self._lock:
            for key in keys:
                if key in self._index:
                    self._index.move_to_end(key)

    def take_events(self) -> list[OffloadingEvent]:
        """Keys stored and removed since the last call, in order; thread-safe."""
        with self._lock:
            events, self._events = self._events, []
        return [OffloadingEvent(tuple(keys), self.name, removed) for removed, keys in events]

    def submit_store(self, job: TransferJob) -> None:
        """Write ``pool[job.block_ids]`` under ``job.keys`` on the workers; returns at once.

        Keys already present are not rewritten (their recency is refreshed).
        Each key succeeds when it is in the tier; the report names them.
        """
        self._submit(job, self._store_one)

    def submit_load(self, job: TransferJob) -> None:
        """Read and verify ``job.keys`` into ``pool[job.block_ids]`` on the workers; returns at once.

        The keys are protected from eviction until their read ends. A key that
        is missing, cannot be read or fails verification fails alone (the
        others still load; the report names them) and leaves the tier.
        """
        self._submit(job, self._load_one)

    def drain(self, timeout: float | None) -> None:
        """Return once every submitted job has been reported, or after ``timeout`` seconds."""
        self._runner.drain(timeout)

    def shutdown(self) -> None:
        """Let submitted jobs finish for up to a second, then stop the workers.

        Jobs still queued then are reported failed (from this thread), jobs running
        finish and are reported; when this returns no worker runs and every job
        has been reported. A job submitted afterwards is reported failed at
        once. Idempotent.
        """
        self._runner.shutdown(_SHUTDOWN_DRAIN_S)

    # ------------------------------------------------------------ job plumbing

    def _submit(self, job: TransferJob, do_one: Callable[[OffloadKey, int], bool]) -> None:
        n = len(job.keys)
        if n != len(job.block_ids):
            self._runner.fail(job, f"job has {n} keys but {len(job.block_ids)} block ids")
            return
        if self.pool is None or self._report is None:
            raise RuntimeError(f"tier {self.name!r} is not attached")
        record = codec.HEADER_SIZE + self.block_bytes
        chunks = max(1, min(n, self._io_workers, (n * record) // _MIN_CHUNK_BYTES))
        pinned = list(job.keys) if job.is_promotion else []
        if pinned:
            with self._lock:
                self._pins.update(pinned)

        def work(running: RunningJob, lo: int, hi: int) -> Outcome:
            return self._run_chunk(running.job, do_one, lo, hi)

        def release(lo: int, hi: int) -> None:
            self._unpin(pinned[lo:hi])

        if not self._runner.submit(job, work, chunks=chunks, release=release if pinned else None):
            self._unpin(pinned)
            self._runner.fail(job, f"tier {self.name!r} is shut down")

    def _unpin(self, keys: list[OffloadKey]) -> None:
        if not keys:
            return
        with self._lock:
            self._pins.subtract(keys)
            for key in keys:
                if self._pins[key] <= 0:
                    del self._pins[key]

    def _run_chunk(self, job: TransferJob, do_one: Callable[[OffloadKey, int], bool], lo: int, hi: int) -> Outcome:
        """Do keys ``lo:hi`` of the job, each on its own: one key's failure fails that key only."""
        failed: dict[int, str] = {}
        written: list[int] = []
        keys, rows = job.keys, job.block_ids
        i = lo
        try:
            for i in range(lo, hi):
                try:
                    if do_one(keys[i], rows[i]):
                        written.append(i)
                except Exception as exc:
                    failed[i] = describe(exc)
            i = hi
        finally:
            for j in range(i, hi):  # a BaseException stopped the loop: the rest never ran
                failed.setdefault(j, "worker interrupted")
        if self.fsync and written:
            try:
                fsync_dir(self.root)
            except Exception as exc:
                # The new files may not survive a crash, as their store promised: not stored.
                reason = f"directory sync failed: {describe(exc)}"
                for j in written:
                    self._forget(keys[j])
                    failed[j] = reason
        return Outcome(failed)

    def _emit(self, keys: Iterable[OffloadKey], removed: bool) -> None:
        """Record an event; caller holds the lock. Adjacent events of one kind merge."""
        if self._events and self._events[-1][0] == removed:
            self._events[-1][1].extend(keys)
        else:
            batch = list(keys)
            if batch:
                self._events.append((removed, batch))

    # --------------------------------------------------------------- store

    def _reserve(self, size: int) -> None:
        """Make room for ``size`` more bytes, evicting LRU unpinned blocks; caller holds the lock."""
        if size > self.capacity_bytes:
            raise DiskTierError(f"block record of {size} bytes exceeds capacity_bytes={self.capacity_bytes}")
        evicted: list[OffloadKey] = []
        try:
            while self._used + self._reserved + size > self.capacity_bytes:
                victim = next((k for k in self._index if k not in self._pins), None)
                if victim is None:
                    raise DiskTierError(
                        f"no room: {self._reserved} bytes being written and every stored block is being read"
                    )
                entry = self._index.pop(victim)
                self._used -= entry.size
                # Unlinked under the lock so that bytes on disk never exceed the capacity.
                self._unlink_quietly(entry.name)
                evicted.append(victim)
        finally:
            self._emit(evicted, removed=True)
        self._reserved += size

    def _store_one(self, key: OffloadKey, row: int) -> bool:
        """Store one block; returns whether a new file was written. Raises if the key is not stored."""
        size = codec.HEADER_SIZE + len(key) + self.block_bytes
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return False
            self._reserve(size)
        final = file_name(key)
        tmp = self._path(f"{TMP_PREFIX}{self._tmp_tag}-{next(self._tmp_seq)}")
        renamed = False
        try:
            write_record(tmp, key, self._row(row), fsync=self.fsync)  # a zero-copy view of the pinned row
            with self._lock:
                if key in self._index:  # another job stored it meanwhile
                    self._index.move_to_end(key)
                else:
                    os.replace(tmp, self._path(final))
                    renamed = True
                    self._reserved -= size
                    self._used += size
                    self._index[key] = _Entry(final, size)
                    self._emit((key,), removed=False)
        finally:
            if not renamed:
                # Unlink before releasing the reservation: the bytes stay counted while on disk.
                self._unlink_quietly(os.path.basename(tmp))
                with self._lock:
                    self._reserved -= size
        return renamed

    # ---------------------------------------------------------------- load

    def _load_one(self, key: OffloadKey, row: int) -> bool:
        """Read and verify one block into its row. Any failure removes the block from the
        tier (its file goes too, if it can), so a later lookup is a miss; then raises."""
        with self._lock:
            entry = self._index.get(key)
            if entry is not None:
                self._index.move_to_end(key)
        if entry is None:
            raise DiskTierError(f"block {key.hex()[:32]} is not in tier {self.name!r}")
        try:
            self._read_into(key, row, entry)
        except codec.CorruptRecordError as exc:
            self._drop(key, entry)
            raise DiskTierError(f"block {key.hex()[:32]}: corrupt file {entry.name}: {exc}") from None
        except (FileNotFoundError, NotADirectoryError) as exc:
            self._drop(key, entry)
            raise DiskTierError(f"block {key.hex()[:32]}: file is missing: {describe(exc)}") from None
        except Exception as exc:
            # EIO, a directory or a symlink in the file's place, EACCES, ...: this block cannot be
            # read, and asking again would fail again: it leaves the tier.
            self._drop(key, entry)
            raise DiskTierError(f"block {key.hex()[:32]}: unreadable file {entry.name}: {describe(exc)}") from None
        return False  # no file written

    def _row(self, row: int) -> memoryview:
        """A zero-copy view of pool row ``row``."""
        size = self._row_bytes
        return self._flat[row * size : (row + 1) * size]

    def _read_into(self, key: OffloadKey, row: int, entry: _Entry) -> None:
        head = self._buffer(codec.HEADER_SIZE + len(key) + 1)
        read_record_into(self._path(entry.name), key, head, self._row(row))

    def _buffer(self, size: int) -> memoryview:
        """This worker's header buffer, reused across reads: no allocation per block."""
        buf: bytearray | None = getattr(self._tls, "buf", None)
        if buf is None or len(buf) < size:
            buf = bytearray(size)
            self._tls.buf = buf
        return memoryview(buf)[:size]

    def _forget(self, key: OffloadKey) -> None:
        """Remove ``key``'s block, whatever file it has now."""
        with self._lock:
            entry = self._index.get(key)
        if entry is not None:
            self._drop(key, entry)

    def _drop(self, key: OffloadKey, entry: _Entry) -> None:
        """Remove a block found bad, unless it was replaced since ``entry`` was read."""
        with self._lock:
            if self._index.get(key) is not entry:
                return
            del self._index[key]
            self._used -= entry.size
            self._unlink_quietly(entry.name)
            self._emit((key,), removed=True)


