"""The primary pool in shared memory, for vLLM's scheduler and worker sides.

vLLM builds the offloading spec separately for the scheduler (``get_manager``) and for each worker (``get_worker``).
With the multiprocess engine they are different processes.
Both open one file in ``/dev/shm`` named from the engine's ``engine_id``, and map it shared.
So the worker's copies land in the rows the scheduler side's :class:`~kvactors.TieringManager` hands out.
In one process the two sides map the same file twice, and the mappings are coherent.

Layout of the file:

* ``num_blocks * block_bytes`` pool bytes;
* a status table of ``num_blocks * num_writers`` bytes, one per pool row and worker rank;
* one byte per participant.

A worker writes its rank's status byte of each row it stored into (:data:`STORE_OK` or :data:`STORE_FAILED`).
It does so before it reports the job finished to vLLM.
The scheduler side marks the rows :data:`STORE_PENDING` when it prepares a store.
It reads them when vLLM completes the store.
vLLM asserts that every transfer succeeded.
So this is how a failed copy reaches kvactors as ``success=False``.

The file lives exactly as long as the engine.

* **Unlinked once mapped.**
  Every process that maps it sets its byte of the participant table.
  Those processes (``participants``) are the scheduler side and each worker rank.
  The one that finds every byte set removes the name.
  A watcher thread of each one that was not last tries again until then.
  From then on nothing of the pool is in ``/dev/shm``.
  The memory is the kernel's until the last mapping goes, whatever ends the processes
  (a clean stop, SIGTERM, SIGKILL, the OOM killer).
* **Reclaimed at the next start.**
  Each process holds a shared ``flock`` on the file while it maps it.
  The kernel drops the lock when the process dies, however it dies.
  Opening a pool first removes every ``kvactors_pool_*`` file of the folder that nobody holds.
  Such a file is left by an engine killed before all its processes had mapped it.
  A file is created under a temporary name, locked and sized, and only then linked under its name.
  So a file with the name always has a live holder, or a dead one and is then stale.
* :meth:`SharedPool.close` with ``unlink=True`` removes it too, if it is still there and still this file.
  So does the interpreter's exit.

A process that opens the pool after every participant mapped it and the name was removed
would create a new, unrelated file.
The participants are the engine's scheduler side and its ``world_size`` worker ranks, each opened once.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import mmap
import os
import re
import threading
import time
import uuid

import torch

from kvactors.core.arguments import check_int
from kvactors.logs import component_logger

STORE_PENDING = 0
STORE_OK = 1
STORE_FAILED = 2

SHM_DIR = "/dev/shm"
POOL_PREFIX = "kvactors_pool_"
_TMP_PREFIX = ".kvactors_tmp_"
#: How long a participant that was not the last to map the pool watches for the others.
#: After that, the name stays until :meth:`SharedPool.close`, the interpreter's exit or the next start's reclaim.
WATCH_S = 3600.0
#: How long taking the shared lock of a pool file may take (a reclaim holds it exclusively for a moment).
LOCK_WAIT_S = 5.0

_open_paths: dict[str, tuple[int, int]] = {}  # path -> (st_dev, st_ino) of the file this process opened
_open_lock = threading.Lock()
_log = component_logger("vllm")  # stdlib "kvactors.vllm"; events in kvactors.log_schema


def pool_path(engine_id: str, directory: str = SHM_DIR) -> str:
    """The file of an engine's pool, ``kvactors_pool_<engine_id>``.

    Unsafe characters of the id are replaced.
    """
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", str(engine_id)) or "engine"
    return os.path.join(directory, f"{POOL_PREFIX}{safe}")


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _unlink_if(path: str, ident: tuple[int, int]) -> bool:
    """Remove ``path`` if it is still the file ``ident``.

    Returns True if it was removed.
    """
    try:
        if _identity(os.stat(path, follow_symlinks=False)) != ident:
            return False
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def _unlink_all_at_exit() -> None:
    with _open_lock:
        paths = list(_open_paths.items())
        _open_paths.clear()
    for path, ident in paths:
        with contextlib.suppress(OSError):
            _unlink_if(path, ident)


atexit.register(_unlink_all_at_exit)


def reclaim_stale(directory: str = SHM_DIR) -> list[str]:
    """Remove the pool files of ``directory`` that no live process holds. Returns the paths removed.

    Their engine died before every process had mapped them.
    """
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if not (name.startswith(POOL_PREFIX) or name.startswith(_TMP_PREFIX)):
            continue
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:  # gone, or another user's
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if _unlink_if(path, _identity(os.fstat(fd))):
                removed.append(path)
                _log.warning("pool_reclaimed", path=path)
        except OSError:  # held: a live engine's
            pass
        finally:
            os.close(fd)
    return removed


def pool_file_size(num_blocks: int, block_bytes: int, num_writers: int = 1, participants: int | None = None) -> int:
    """The bytes of a pool file (see the module docstring).

    They are the pool, the status table and the participants.
    """
    return num_blocks * block_bytes + num_blocks * num_writers + (participants or 0)


def _lock_shared(fd: int, path: str) -> None:
    """Share-lock ``fd``, the pool file ``path``, within :data:`LOCK_WAIT_S`.

    Raises ``TimeoutError`` naming the file if the lock does not come.
    """
    deadline = time.monotonic() + LOCK_WAIT_S
    delay = 0.005
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"kvactors: could not take the shared lock of the pool file {path} within "
                               f"{LOCK_WAIT_S}s: another process holds it exclusively")
        time.sleep(min(delay, left))
        delay = min(delay * 2, 0.1)


def check_pool_fits(cpu_bytes: int, size: int, folder: str) -> None:
    """Raise ``ValueError`` naming ``cpu_bytes_to_use`` if the pool cannot fit.

    The pool is a shared file in ``folder``, backed by memory.
    It cannot fit when it is larger than the machine's memory, or than what ``folder`` has free.
    """
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else None
    if total is not None and size > total:
        raise ValueError(f"kvactors: cpu_bytes_to_use={cpu_bytes}: the pool needs {size} bytes, more than the "
                         f"machine's {total} bytes of memory")
    stat = os.statvfs(folder)
    free = stat.f_bavail * stat.f_frsize
    if size > free:
        raise ValueError(f"kvactors: cpu_bytes_to_use={cpu_bytes}: the pool needs {size} bytes of shared memory, "
                         f"{folder} has {free} free (in a container: docker run --shm-size, or --ipc=host)")


def _create(path: str, size: int) -> int | None:
    """A new pool file at ``path``, sized and share-locked before it gets its name.

    Returns its fd, or None if another process linked one first.
    """
    tmp = os.path.join(os.path.dirname(path), f"{_TMP_PREFIX}{os.getpid()}_{uuid.uuid4().hex}")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        _lock_shared(fd, path)
        os.ftruncate(fd, size)
        os.link(tmp, path)
    except FileExistsError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return fd


def _open_locked(path: str, size: int) -> tuple[int, bool]:
    """The pool file at ``path``, created if missing and share-locked.

    Returns ``(fd, created)``.
    """
    for _ in range(100):
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:
            try:
                created = _create(path, size)
            except FileNotFoundError:  # the temporary file was reclaimed under us: again
                continue
            if created is None:
                continue
            return created, True
        try:
            _lock_shared(fd, path)
            if _identity(os.fstat(fd)) == _identity(os.stat(path, follow_symlinks=False)):
                return fd, False
        except FileNotFoundError:
            pass
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # reclaimed or replaced between the open and the lock: again
    raise OSError(f"kvactors: could not open the pool {path}: it kept being replaced")


class SharedPool:
    """A shared mapping of the pool file.

    ``pool`` is ``uint8 (num_blocks, block_bytes)``.
    ``status`` is ``uint8 (num_blocks, num_writers)``.

    ``participants`` is how many processes map this pool: the scheduler side and every worker rank.
    This process is ``slot``.
    Once all have mapped it, the file's name is removed (see the module docstring).
    With ``None``, the name stays until :meth:`close` with ``unlink=True``, or the interpreter's exit.

    Threading: the tensors may be used from any thread.
    The status protocol relies on each byte having one writer at a time.
    The writer is the scheduler side before the store is submitted.
    It is the worker of that rank from then until it reports the job.
    """

    def __init__(self, path: str, *, num_blocks: int, block_bytes: int, num_writers: int = 1,
                 participants: int | None = None, slot: int = 0) -> None:
        for label, value in (("num_blocks", num_blocks), ("block_bytes", block_bytes), ("num_writers", num_writers)):
            check_int(value, label)
        if participants is not None:
            check_int(participants, "participants")
        check_int(slot, "slot", minimum=0, maximum=None if participants is None else participants - 1)
        self.path = path
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.num_writers = num_writers
        self.participants = participants
        self.slot = slot
        pool_size = num_blocks * block_bytes
        table = num_blocks * num_writers
        size = pool_file_size(num_blocks, block_bytes, num_writers, participants)
        reclaim_stale(os.path.dirname(path) or ".")
        fd, self.created = _open_locked(path, size)
        ident: tuple[int, int] | None = None
        try:
            ident = _identity(os.fstat(fd))
            current = os.fstat(fd).st_size
            if current != size:
                raise ValueError(f"{path} holds {current} bytes, expected {size}: another engine's pool?")
            self._mmap = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            self._fd = fd  # holds the shared lock: this pool is alive while the fd is open
            self._ident = ident
            with _open_lock:
                _open_paths[path] = ident
            flat = torch.frombuffer(self._mmap, dtype=torch.uint8)
            self.pool = flat[:pool_size].view(num_blocks, block_bytes)
            self.status = flat[pool_size:pool_size + table].view(num_blocks, num_writers)
            self._members = flat[pool_size + table:]
            del flat
            self._lock = threading.Lock()
            self._closed = False
            self.unlinked = False
            if participants is not None:
                self._members[slot] = 1
                if not self._unlink_if_all_mapped():
                    threading.Thread(target=self._watch, name="kvactors-vllm-pool-watch", daemon=True).start()
        except BaseException:
            self._abandon(fd, ident)
            raise

    def _abandon(self, fd: int, ident: tuple[int, int] | None) -> None:
        """Undo a construction that raised.

        It removes the name, if this one created the file, which it then never used.
        It drops the entry in ``_open_paths``, the tensors, the map and the fd.
        """
        if ident is not None:
            if self.created:
                with contextlib.suppress(OSError):
                    _unlink_if(self.path, ident)
            with _open_lock:
                if _open_paths.get(self.path) == ident:
                    del _open_paths[self.path]
        for name in ("pool", "status", "_members"):
            self.__dict__.pop(name, None)
        mapping = self.__dict__.pop("_mmap", None)
        if mapping is not None:
            with contextlib.suppress(BufferError):
                mapping.close()
        with contextlib.suppress(OSError):
            os.close(fd)

    # ------------------------------------------------------------ the file's name

    def _unlink_if_all_mapped(self) -> bool:
        """Remove the name once every participant mapped the pool.

        Returns True once it is gone.
        """
        with self._lock:
            if self._closed or self.unlinked:
                return True
            if not bool((self._members == 1).all()):
                return False
            self.unlinked = True
        with contextlib.suppress(OSError):
            _unlink_if(self.path, self._ident)
        with _open_lock:
            if _open_paths.get(self.path) == self._ident:
                del _open_paths[self.path]
        return True

    def _watch(self) -> None:
        deadline = time.monotonic() + WATCH_S
        delay = 0.01
        while time.monotonic() < deadline:
            time.sleep(delay)
            if self._unlink_if_all_mapped():
                return
            delay = min(delay * 2, 1.0)

    # ------------------------------------------------------------ the status table

    def mark_pending(self, rows: list[int] | tuple[int, ...]) -> None:
        if rows:
            self.status[list(rows)] = STORE_PENDING

    def mark(self, rows: list[int] | tuple[int, ...], rank: int, value: int) -> None:
        if rows:
            self.status[list(rows), rank] = value

    def stored_ok(self, row: int) -> bool:
        """True once every writer reported its bytes of ``row`` stored."""
        return bool((self.status[row] == STORE_OK).all())

    def copy_ended(self, row: int) -> bool:
        """True once every writer reported its copy into ``row`` ended, stored or failed."""
        return bool((self.status[row] != STORE_PENDING).all())

    def close(self, *, unlink: bool) -> None:
        """Drop this mapping (the tensors must not be used after) and, with
        ``unlink``, remove the file (if its name is still this file's). Safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if unlink:
            with contextlib.suppress(OSError):
                _unlink_if(self.path, self._ident)
            with _open_lock:
                if _open_paths.get(self.path) == self._ident:
                    del _open_paths[self.path]
        with contextlib.suppress(OSError):
            os.close(self._fd)
        # The tensors still reference the buffer: drop them before closing the map.
        del self.pool, self.status, self._members
        with contextlib.suppress(BufferError):
            self._mmap.close()
