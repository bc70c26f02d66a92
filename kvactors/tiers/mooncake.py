"""``MooncakeTier``: a secondary tier on a Mooncake Store (kvcache-ai/Mooncake).

The store is shared by processes and machines.
"""

from __future__ import annotations

import contextlib
import importlib.util
import socket
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvactors.core.arguments import check_int, check_timeout
from kvactors.core.events import EventBuffer, warn_on_overflow
from kvactors.logs import component_logger
from kvactors.tiers import codec
from kvactors.tiers.base import ReportFn, SecondaryTier
from kvactors.tiers.mooncake_conn import Conn, thread_buffers
from kvactors.tiers.mooncake_store import (
    MIN_SEGMENT_BYTES,
    CallLane,
    LaneBusy,
    LaneTimeout,
    connect,
    master_answers,
    parse_master,
)
from kvactors.tiers.runner import JobRunner, Outcome, RunningJob
from kvactors.tiers.runner import describe as _describe
from kvactors.types import JobResult, LookupResult, OffloadingEvent, OffloadKey, ReqContext, TransferJob

OBJECT_NOT_FOUND = -704
"""Mooncake's code for a key it does not hold (never stored, evicted, or lost with its master)."""

_STAGE_BYTES = 8 << 20
"""Bytes a load chunk stages per call (a job larger than this runs as several chunks)."""


BUFFER_TOO_SMALL = -600
"""Mooncake's code (``INVALID_PARAMS``) for an object larger than the buffer it is read into."""


def _slot_bytes(keys: Sequence[OffloadKey], block_bytes: int) -> int:
    """Bytes of a staging buffer per record.

    That is the longest header and key plus the payload, rounded up to 64.
    """
    return -(-(codec.HEADER_SIZE + max(len(k) for k in keys) + block_bytes) // 64) * 64

LANE_EXTRA_THREADS = 2
"""Lane threads beyond ``io_workers``: for lookups, connecting and health checks."""


class MooncakeTier(SecondaryTier):
    """A tier on a Mooncake Store.

    The store is a master (``master``, ``host:port``) that keeps the metadata, and clients
    that contribute memory segments.
    This process is one such client.
    It contributes ``segment_bytes``.
    With 0 it contributes none, and other clients must then hold the data.

    Keys and records
        A block ``key`` is stored as the object ``namespace + ":" + key.hex()``.
        Its value is a :mod:`kvactors.tiers.codec` record: header, key, payload, and the XXH3-64 of key+payload.
        A load verifies the record.
        A missing, evicted, corrupt, foreign or empty object fails its key and never serves bytes.
        An object whose holder died reads as empty.
        A record of our size that fails verification is removed.
        One of another size is left alone.
        Stores and loads are zero-copy batch calls with per-key codes.
        A store is one ``batch_put_from_multi_buffers``.
        Each header comes from a registered staging buffer of the lane thread.
        Each payload comes straight from its row, which is registered and pinned.
        A row may be reused while a call that ran past its deadline still reads it.
        The record it makes then fails its checksum, which reads as a miss.
        A load is one ``batch_get_into`` into the staging buffer.
        Each record is verified there.
        It is copied into its row under the job's lock, only if the job has not been reported.
        So a load abandoned at its deadline never writes into rows that were given back.
        Jobs end per key.
        ``put`` of a key the store already holds keeps the old record.

    Bounds
        No Mooncake call runs on a kvactors thread.
        Each runs on the tier's *call lane*, ``io_workers + 2`` daemon threads
        (:class:`~kvactors.tiers.mooncake_store.CallLane`).
        Its caller waits at most ``timeout_s``.
        A call past it fails its job's keys, and a lookup answers ``RETRY``.
        The call is abandoned to its lane thread, which Mooncake gives back after its own 30-40 s.
        While every lane thread is held, calls are refused at once (a failed job, ``RETRY``).
        So a store that never answers holds at most ``io_workers + 2`` threads, whatever the traffic.
        The tier's ``io_workers`` job threads are never held past ``timeout_s``,
        plus the wait to connect, which is also ``timeout_s``.

    Connecting and degraded mode
        Constructing never contacts the store.
        :meth:`attach` starts connecting on a lane thread.
        ``setup()`` is only called once the master answers a probe
        (:func:`~kvactors.tiers.mooncake_store.master_answers`).
        The reason is that ``setup()`` retries for 90 s, holding the GIL, against a master that does not answer.
        A call that times out or fails with a connection code makes the tier check the master.
        The connection is retired if the master does not answer.
        It is also retired if this client's session is gone, which means the master restarted and every key is lost.
        After ``retry_after_s``, a new connection is set up the same way.
        Meanwhile jobs fail at once and lookups answer ``MISS``.

    Threading
        As for every ``SecondaryTier``.
        ``submit_store`` and ``submit_load`` return at once.
        The jobs run on ``io_workers`` threads named ``kvactors-mooncake-<name>-N``.
        ``lookup`` waits on the calling thread for at most ``2 * timeout_s``.
        Each job is reported exactly once.
        ``take_events`` is thread-safe.
    """

    max_inflight_jobs = 16
    inline_calls = frozenset(("submit_store", "submit_load", "touch"))
    medium = "STORAGE"
    locality = "REMOTE"

    def __init__(
        self,
        master: str,
        *,
        name: str = "mooncake",
        namespace: str = "kvactors",
        segment_bytes: int = 0,
        local_buffer_bytes: int = 64 << 20,
        timeout_s: float = 2.0,
        io_workers: int = 4,
        retry_after_s: float = 0.5,
        local_host: str | None = None,
    ) -> None:
        super().__init__(name=name)
        self._host, self._port = parse_master(master)
        if not isinstance(namespace, str) or not namespace:
            raise ValueError(f"namespace must be a non-empty str, got {namespace!r}")
        check_int(segment_bytes, "segment_bytes", minimum=0)
        if 0 < segment_bytes < MIN_SEGMENT_BYTES:
            raise ValueError(f"segment_bytes must be 0 or at least {MIN_SEGMENT_BYTES} (16 MiB, Mooncake's "
                             f"minimum), got {segment_bytes}")
        check_int(local_buffer_bytes, "local_buffer_bytes", minimum=1 << 20)
        check_timeout(timeout_s, "timeout_s", allow_none=False, allow_zero=False)
        check_int(io_workers, "io_workers")
        check_timeout(retry_after_s, "retry_after_s", allow_none=False)
        if local_host is not None and (not isinstance(local_host, str) or not local_host):
            raise ValueError(f"local_host must be a non-empty str or None, got {local_host!r}")
        if importlib.util.find_spec("mooncake") is None:
            raise ImportError("MooncakeTier needs Mooncake: pip install 'kvactors[mooncake]' "
                              "(and libibverbs1, which its binaries link to)")
        self.master = master
        self.namespace = namespace
        self.segment_bytes = segment_bytes
        self.local_buffer_bytes = local_buffer_bytes
        self.timeout_s = float(timeout_s)
        self.retry_after_s = float(retry_after_s)
        self.io_workers = io_workers
        self.local_host = local_host
        self._prefix = namespace + ":"
        self._log = component_logger("tiers.mooncake", tier=name)
        self._lock = threading.Lock()
        self._events = EventBuffer(name, on_overflow=warn_on_overflow(self._log))
        self._lane = CallLane(threads=io_workers + LANE_EXTRA_THREADS, thread_name=f"kvactors-mooncake-call-{name}")
        self._runner = JobRunner(name=name, workers=io_workers, thread_name=f"kvactors-mooncake-{name}",
                                 report=self.report, log=self._log, emit=self._record)
        # Connection state, under _lock.
        self._conn: Conn | None = None
        self._retired: list[Conn] = []  # given up, not closed (see _retire)
        self._generation = 0
        self._connecting: threading.Event | None = None  # set when the attempt ended
        self._down_until = 0.0
        self._degraded = False
        self._checking = False

    @property
    def max_stuck_threads(self) -> int:
        """The most threads a store that never answers can hold, which is the call lane's size."""
        return self._lane.threads

    def object_key(self, key: OffloadKey) -> str:
        """The Mooncake object a block is stored as: ``namespace:`` + hex of ``key``."""
        return self._prefix + key.hex()

    # ------------------------------------------------------------- lifecycle

    def attach(self, pool: torch.Tensor, report: ReportFn) -> None:
        if pool.dtype != torch.uint8 or pool.dim() != 2 or pool.device.type != "cpu":
            raise ValueError(f"pool must be a 2-D uint8 CPU tensor, got {pool.dtype} {tuple(pool.shape)}")
        if not pool.is_contiguous():
            raise ValueError("pool must be contiguous")
        super().attach(pool, report)
        self._pool_np = pool.numpy()
        self._connection(wait=0.0)  # starts connecting in the background

    def drain(self, timeout: float | None) -> None:
        """Wait until every submitted job has been reported, or ``timeout`` passed."""
        self._runner.drain(timeout)

    def shutdown(self) -> None:
        """Drain, report what is left as failed, stop the lane, then close the connections. Idempotent.

        The drain lasts up to ``timeout_s``.
        Every job still unreported is then reported as failed.
        Stopping the lane waits up to ``timeout_s`` for its calls.
        The calls still stuck are left to their daemon threads, and logged.
        The connections, current and retired, are closed if the master answers.
        Mooncake's ``close`` holds the GIL while it unmounts this process' segment.
        That takes about 1-2 s with a live master, 11 s with a dead one, and 60 s with a frozen one.
        So with a master that does not answer, the connections are left open and kept referenced
        until the process' exit (``connections_left_open``).
        """
        if self._runner.closed:
            return
        self._runner.shutdown(self.timeout_s, abandon="tier shut down")
        stuck = self._lane.close(self.timeout_s)
        if stuck:
            self._log.warning("calls_abandoned", threads=stuck)
        with self._lock:
            conns = [*self._retired, *([self._conn] if self._conn is not None else [])]
            self._conn, self._retired = None, []
        if not conns:
            return
        if stuck or not master_answers(self._host, self._port, self.timeout_s):
            _LEFT_OPEN.extend(conns)
            self._log.warning("connections_left_open", connections=len(conns), master=self.master)
            return
        for conn in conns:
            with contextlib.suppress(Exception):
                conn.store.close()

    # ---------------------------------------------------------------- lookup

    def lookup(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[LookupResult]:
        """``HIT`` or ``MISS`` per key from one ``batch_is_exist``.

        The call is waited for at most ``timeout_s``, plus as much to connect.
        Every key is ``RETRY`` when the store does not answer in time or the lane is full.
        Every key is ``MISS`` while the tier is degraded.
        Never raises.
        An object whose holder just died may still be a ``HIT`` for the master's ``client_ttl``.
        Its load then fails, and the key is forgotten.
        """
        n = len(keys)
        if n == 0:
            return []
        conn = self._connection(wait=self.timeout_s)
        if conn is None:
            return [LookupResult.MISS] * n
        names = [self.object_key(k) for k in keys]

        def exist() -> list[int]:
            return list(conn.store.batch_is_exist(names))

        try:
            codes = self._lane.call(exist, self.timeout_s)
        except (LaneTimeout, LaneBusy) as exc:
            self._suspect(conn, exc)
            self._log.warning("lookup_failed", req_id=ctx.req_id, keys=n, error=_describe(exc))
            return [LookupResult.RETRY] * n
        except Exception as exc:
            self._suspect(conn, exc)
            self._log.warning("lookup_failed", req_id=ctx.req_id, keys=n, error=_describe(exc))
            return [LookupResult.MISS] * n
        if any(code < 0 for code in codes):
            self._suspect(conn, f"batch_is_exist codes {sorted(set(codes))}")
        return [LookupResult.HIT if code == 1 else LookupResult.MISS for code in codes]

    # ----------------------------------------------------------------- jobs

    def submit_store(self, job: TransferJob) -> None:
        """Store ``pool[job.block_ids]`` under ``job.keys``. Returns at once.

        Each chunk of at most 8 MiB is one ``batch_put_from_multi_buffers``.
        Reports exactly once, per key.
        """
        self._submit(job, self._store_chunk)

    def submit_load(self, job: TransferJob) -> None:
        """Load ``job.keys`` into ``pool[job.block_ids]``. Returns at once.

        The records are read by ``batch_get_into`` into a staging buffer, and each is verified.
        Reports exactly once, per key.
        A missing, evicted, unreadable or corrupt block fails its key, and its row is not written.
        """
        self._submit(job, self._load_chunk)

    def take_events(self) -> list[OffloadingEvent]:
        """Blocks stored or removed by this tier since the last call. Thread-safe."""
        with self._lock:
            return self._events.take()

    def _record(self, events: Sequence[OffloadingEvent]) -> None:
        with self._lock:
            for event in events:
                self._events.add(event.keys, event.removed)

    def _submit(self, job: TransferJob, chunk: Callable[[Conn, RunningJob, int, int], Outcome]) -> None:
        if self.pool is None:
            self._runner.fail(job, "tier is not attached")
        elif self._runner.closed:
            self._runner.fail(job, "tier shut down")
        elif len(job.keys) != len(job.block_ids):
            self._runner.fail(job, f"{len(job.keys)} keys for {len(job.block_ids)} rows")
        elif not job.keys:
            self._runner.finish(JobResult(job.job_id, True, None), job)
        elif self._backing_off():
            self._runner.fail(job, "unavailable: store unreachable, retrying later")
        else:
            per_chunk = max(1, _STAGE_BYTES // self.block_bytes)
            chunks = -(-len(job.keys) // per_chunk)
            if not self._runner.submit(job, lambda running, lo, hi: self._run_chunk(chunk, running, lo, hi),
                                       chunks=chunks):
                self._runner.fail(job, "tier shut down")

    def _run_chunk(self, chunk: Callable[[Conn, RunningJob, int, int], Outcome], state: RunningJob,
                   lo: int, hi: int) -> Outcome:
        """Run one chunk's call on the lane and wait for it at most ``timeout_s``. Runs on a job thread."""
        conn = self._connection(wait=self.timeout_s)
        if conn is None:
            return _fail_all(lo, hi, "unavailable: store unreachable")

        try:
            return self._lane.call(lambda: chunk(conn, state, lo, hi), self.timeout_s)
        except LaneBusy as exc:
            return _fail_all(lo, hi, f"store busy: {exc}")
        except LaneTimeout as exc:
            self._suspect(conn, exc)
            return _fail_all(lo, hi, f"timed out: {exc}")
        except Exception as exc:
            self._suspect(conn, exc)
            return _fail_all(lo, hi, _describe(exc))

    def _store_chunk(self, conn: Conn, state: RunningJob, lo: int, hi: int) -> Outcome:
        """Store keys ``lo:hi`` (each key once) with one ``batch_put_from_multi_buffers``. Runs on a lane thread.

        Each record's header and key come from this thread's staging buffer.
        Its payload comes straight from the pool's row, which is registered.
        """
        job = state.job
        pool = self._pool_np
        block_bytes = pool.shape[1]
        first: dict[OffloadKey, int] = {}
        for i in range(lo, hi):
            first.setdefault(job.keys[i], i)
        keys = list(first)
        slot = _slot_bytes(keys, 0)
        stage = thread_buffers(conn, len(keys) * slot)
        base, pool_base = stage.ctypes.data, pool.ctypes.data
        names, ptrs, sizes = [], [], []
        with state.lock:
            if state.reported:
                return Outcome()
            for j, key in enumerate(keys):
                row = job.block_ids[first[key]]
                head = codec.encode_header(key, pool[row].data)
                start = j * slot
                stage[start:start + len(head)] = np.frombuffer(head, dtype=np.uint8)
                names.append(self.object_key(key))
                ptrs.append([base + start, pool_base + row * block_bytes])
                sizes.append([len(head), block_bytes])
        # The rows stay pinned until the report. If the job is reported first (this call ran
        # past timeout_s) and a row is reused while Mooncake still reads it, the record stored
        # fails its checksum when loaded: a miss, never data.
        codes = conn.store.batch_put_from_multi_buffers(names, ptrs, sizes)
        failed: dict[OffloadKey, str] = {}
        for key, code in zip(keys, codes, strict=True):
            if code != 0:
                failed[key] = f"put failed: code {code}"
        stored = [key for key in keys if key not in failed]
        events = [OffloadingEvent(keys=tuple(stored), tier=self.name, removed=False)] if stored else []
        if failed:
            self._suspect(conn, next(iter(failed.values())))
            return Outcome(_positions(job.keys, lo, hi, failed),
                           f"{len(failed)} of {len(keys)} blocks not stored ({next(iter(failed.values()))})", events)
        return Outcome(events=events)

    def _load_chunk(self, conn: Conn, state: RunningJob, lo: int, hi: int) -> Outcome:
        """Load keys ``lo:hi`` (each key once) into this thread's staging buffer. Runs on a lane thread.

        One ``batch_get_into`` reads them.
        Each record is verified, and the good ones are copied into their rows.
        """
        job = state.job
        pool = self._pool_np
        block_bytes = pool.shape[1]
        rows_of: dict[OffloadKey, list[int]] = {}
        for i in range(lo, hi):
            rows_of.setdefault(job.keys[i], []).append(job.block_ids[i])
        keys = list(rows_of)
        slot = _slot_bytes(keys, block_bytes)
        stage = thread_buffers(conn, len(keys) * slot)
        base = stage.ctypes.data
        head_sizes = [codec.HEADER_SIZE + len(key) for key in keys]
        codes = conn.store.batch_get_into([self.object_key(key) for key in keys],
                                          [base + j * slot for j in range(len(keys))],
                                          [head_size + block_bytes for head_size in head_sizes])
        good: list[tuple[int, int]] = []  # (payload offset in stage, pool row)
        missing: dict[OffloadKey, str] = {}
        bad: dict[OffloadKey, str] = {}  # our size, failed verification: removed
        foreign: dict[OffloadKey, str] = {}
        unavailable: dict[OffloadKey, str] = {}
        for j, (key, code, head_size) in enumerate(zip(keys, codes, head_sizes, strict=True)):
            start = j * slot
            if code == head_size + block_bytes:
                try:
                    codec.verify_split(stage[start:start + head_size].data,
                                       stage[start + head_size:start + head_size + block_bytes].data, key,
                                       block_bytes)
                except codec.CorruptRecordError as exc:
                    bad[key] = f"corrupt: {exc}"
                else:
                    good.extend((start + head_size, row) for row in rows_of[key])
            elif code == OBJECT_NOT_FOUND:
                missing[key] = "missing"
            elif code >= 0 or code == BUFFER_TOO_SMALL:  # not a record of ours: a miss, left alone
                foreign[key] = f"foreign object: code {code}, expected {head_size + block_bytes} bytes"
            else:
                unavailable[key] = f"get failed: code {code}"
        with state.lock:
            if state.reported:  # timed out meanwhile: its rows are no longer ours
                return Outcome()
            for offset, row in good:
                pool[row] = stage[offset:offset + block_bytes]
        if not missing and not bad and not foreign and not unavailable:
            return Outcome()
        removed = self._remove(conn, list(bad)) if bad else []
        if unavailable:
            self._suspect(conn, next(iter(unavailable.values())))
        failed = missing | bad | foreign | unavailable
        parts = []
        for what, group in (("missing", missing), ("corrupt", bad), ("foreign", foreign),
                            ("unavailable", unavailable)):
            if group:
                parts.append(f"{what}: {len(group)} blocks ({next(iter(group.values()))})")
        events = [OffloadingEvent(keys=tuple(removed), tier=self.name, removed=True)] if removed else []
        return Outcome(_positions(job.keys, lo, hi, failed), "; ".join(parts), events)

    def _remove(self, conn: Conn, keys: list[OffloadKey]) -> list[OffloadKey]:
        """Remove objects that are not our records, best effort. Returns the keys removed."""
        try:
            codes = conn.store.batch_remove([self.object_key(k) for k in keys], True)
        except Exception as exc:
            self._log.warning("forget_failed", keys=len(keys), error=_describe(exc))
            return []
        return [key for key, code in zip(keys, codes, strict=False) if code == 0]

    # ------------------------------------------------------- connection

    def _backing_off(self) -> bool:
        return self._degraded and time.monotonic() < self._down_until

    def _connection(self, wait: float) -> Conn | None:
        """The connection, or ``None`` while degraded.

        It starts connecting when none is up and the back-off is over.
        It waits up to ``wait`` seconds for that attempt.
        """
        with self._lock:
            conn, attempt = self._conn, self._connecting
            if conn is not None:
                return conn
            if attempt is None and not self._runner.closed and not self._backing_off() and self.pool is not None:
                attempt = self._connecting = threading.Event()
                try:
                    self._lane.submit(lambda: self._connect(attempt))
                except LaneBusy:
                    self._connecting = None
                    return None
        if attempt is None:
            return None
        if wait > 0:
            attempt.wait(wait)
        with self._lock:
            return self._conn

    def _connect(self, attempt: threading.Event) -> None:
        """Probe the master, then set a client up. Runs on a lane thread."""
        conn: Conn | None = None
        error: BaseException | None = None
        was_degraded = False
        try:
            local = self.local_host or _local_address(self._host, self._port)
            store = connect(self._host, self._port, segment_bytes=self.segment_bytes,
                            local_buffer_bytes=self.local_buffer_bytes, local_host=local, timeout_s=self.timeout_s)
            pool = self._pool_np  # stores send their payloads straight from the rows
            code = store.register_buffer(pool.ctypes.data, pool.nbytes)
            if code != 0:
                store.close()
                raise OSError(f"mooncake register_buffer (the pool) failed: code {code}")
            with self._lock:
                self._generation += 1
                conn = Conn(store, self._generation)
        except Exception as exc:
            error = exc
        with self._lock:
            self._connecting = None
            if conn is not None and not self._runner.closed:
                self._conn = conn
                was_degraded, self._degraded = self._degraded, False
            else:
                was_degraded, self._degraded = self._degraded, True
                self._down_until = time.monotonic() + self.retry_after_s
        attempt.set()
        if conn is not None and self._runner.closed:
            _LEFT_OPEN.append(conn)  # set up while shutting down: never closed (see shutdown)
        elif conn is not None and was_degraded:
            self._log.info("tier_recovered", master=self.master, generation=conn.generation)
        elif conn is not None:
            self._log.info("tier_connected", master=self.master, generation=conn.generation)
        elif was_degraded:  # a warning once, then at debug while the store stays away
            self._log.debug("connect_failed", master=self.master, error=_describe(error or RuntimeError()))
        else:
            self._log.warning("connect_failed", master=self.master, error=_describe(error or RuntimeError()))

    def _suspect(self, conn: Conn, why: BaseException | str) -> None:
        """Check the master after a call failed in a way the master may be behind.

        The check runs on the lane, one check at a time.
        If the master does not answer, or this client's session is gone, the connection is retired.
        """
        with self._lock:
            if self._checking or self._conn is not conn:
                return
            self._checking = True
        try:
            self._lane.submit(lambda: self._check(conn, why))
        except LaneBusy:
            self._retire(conn, f"store stuck ({why if isinstance(why, str) else _describe(why)})")
            with self._lock:
                self._checking = False

    def _check(self, conn: Conn, why: BaseException | str) -> None:
        try:
            if not master_answers(self._host, self._port, self.timeout_s):
                self._retire(conn, "master does not answer")
                return
            health = conn.store.health_check()
            if health != 0:
                self._retire(conn, f"client unhealthy (health_check {health}): master restarted?")
        except Exception as exc:
            self._retire(conn, f"health check failed: {_describe(exc)}")
        finally:
            with self._lock:
                self._checking = False

    def _retire(self, conn: Conn, why: str) -> None:
        """Give the connection up.

        It is kept, not closed, because Mooncake's ``close`` holds the GIL for seconds.
        Against a frozen master it holds it for a minute.
        :meth:`shutdown` closes it if it can.
        """
        with self._lock:
            if self._conn is not conn:
                return
            self._conn = None
            self._retired.append(conn)
            self._degraded = True
            self._down_until = time.monotonic() + self.retry_after_s
        self._log.warning("tier_degraded", master=self.master, error=why)


_LEFT_OPEN: list[Conn] = []
"""Connections never closed (see :meth:`MooncakeTier.shutdown`): referenced here so that no
destructor runs ``close`` (and holds the GIL) while the process serves."""


def _fail_all(lo: int, hi: int, why: str) -> Outcome:
    return Outcome(dict.fromkeys(range(lo, hi), why), why)


def _positions(keys: Sequence[OffloadKey], lo: int, hi: int, failed: dict[OffloadKey, str]) -> dict[int, str]:
    """``{position: why}`` for the keys of ``lo:hi`` that failed (every place of a repeated key)."""
    return {i: failed[keys[i]] for i in range(lo, hi) if keys[i] in failed}


def _local_address(host: str, port: int) -> str:
    """The address this machine reaches ``host`` from (what peers connect to for our segment)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, port))  # no packet is sent
            return str(probe.getsockname()[0])
    except OSError:
        return "127.0.0.1"

