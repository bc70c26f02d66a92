"""The primary pool in shared memory, for vLLM's scheduler and worker sides.

vLLM builds the offloading spec separately for the scheduler (``get_manager``)
and for each worker (``get_worker``); with the multiprocess engine they are
different processes. Both open one file in ``/dev/shm`` named from the
engine's ``engine_id`` and map it shared, so the worker's copies land in the
rows the scheduler side's :class:`~kvactors.TieringManager` hands out (in one
process the two sides map the same file twice; the mappings are coherent).

Layout of the file: ``num_blocks * block_bytes`` pool bytes, then a status
table of ``num_blocks * num_writers`` bytes (one per pool row and worker
rank). A worker writes its rank's status byte of each row it stored into
(:data:`STORE_OK` or :data:`STORE_FAILED`) before it reports the job finished
to vLLM; the scheduler side marks the rows :data:`STORE_PENDING` when it
prepares a store and reads them when vLLM completes it (vLLM asserts that
every transfer succeeded, so this is how a failed copy reaches kvactors as
``success=False``). Whoever opens the file first creates it at its full
size; :meth:`SharedPool.close` with ``unlink=True`` removes it (the side that
created it does, and both sides also remove it at interpreter exit).
"""

from __future__ import annotations

import atexit
import contextlib
import mmap
import os
import re
import threading

import torch

from kvactors.core.arguments import check_int

STORE_PENDING = 0
STORE_OK = 1
STORE_FAILED = 2

SHM_DIR = "/dev/shm"

_open_paths: set[str] = set()
_open_lock = threading.Lock()


def pool_path(engine_id: str, directory: str = SHM_DIR) -> str:
    """The file of an engine's pool: ``kvactors_pool_<engine_id>`` (unsafe characters replaced)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", str(engine_id)) or "engine"
    return os.path.join(directory, f"kvactors_pool_{safe}")


def _unlink_all_at_exit() -> None:
    with _open_lock:
        paths = list(_open_paths)
        _open_paths.clear()
    for path in paths:
        with contextlib.suppress(OSError):
            os.unlink(path)


atexit.register(_unlink_all_at_exit)


def check_pool_fits(cpu_bytes: int, size: int, folder: str) -> None:
    """``ValueError`` naming ``cpu_bytes_to_use`` if the pool (a shared file in ``folder``, backed by
    memory) cannot fit: more than the machine's memory, or than ``folder`` has free."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else None
    if total is not None and size > total:
        raise ValueError(f"kvactors: cpu_bytes_to_use={cpu_bytes}: the pool needs {size} bytes, more than the "
                         f"machine's {total} bytes of memory")
    stat = os.statvfs(folder)
    free = stat.f_bavail * stat.f_frsize
    if size > free:
        raise ValueError(f"kvactors: cpu_bytes_to_use={cpu_bytes}: the pool needs {size} bytes of shared memory, "
                         f"{folder} has {free} free")


class SharedPool:
    """A shared mapping of the pool file: ``pool`` (``uint8 (num_blocks, block_bytes)``) and
    ``status`` (``uint8 (num_blocks, num_writers)``).

    Threading: the tensors may be used from any thread; the status protocol
    relies on each byte having one writer at a time (the scheduler side before
    the store is submitted, the worker of that rank until it reports the job).
    """

    def __init__(self, path: str, *, num_blocks: int, block_bytes: int, num_writers: int = 1) -> None:
        for label, value in (("num_blocks", num_blocks), ("block_bytes", block_bytes), ("num_writers", num_writers)):
            check_int(value, label)
        self.path = path
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.num_writers = num_writers
        pool_size = num_blocks * block_bytes
        size = pool_size + num_blocks * num_writers
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            current = os.fstat(fd).st_size
            self.created = current == 0
            if current not in (0, size):
                raise ValueError(f"{path} holds {current} bytes, expected {size}: another engine's pool?")
            if current == 0:
                os.ftruncate(fd, size)
            self._mmap = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            if getattr(self, "created", False):  # ours, and never mapped: nothing may keep it
                with contextlib.suppress(OSError):
                    os.unlink(path)
            raise
        finally:
            os.close(fd)
        with _open_lock:
            _open_paths.add(path)
        flat = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self.pool = flat[:pool_size].view(num_blocks, block_bytes)
        self.status = flat[pool_size:].view(num_blocks, num_writers)
        self._closed = False

    def mark_pending(self, rows: list[int] | tuple[int, ...]) -> None:
        if rows:
            self.status[list(rows)] = STORE_PENDING

    def mark(self, rows: list[int] | tuple[int, ...], rank: int, value: int) -> None:
        if rows:
            self.status[list(rows), rank] = value

    def stored_ok(self, row: int) -> bool:
        """True once every writer reported its bytes of ``row`` stored."""
        return bool((self.status[row] == STORE_OK).all())

    def close(self, *, unlink: bool) -> None:
        """Drop this mapping (the tensors must not be used after) and, with
        ``unlink``, remove the file. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if unlink:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            with _open_lock:
                _open_paths.discard(self.path)
        # The tensors still reference the buffer: drop them before closing the map.
        del self.pool, self.status
        with contextlib.suppress(BufferError):
            self._mmap.close()
