"""``DiskTier``: blocks in group files in one local directory.

The tier writes :mod:`kvactors.tiers.disk_group` files (``KVA3``).
Such a file holds the blocks of one store.
It is written under a temporary name and renamed once complete.
The tier also reads, but no longer writes, :mod:`kvactors.tiers.disk_files` files (``KVA2``).
Those hold one block per file and were written by earlier versions.

The index is a :class:`~kvactors.tiers.disk_index.DiskIndex` in memory.
It maps each key to its file and slot, and keeps the LRU order and the bytes used.
It is rebuilt from the directory when a tier is constructed, so blocks survive a restart of the process.
Lookups never touch the disk.

Threading: the tier's methods are called on its actor's thread, one at a time.
Its ``inline_calls`` may instead run on the thread that sends them.
The file I/O runs on the workers of a :class:`~kvactors.tiers.runner.JobRunner`,
concurrently with those methods and with each other.
One lock guards the index, the byte accounting, the pins and the event list.
It is held for index updates and for the cheap metadata calls that must agree with the index.
Those are the ``os.replace`` of a finished file and the ``os.unlink`` of a file whose last key left.
It is never held for reading or writing block data.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvactors.core.arguments import check_flag, check_int
from kvactors.core.events import EventBuffer, warn_on_overflow
from kvactors.logs import component_logger
from kvactors.tiers import codec
from kvactors.tiers.base import ReportFn, SecondaryTier
from kvactors.tiers.disk_files import MAX_NAME_CHARS, SUFFIX, TMP_PREFIX, DiskTierError, describe, file_name, fsync_dir
from kvactors.tiers.disk_group import ALIGN, GROUP_SUFFIX, encode_head, key_checksum, plan_groups, write_group
from kvactors.tiers.disk_index import DiskFile, DiskIndex
from kvactors.tiers.disk_read import Item, load_group, load_legacy, scan
from kvactors.tiers.runner import JobRunner, Outcome, RunningJob
from kvactors.types import LookupResult, OffloadingEvent, OffloadKey, ReqContext, TransferJob

if TYPE_CHECKING:
    from kvactors.logs import EventLogger

__all__ = ["GROUP_SUFFIX", "MAX_NAME_CHARS", "SUFFIX", "TMP_PREFIX", "DiskTier", "DiskTierError", "file_name"]

_MIN_CHUNK_BYTES = 4 << 20
"""A job is split across workers in chunks of at least this many payload bytes:
below it, the per-chunk overhead costs more than the parallelism wins."""

DEFAULT_IO_WORKERS = min(4, 1 + (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                  else os.cpu_count() or 1))
"""``io_workers`` by default: one more than the usable CPUs, at most 4. Reads from the page cache
are memory copies, one core's each; the extra worker keeps every core reading while the
scheduler has put two workers that hand the GIL to each other on one core
(docs/performance.md). Past that, more workers only contend for the GIL."""

_SHUTDOWN_DRAIN_S = 1.0
"""How long :meth:`DiskTier.shutdown` lets running and queued jobs finish before cancelling."""

class DiskTier(SecondaryTier):
    """A bounded secondary tier in one directory on local disk.

    ``root`` is created if missing, with mode 0700.
    A file in its place or on its path is a ``ValueError``.
    Files are created with mode 0600.

    Each store job writes its new blocks into one group file per worker's chunk of it.
    A group file (:mod:`kvactors.tiers.disk_group`) holds a checksummed table of its keys, then the payloads.

    ``capacity_bytes`` bounds the bytes of the tier's files.
    Storing past it evicts the least recently used blocks first.
    A block counts as used when it is stored, loaded, touched or hit by a lookup.
    A block being loaded is never evicted.
    A block larger than the capacity fails its store.
    Once attached, the tier's files (finished or being written) never exceed the capacity.
    The exception is a restart where files the tier can neither read nor remove hold more than that.
    Stores then fail until room comes back, and no block is evicted for room it cannot make.

    A file's bytes are freed when its last block leaves the tier, which deletes the file.
    Until then, the slots of blocks that left it (failed, replaced) still count.
    So a file kept by one recently used block holds the room of all its blocks.
    Eviction therefore takes whole files, the least recently used first, because evicting a block alone would free
    nothing.
    A file is as recent as its most recent block.

    ``io_workers`` threads do the I/O.
    They are named ``kvactors-disk-<name>-N``.
    The default is one more than the usable CPUs, at most 4 (:data:`DEFAULT_IO_WORKERS`).
    ``submit_store`` and ``submit_load`` return at once.
    Every job is reported exactly once, from a worker.
    A job cancelled by :meth:`shutdown` is reported from the thread that shut the tier down.
    ``fsync=True`` makes a store durable before it is reported, by syncing the file and the directory entry.
    The default leaves that to the OS, which survives a crash of the process but not of the machine.
    ``direct_io=True`` writes group files with ``O_DIRECT`` where the pool's rows start on page
    boundaries and are whole pages, as a pool mapped from a file (vLLM's) is.
    The bytes then skip the page cache, whose copy and page allocation were most of a store's CPU.
    Loads then read the payloads of group files with ``O_DIRECT`` too, into the rows.
    Elsewhere, or on a file system that refuses ``O_DIRECT``, both go through the page cache.
    The default (``False``) keeps the page cache: a promotion read from it is 3-4x faster, and under
    ``vllm serve`` that outweighed the CPU saved (docs/performance.md, "The disk tier's CPU").

    A new tier on the same ``root`` finds the blocks stored before.
    It reads both group files and the one-file-per-block ``KVA2`` files of earlier versions.
    Recency then follows the files' modification times.
    Files that are not valid are deleted.
    Those are a file whose table fails its checksum or disagrees with the file's size, and a temporary file left by a
    crash.
    A file the tier cannot read at all (``EIO``, ``EACCES``) is left alone, unindexed.
    Its bytes count against the capacity.
    A restart with a smaller capacity evicts at :meth:`attach`, once the blocks of another size are gone.
    A block dropped from a file that still held other blocks may reappear after a restart, because its bytes are still
    there.
    Its bytes are verified when loaded, as always, so a bad one fails again and leaves.
    Names sort in the order files were made.
    So of two copies of a block the newer one wins, even when both files carry one modification time.

    A block whose bytes are missing, short or fail their checksum fails the load and is removed from the tier.
    A later lookup is then a miss, and bad bytes are never reported as a success.
    A block whose read fails for any other reason is removed too.
    Such reasons are an I/O error, a directory or a symlink where its file was, a file it may not open, and a file whose
    table changed.
    The other blocks of the same file still load if their own bytes verify.

    Jobs end per key.
    A key that fails fails alone, and the job's other keys are still done.
    A key fails when its read or write fails, or when the directory sync of ``fsync=True`` fails.
    The report names the keys that succeeded (``JobResult.successful_keys``).
    After a store, exactly the keys reported successful are in the tier.
    A store larger than the room fails the keys it evicted itself to store its others.
    A store whose directory sync fails takes out only the blocks it wrote.
    A block another job stored meanwhile is that job's and stays.

    Keep one live tier per directory.
    Two tiers (or processes) sharing a root keep separate indexes.
    They would evict and clean up each other's files.

    Events: ``take_events`` returns the keys stored and removed since the last call, in the order they happened.
    A stored key has ``removed=False``.
    A key evicted or dropped as corrupt has ``removed=True``.
    Blocks found or discarded when a tier opens its directory produce no events.
    """

    # The index is in memory, and submits hand their I/O to the workers.
    inline_calls = frozenset(("lookup", "touch", "submit_store", "submit_load"))
    hooks = frozenset(("touch",))  # on_new_request and on_request_finished are no-ops here
    medium = "STORAGE"
    locality = "LOCAL"

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        name: str = "disk",
        capacity_bytes: int,
        io_workers: int = DEFAULT_IO_WORKERS,
        fsync: bool = False,
        direct_io: bool = False,
    ) -> None:
        super().__init__(name=name)
        if not isinstance(capacity_bytes, int) or isinstance(capacity_bytes, bool) or capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be an int > 0, got {capacity_bytes!r}")
        check_int(io_workers, "io_workers")
        path = os.fspath(root) if isinstance(root, str | os.PathLike) else None
        if not isinstance(path, str) or not path or "\0" in path:
            # abspath("") is the working directory: a tier there would clean up its files.
            raise ValueError(f"root must be a non-empty str or os.PathLike path, got {root!r}")
        self.root = os.path.abspath(path)
        self._prefix = os.path.join(self.root, "")
        self.capacity_bytes = capacity_bytes
        self.fsync = check_flag(fsync, "fsync")  # "no" is a str, not False
        self.direct_io = check_flag(direct_io, "direct_io")
        # Whether group files are written and read with O_DIRECT: set by attach, cleared by a worker once the file
        # system refuses it (a plain bool store, safe without the lock).
        self._direct = False
        self._io_workers = io_workers
        self._log: EventLogger = component_logger("tiers.disk", tier=name)

        self._lock = threading.Lock()
        self._index = DiskIndex(capacity_bytes, self._unlink_quietly)  # guarded by _lock, like _events
        self._events = EventBuffer(name, on_overflow=warn_on_overflow(self._log))
        self._flat = memoryview(b"")  # the pool's bytes, flat (set by attach)
        self._row_bytes = 0
        # Unique file names without a syscall per file: a random tag per tier, then a counter.
        self._tag = uuid.uuid4().hex[:16]
        self._seq = itertools.count()

        try:
            os.makedirs(self.root, mode=0o700, exist_ok=True)
        except (FileExistsError, NotADirectoryError) as exc:  # a file where a directory must be
            raise ValueError(f"root {self.root!r} is not a directory: {describe(exc)}") from None
        self._scan()
        self._tls = threading.local()
        self._runner = JobRunner(name=name, workers=io_workers, thread_name=f"kvactors-disk-{name}",
                                 report=self.report, log=self._log)

    # ------------------------------------------------------------------ info

    @property
    def used_bytes(self) -> int:
        """Bytes of the tier's files.

        These are the files holding blocks, and those that could not be removed yet.
        The tier tries those again before the next eviction.
        Files being written are not included.
        """
        with self._lock:
            return self._index.used

    def __len__(self) -> int:
        """Number of blocks in the tier."""
        with self._lock:
            return len(self._index)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._index

    def locate(self, key: OffloadKey) -> tuple[str, int, int] | None:
        """``(path, offset, length)`` of ``key``'s payload, or None, for diagnostics and tests.

        The file may hold other blocks too.
        Its format follows from its suffix.
        ``GROUP_SUFFIX`` marks a group file, and ``SUFFIX`` marks a ``KVA2`` record.
        """
        with self._lock:
            slot = self._index.get(key)
            if slot is None:
                return None
            return self._path(slot.file.name), slot.offset, slot.file.block_bytes

    def _path(self, name: str) -> str:
        return self._prefix + name  # names never hold a separator (see file_name)

    # ------------------------------------------------------------- restart

    def _scan(self) -> None:
        """Rebuild the index from the directory. Only the constructor calls it, so no other thread runs yet."""
        found, discarded, unreadable, undeleted = scan(self.root, self._unlink_quietly)
        for file, entries in found:  # oldest first: a key in two files ends in the newer one
            if not self._index.add(file, entries, replace=True) and not self._unlink_quietly(file.name):
                undeleted.append((file.name, file.size))  # holds no key, and would not go
        for size in unreadable:
            self._index.keep_unreadable(size)
        for fname, size in undeleted:  # bad files that would not go: they count until they do
            self._index.keep_stuck(fname, size)
        if unreadable:
            self._log.warning("files_unreadable", root=self.root, files=len(unreadable), bytes=sum(unreadable),
                              detail="left on disk, not indexed; their bytes count against the capacity")
        self._log.debug(
            "tier_opened", root=self.root, blocks=len(self._index), used_bytes=self._index.used,
            discarded=discarded, unreadable=len(unreadable),
        )

    def _unlink_quietly(self, fname: str) -> bool:
        """Remove a file of the tier, and return whether it is gone.

        A failure is logged, not raised.
        """
        try:
            os.unlink(self._path(fname))
        except (FileNotFoundError, NotADirectoryError):
            pass
        except OSError as exc:
            self._log.warning("unlink_failed", file=fname, error=describe(exc))
            return False
        return True

    # ------------------------------------------------------------ tier API

    def attach(self, pool: torch.Tensor, report: ReportFn) -> None:
        """Attach to the primary pool. Blocks of another block size are deleted."""
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
        # O_DIRECT needs every row on a page boundary: a pool mapped from a file (vLLM's) is, a torch.zeros one
        # need not be.
        self._direct = self.direct_io and pool.data_ptr() % ALIGN == 0 and block_bytes % ALIGN == 0
        with self._lock:
            stale = self._index.remove_files(lambda f: f.block_bytes != block_bytes)
            # Over capacity after a restart (a smaller capacity_bytes): only now, once the blocks
            # of another size are gone, is it known which of this size must go too.
            evicted = self._index.shrink()
        if stale:
            self._log.warning("blocks_discarded", reason="block size differs", blocks=len(stale))
        if evicted:
            self._log.info("blocks_evicted", reason="over capacity at a restart", blocks=len(evicted))

    def lookup(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[LookupResult]:
        """HIT for keys in the index (their recency is refreshed), else MISS. No disk I/O."""
        with self._lock:
            touch = self._index.touch
            return [LookupResult.HIT if touch(key) else LookupResult.MISS for key in keys]

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """Refresh the recency of the keys present."""
        with self._lock:
            for key in keys:
                self._index.touch(key)

    def take_events(self) -> list[OffloadingEvent]:
        """Keys stored and removed since the last call, in order. Thread-safe."""
        with self._lock:
            return self._events.take()

    def submit_store(self, job: TransferJob) -> None:
        """Write ``pool[job.block_ids]`` under ``job.keys`` on the workers. Returns at once.

        Keys already present are not rewritten, and their recency is refreshed.
        Each key succeeds when it is in the tier, and the report names those keys.
        """
        self._submit(job, load=False)

    def submit_load(self, job: TransferJob) -> None:
        """Read and verify ``job.keys`` into ``pool[job.block_ids]`` on the workers. Returns at once.

        The keys are protected from eviction until their read ends.
        A key that is missing, cannot be read or fails verification fails alone, and leaves the tier.
        The others still load, and the report names them.
        """
        self._submit(job, load=True)

    def drain(self, timeout: float | None) -> None:
        """Return once every submitted job has been reported, or after ``timeout`` seconds."""
        self._runner.drain(timeout)

    def shutdown(self) -> None:
        """Let submitted jobs finish for up to a second, then stop the workers.

        Jobs still queued then are reported failed, from this thread.
        Jobs running finish and are reported.
        When this returns, no worker runs and every job has been reported.
        A job submitted afterwards is reported failed at once.
        Idempotent.
        """
        self._runner.shutdown(_SHUTDOWN_DRAIN_S)

    # ------------------------------------------------------------ job plumbing

    def _submit(self, job: TransferJob, *, load: bool) -> None:
        n = len(job.keys)
        if n != len(job.block_ids):
            self._runner.fail(job, f"job has {n} keys but {len(job.block_ids)} block ids")
            return
        if self.pool is None or self._report is None:
            raise RuntimeError(f"tier {self.name!r} is not attached")
        chunks = max(1, min(n, self._io_workers, (n * self.block_bytes) // _MIN_CHUNK_BYTES))
        pinned = list(job.keys) if job.is_promotion else []
        if pinned:
            with self._lock:
                self._index.pin(pinned)
        # The keys this job's chunks evicted to make room, seen by every chunk: one may
        # evict what another stored.
        evicted_here: set[OffloadKey] = set()

        def work(running: RunningJob, lo: int, hi: int) -> Outcome:
            if load:
                return Outcome(self._load_chunk(running.job, lo, hi))
            return Outcome(self._store_chunk(running.job, lo, hi, evicted_here))

        def release(lo: int, hi: int) -> None:
            self._unpin(pinned[lo:hi])

        def settle(failed: dict[int, str]) -> None:
            self._fail_self_evicted(job, evicted_here, failed)

        if not self._runner.submit(job, work, chunks=chunks, release=release if pinned else None,
                                   settle=None if load else settle):
            self._unpin(pinned)
            self._runner.fail(job, f"tier {self.name!r} is shut down")

    def _unpin(self, keys: list[OffloadKey]) -> None:
        if keys:
            with self._lock:
                self._index.unpin(keys)

    def _row(self, row: int) -> memoryview:
        """A zero-copy view of pool row ``row``."""
        size = self._row_bytes
        return self._flat[row * size : (row + 1) * size]

    # --------------------------------------------------------------- store

    def _store_chunk(self, job: TransferJob, lo: int, hi: int, evicted_here: set[OffloadKey]) -> dict[int, str]:
        """Store keys ``lo:hi`` of the job in one group file, or a few (see ``plan_groups``).

        A group whose write fails is retried one key per file, so that a key fails alone.
        The keys evicted to make room are added to ``evicted_here``.
        That set is the job's, shared by its chunks.
        Returns the failed positions.
        """
        keys = job.keys
        new: list[int] = []
        with self._lock:
            seen: set[OffloadKey] = set()
            for i in range(lo, hi):
                if keys[i] not in seen and not self._index.touch(keys[i]):
                    new.append(i)
                seen.add(keys[i])
        failed: dict[int, str] = {}
        written: list[tuple[int, DiskFile | None]] = []  # (position, the file it went into, if ours)
        for group in plan_groups(keys, new, self._row_bytes, self.capacity_bytes):
            try:
                file = self._store_group(job, group, evicted_here)
                written.extend((i, file) for i in group)
            except Exception as exc:
                if len(group) == 1:
                    failed[group[0]] = describe(exc)
                    continue
                for i in group:
                    try:
                        written.append((i, self._store_group(job, [i], evicted_here)))
                    except Exception as exc_one:
                        failed[i] = describe(exc_one)
        sync_failed: str | None = None
        if self.fsync and written:
            try:
                fsync_dir(self.root)
            except Exception as exc:
                sync_failed = f"directory sync failed: {describe(exc)}"
        with self._lock:
            if sync_failed is not None:
                # Our new files may not survive a crash, as their store promised: not stored.
                # A key another job stored meanwhile is that job's, and stays.
                for i, file in written:
                    slot = self._index.get(keys[i])
                    if file is not None and slot is not None and slot.file is file:
                        self._index.remove(keys[i])
                        self._events.add((keys[i],), removed=True)
                        failed[i] = sync_failed
        return failed

    def _fail_self_evicted(self, job: TransferJob, evicted_here: set[OffloadKey], failed: dict[int, str]) -> None:
        """Fail the keys that a store evicted itself, once every chunk of the store ended.

        A job larger than the room evicts its own keys (one chunk's, to store another's) to store its later ones.
        Those keys are not in the tier because of this store, so they are not reported stored.
        A key another job evicts afterwards was stored.
        That is a cache at work.
        """
        keys = job.keys
        with self._lock:
            for i, key in enumerate(keys):
                if i not in failed and key in evicted_here and key not in self._index:
                    failed[i] = (f"DiskTierError: block {key.hex()[:32]} was evicted to make room for "
                                 f"this store's other blocks (capacity_bytes={self.capacity_bytes})")

    def _store_group(self, job: TransferJob, positions: list[int],
                     evicted_here: set[OffloadKey] | None = None) -> DiskFile | None:
        """Write the keys at ``positions`` into one new file. Raises if they are not stored.

        Each key is then in the tier, in this file or in the file of another job that won the race.
        Returns the new file, or ``None`` when every key was another job's.
        The keys evicted to make room are added to ``evicted_here``.
        """
        keys = [job.keys[i] for i in positions]
        views = [self._row(job.block_ids[i]) for i in positions]  # zero-copy views of the pinned rows
        table = encode_head(keys, [key_checksum(k, v) for k, v in zip(keys, views, strict=True)], self._row_bytes)
        size = table.file_size
        with self._lock:
            evicted: list[OffloadKey] = []
            try:
                self._index.reserve(size, evicted)  # unlinks under the lock: the disk never exceeds the capacity
            finally:
                self._events.add(evicted, removed=True)
                if evicted_here is not None:
                    evicted_here.update(evicted)
        seq = next(self._seq)
        # Names sort in the order files were made, across restarts too: a restart that finds two
        # files with one mtime (coarse clocks, NFS) keeps a key's newer copy.
        final = f"g-{time.time_ns():016x}-{self._tag}-{seq:08x}{GROUP_SUFFIX}"
        tmp = self._path(f"{TMP_PREFIX}{self._tag}-{seq}")
        renamed = False
        file: DiskFile | None = None
        try:
            if not self._direct:
                write_group(tmp, table, views, fsync=self.fsync)
            elif not write_group(tmp, table, views, fsync=self.fsync, direct=True):
                self._direct = False  # the file system refuses O_DIRECT: from now on, the page cache at once
            with self._lock:
                entries = [e for e in zip(keys, table.offsets, table.checksums, strict=True) if e[0] not in self._index]
                if entries:  # else every key was stored by another job meanwhile
                    os.replace(tmp, self._path(final))
                    renamed = True
                    file = DiskFile(final, size, self._row_bytes, head=table.head_bytes)
                    self._events.add(self._index.add(file, entries, reserved=size), removed=False)
        finally:
            if not renamed:
                # The bytes stay counted while the file is on disk (also if it cannot be removed).
                with self._lock:
                    self._index.abandon(os.path.basename(tmp), size)
        return file

    # ---------------------------------------------------------------- load

    def _load_chunk(self, job: TransferJob, lo: int, hi: int) -> dict[int, str]:
        """Read and verify keys ``lo:hi`` into their rows, one ``open`` per file.

        A key that fails leaves the tier, and its file goes with its last key.
        Returns the failed positions.
        """
        failed: dict[int, str] = {}
        by_file: dict[DiskFile, list[Item]] = {}
        keys, rows = job.keys, job.block_ids
        with self._lock:
            for i in range(lo, hi):
                slot = self._index.get(keys[i])
                if slot is None:
                    failed[i] = f"DiskTierError: block {keys[i].hex()[:32]} is not in tier {self.name!r}"
                    continue
                self._index.touch(keys[i])
                by_file.setdefault(slot.file, []).append((i, slot, keys[i], self._row(rows[i])))
        for file, items in by_file.items():
            path = self._path(file.name)
            if file.legacy:
                bad: dict[int, str] = {}
                for i, _, key, view in items:
                    why = load_legacy(path, file.name, key, self._buffer(codec.HEADER_SIZE + len(key) + 1), view)
                    if why is not None:
                        bad[i] = why
            else:
                bad = load_group(path, file, items, direct=self._direct)
            if bad:
                with self._lock:
                    for i, slot, key, _ in items:
                        if i in bad and self._index.get(key) is slot:  # not replaced meanwhile
                            self._index.remove(key)
                            self._events.add((key,), removed=True)
                failed.update(bad)
        return failed

    def _buffer(self, size: int) -> memoryview:
        """This worker's header buffer, reused across reads so that no block needs an allocation."""
        buf: bytearray | None = getattr(self._tls, "buf", None)
        if buf is None or len(buf) < size:
            buf = bytearray(size)
            self._tls.buf = buf
        return memoryview(buf)[:size]
