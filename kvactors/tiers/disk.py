"""``DiskTier``: blocks as files in one local directory.

Layout: one file per block, named after its key (``<key hex>.kvb``, or
``h-<blake2b of key>.kvb`` when the hex name would be too long), holding one
record of :mod:`kvactors.tiers.codec` (header, key, payload, XXH3-64 checksum). A file
appears under its final name only once it is complete (temporary file plus
``os.replace``), so a crash leaves either the whole record or a ``.tmp-*``
file that the next tier opening the directory deletes.

The index (key -> file, LRU order, bytes used) lives in memory; it is rebuilt
from the directory when a tier is constructed, so blocks survive a restart of
the process. Lookups never touch the disk.

Threading: the tier's methods are called on its actor's thread, one at a time;
the file I/O runs on a small ``ThreadPoolExecutor`` of its own, concurrently
with those methods and with each other. One lock guards the index, the byte
accounting, the pins and the event list; it is held for index updates and for
the cheap metadata calls that must agree with the index (``os.replace`` of a
finished file, ``os.unlink`` of an evicted one), never for reading or writing
block data.
"""

from __future__ import annotations

import collections
import concurrent.futures
import errno
import hashlib
import itertools
import os
import threading
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvactors.logs import component_logger
from kvactors.tiers import codec
from kvactors.tiers.base import ReportFn, SecondaryTier
from kvactors.types import JobResult, LookupResult, OffloadingEvent, OffloadKey, ReqContext, TransferJob

if TYPE_CHECKING:
    from kvactors.logs import EventLogger

SUFFIX = ".kvb"
"""Suffix of block files; files without it are not the tier's and are left alone."""
TMP_PREFIX = ".tmp-"
"""Prefix of files being written; leftovers are deleted when a tier opens the directory."""
MAX_NAME_CHARS = 200
"""Longest file name used; longer hex names are replaced by a hash (the record keeps the key)."""

_MIN_CHUNK_BYTES = 4 << 20
"""A job is split across workers in chunks of at least this many record bytes:
below it, the per-chunk overhead costs more than the parallelism wins."""

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class DiskTierError(RuntimeError):
    """A job of a :class:`DiskTier` could not be done (the message says why)."""


def file_name(key: OffloadKey) -> str:
    """The name of the file that holds ``key``: hex of the key, or a hash of it.

    Only ``[0-9a-f]`` and ``h-`` appear, so no key can steer the path out of
    the tier's directory.
    """
    name = key.hex() + SUFFIX
    if len(name) > MAX_NAME_CHARS:
        name = "h-" + hashlib.blake2b(key, digest_size=32).hexdigest() + SUFFIX
    return name


def _describe(exc: BaseException) -> str:
    """A one-line error for a JobResult: the errno name and the file for OS errors."""
    if isinstance(exc, OSError) and exc.errno is not None:
        code = errno.errorcode.get(exc.errno, str(exc.errno))
        where = f": {exc.filename}" if exc.filename else ""
        return f"{type(exc).__name__} [{code}] {exc.strerror}{where}"
    return f"{type(exc).__name__}: {exc}"


@dataclass(slots=True)
class _Entry:
    name: str
    size: int


@dataclass(slots=True, eq=False)
class _JobState:
    job: TransferJob
    remaining: int = 0
    failed: dict[int, str] = field(default_factory=dict)  # position in the job -> why that key failed
    pinned: list[OffloadKey] = field(default_factory=list)

    def result(self) -> JobResult:
        """The report: a success, or the keys that succeeded and the first error."""
        keys = self.job.keys
        if not self.failed:
            return JobResult(self.job.job_id, True)
        bad = {keys[i] for i in self.failed}
        ok = tuple(key for key in dict.fromkeys(keys) if key not in bad)
        first = self.failed[min(self.failed)]
        error = f"{len(bad)} of {len(set(keys))} blocks failed: {first}"
        return JobResult(self.job.job_id, False, error, successful_keys=ok)


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
        if not isinstance(io_workers, int) or io_workers < 1:
            raise ValueError(f"io_workers must be an int >= 1, got {io_workers!r}")
        self.root = os.path.abspath(os.fspath(root))
        self._prefix = os.path.join(self.root, "")
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self._io_workers = io_workers
        self._log: EventLogger = component_logger("tiers.disk", tier=name)

        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        # LRU first. Guarded by _lock, like everything below.
        self._index: collections.OrderedDict[OffloadKey, _Entry] = collections.OrderedDict()
        self._used = 0  # bytes of indexed files
        self._reserved = 0  # bytes of files being written
        self._pins: collections.Counter[OffloadKey] = collections.Counter()  # keys being loaded
        self._events: list[tuple[bool, list[OffloadKey]]] = []
        self._inflight: set[_JobState] = set()
        self._closed = False
        self._flat = memoryview(b"")  # the pool's bytes, flat (set by attach)
        self._row_bytes = 0
        # Unique temp names without a syscall per file: a random tag per tier, then a counter.
        self._tmp_tag = uuid.uuid4().hex[:16]
        self._tmp_seq = itertools.count()

        os.makedirs(self.root, mode=0o700, exist_ok=True)
        self._scan()
        self._tls = threading.local()
        thread_ids = itertools.count()

        def name_worker() -> None:
            threading.current_thread().name = f"kvactors-disk-{name}-{next(thread_ids)}"

        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=io_workers, thread_name_prefix=f"kvactors-disk-{name}", initializer=name_worker
        )

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
                    key = self._read_key(fname, st.st_size)
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

    def _read_key(self, fname: str, size: int) -> OffloadKey | None:
        """The key of a block file if its header, name and size agree, else None."""
        fd = os.open(self._path(fname), os.O_RDONLY | _O_CLOEXEC | _O_NOFOLLOW)
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

    def _unlink_quietly(self, fname: str) -> None:
        try:
            os.unlink(self._path(fname))
        except (FileNotFoundError, NotADirectoryError):
            pass
        except OSError as exc:
            self._log.warning("unlink_failed", file=fname, error=_describe(exc))

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
        # (``pool[row].numpy().data`` per block cost about a tenth of a load).
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
        with self._idle:
            self._idle.wait_for(lambda: not self._inflight, timeout)

    def shutdown(self, timeout: float | None = 1.0) -> None:
        """Drain for up to ``timeout`` seconds, then stop the workers.

        Jobs still queued are reported failed (from this thread), jobs running
        finish and are reported; when this returns no worker runs and every job
        has been reported. A job submitted afterwards is reported failed at
        once. Idempotent.
        """
        with self._lock:
            if self._closed:
                return
        self.drain(timeout)
        with self._lock:
            self._closed = True
        self._executor.shutdown(wait=True, cancel_futures=True)

    # ------------------------------------------------------------ job plumbing

    def _submit(self, job: TransferJob, do_one: Callable[[OffloadKey, int], bool]) -> None:
        state = _JobState(job)
        n = len(job.keys)
        if n != len(job.block_ids):
            self._finish_now(state, f"job has {n} keys but {len(job.block_ids)} block ids")
            return
        if self.pool is None or self._report is None:
            raise RuntimeError(f"tier {self.name!r} is not attached")
        record = codec.HEADER_SIZE + self.block_bytes
        n_chunks = max(1, min(n, self._io_workers, (n * record) // _MIN_CHUNK_BYTES))
        bounds = [(n * i) // n_chunks for i in range(n_chunks + 1)]
        with self._lock:
            if self._closed:
                closed = True
            else:
                closed = False
                state.remaining = n_chunks
                self._inflight.add(state)
                if job.is_promotion:
                    state.pinned = list(job.keys)
                    self._pins.update(state.pinned)
        if closed:
            self._finish_now(state, f"tier {self.name!r} is shut down")
            return
        for lo, hi in itertools.pairwise(bounds):
            try:
                fut = self._executor.submit(self._run_chunk, state, do_one, lo, hi)
            except RuntimeError as exc:  # executor shut down under us
                self._cancel(state, lo, hi, f"tier {self.name!r} is shut down: {exc}")
                continue
            fut.add_done_callback(self._on_cancelled(state, lo, hi))

    def _on_cancelled(
        self, state: _JobState, lo: int, hi: int
    ) -> Callable[[concurrent.futures.Future[None]], None]:
        def callback(fut: concurrent.futures.Future[None]) -> None:
            # A cancelled chunk never ran, so _run_chunk will not report it.
            if fut.cancelled():
                self._cancel(state, lo, hi, f"cancelled: tier {self.name!r} shut down")

        return callback

    def _run_chunk(
        self, state: _JobState, do_one: Callable[[OffloadKey, int], bool], lo: int, hi: int
    ) -> None:
        """Do keys ``lo:hi`` of the job, each on its own: one key's failure fails that key only."""
        failed: dict[int, str] = {}
        written: list[int] = []
        i = lo
        try:
            keys, rows = state.job.keys, state.job.block_ids
            for i in range(lo, hi):
                try:
                    if do_one(keys[i], rows[i]):
                        written.append(i)
                except Exception as exc:
                    failed[i] = _describe(exc)
            i = hi
            if self.fsync and written:
                try:
                    self._fsync_dir()
                except Exception as exc:
                    # The new files may not survive a crash, as their store promised: not stored.
                    reason = f"directory sync failed: {_describe(exc)}"
                    for j in written:
                        self._forget(keys[j])
                        failed[j] = reason
        finally:
            for j in range(i, hi):  # a BaseException stopped the loop: the rest never ran
                failed.setdefault(j, "worker interrupted")
            self._chunk_done(state, lo, hi, failed)

    def _cancel(self, state: _JobState, lo: int, hi: int, error: str) -> None:
        self._chunk_done(state, lo, hi, dict.fromkeys(range(lo, hi), error))

    def _finish_now(self, state: _JobState, error: str) -> None:
        """Report a job that never reached the workers."""
        self._log.warning("job_failed", job_id=state.job.job_id, error=error)
        self._safe_report(JobResult(state.job.job_id, False, error))

    def _chunk_done(self, state: _JobState, lo: int, hi: int, failed: dict[int, str]) -> None:
        with self._lock:
            state.failed.update(failed)
            if state.pinned:
                self._pins.subtract(state.pinned[lo:hi])
                for key in state.pinned[lo:hi]:
                    if self._pins[key] <= 0:
                        del self._pins[key]
            state.remaining -= 1
            if state.remaining > 0:
                return
            result = state.result()
        try:
            if not result.success:
                self._log.warning("job_failed", job_id=state.job.job_id, error=result.error,
                                  promotion=state.job.is_promotion, keys=len(state.job.keys),
                                  failed_keys=len(state.job.keys) - len(result.successful_keys or ()))
            self._safe_report(result)
        finally:
            with self._lock:
                self._inflight.discard(state)
                if not self._inflight:
                    self._idle.notify_all()

    def _safe_report(self, result: JobResult) -> None:
        try:
            self.report(result)
        except Exception as exc:
            self._log.warning("report_failed", job_id=result.job_id, error=_describe(exc))

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
        assert self.pool is not None
        final = file_name(key)
        tmp = self._path(f"{TMP_PREFIX}{self._tmp_tag}-{next(self._tmp_seq)}")
        renamed = False
        try:
            payload = self._row(row)  # zero-copy view of the pinned row
            header = codec.encode_header(key, payload)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC, 0o600)
            try:
                _write_all(fd, header, payload)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
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

    def _fsync_dir(self) -> None:
        fd = os.open(self.root, os.O_RDONLY | _O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

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
            raise DiskTierError(f"block {key.hex()[:32]}: file is missing: {_describe(exc)}") from None
        except Exception as exc:
            # EIO, a directory or a symlink in the file's place, EACCES, ...: this block cannot be
            # read, and asking again would fail again: it leaves the tier.
            self._drop(key, entry)
            raise DiskTierError(f"block {key.hex()[:32]}: unreadable file {entry.name}: {_describe(exc)}") from None
        return False  # no file written

    def _row(self, row: int) -> memoryview:
        """A zero-copy view of pool row ``row``."""
        size = self._row_bytes
        return self._flat[row * size : (row + 1) * size]

    def _read_into(self, key: OffloadKey, row: int, entry: _Entry) -> None:
        block_bytes = self._row_bytes
        expected = codec.HEADER_SIZE + len(key) + block_bytes
        fd = os.open(self._path(entry.name), os.O_RDONLY | _O_CLOEXEC | _O_NOFOLLOW)
        try:
            head_size = codec.HEADER_SIZE + len(key)
            head = self._buffer(head_size + 1)
            # Straight into the pool row, checked there: no bounce buffer, and a
            # failed check fails the job, whose rows the runtime then discards.
            # One spare byte after the row tells a long file without an fstat.
            row_view = self._row(row)
            got = _read_full(fd, [head[:head_size], row_view, head[head_size:]], expected)
            if got != expected:
                raise codec.CorruptRecordError(f"file is {got}{'+' if got > expected else ''} bytes, "
                                               f"expected {expected}")
            codec.verify_split(head[:head_size], row_view, key, block_bytes)
        finally:
            os.close(fd)

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


def _write_all(fd: int, header: bytes, payload: memoryview) -> None:
    total = len(header) + payload.nbytes
    done = os.writev(fd, [header, payload])
    if done == total:
        return
    # Short write (rare on regular files): finish with plain writes.
    rest = memoryview(header + bytes(payload))[done:]
    while rest:
        n = os.write(fd, rest)
        if n <= 0:
            raise OSError(f"write returned {n}")
        rest = rest[n:]


def _read_full(fd: int, bufs: list[memoryview], need: int) -> int:
    """Read ``fd`` into ``bufs`` until at least ``need`` bytes came or the file ends; the bytes read.

    One ``readv`` when the file holds ``need`` bytes: a spare buffer beyond
    ``need`` catches a longer file without a second call to find the end.
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
