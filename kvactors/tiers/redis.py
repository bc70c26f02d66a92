"""``RedisTier``: a secondary tier on a Redis server shared by processes and machines."""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Sequence

import redis
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvactors.core.arguments import check_flag, check_int, check_timeout
from kvactors.core.events import EventBuffer, warn_on_overflow
from kvactors.logs import component_logger
from kvactors.tiers import redis_cluster as rc
from kvactors.tiers.base import ReportFn, SecondaryTier
from kvactors.tiers.redis_jobs import EVICT_LUA, RedisJobs
from kvactors.tiers.runner import JobRunner, Outcome, RunningJob
from kvactors.tiers.runner import describe as _describe
from kvactors.types import JobResult, LookupResult, OffloadingEvent, OffloadKey, ReqContext, TransferJob

# Bytes read per recv: blocks are large (hundreds of KiB), so fewer, larger reads.
_SOCKET_READ_SIZE = 1 << 20

class RedisTier(RedisJobs, SecondaryTier):
    """A tier on a Redis server, shared by any number of processes and machines.

    Connection
        ``url`` is passed to ``redis.Redis.from_url``.
        TCP takes ``redis://[[user]:password@]host:port/db``.
        TLS takes ``rediss://...``, with certificate options as query parameters,
        e.g. ``?ssl_cert_reqs=required&ssl_ca_certs=/path/ca.pem``.
        A Unix socket takes ``unix:///path.sock?db=0``.
        Authentication and TLS therefore need nothing beyond the URL.
        Every socket operation (connect and read/write) is bounded by ``timeout_s``.
        redis-py's own retries are turned off, because the tier decides what a failure means.
        One connection pool of at most ``io_workers + 2`` connections is shared by the tier actor's thread
        (lookups) and ``io_workers`` I/O threads named ``kvactors-redis-<name>-N`` (stores, loads, touches).

    Degraded mode
        Constructing never contacts the server, so it never fails because the server is down.
        While the server cannot be reached, jobs are reported failed (``success=False``).
        Lookups then answer ``MISS``, or ``RETRY`` when the last attempt timed out rather than being refused.
        After a connection error or a timeout the tier does not try again for ``retry_after_s``.
        Meanwhile lookups answer at once and jobs fail at once.
        So a dead server does not cost a connect timeout on every call.
        After that, the next call tries again.
        The tier recovers by itself as soon as the server answers.

    Keys
        A block ``key`` (bytes) is stored under the Redis key ``namespace + ":" + key.hex()`` (ASCII).
        Hex keeps ``redis-cli`` output readable and makes namespaces disjoint.
        A block key's suffix never holds ``:``.
        So tenants with different namespaces never see each other's blocks, whatever the namespaces are.
        Values are :mod:`kvactors.tiers.codec` records: header, key, payload, and the XXH3-64 checksum of key+payload.
        A load verifies the record.
        A value that cannot be read fails its key and is deleted, so a later lookup misses.
        Such a value is a record that fails verification, a truncated value, or another Redis type at the key.
        Jobs end per key.
        A key whose value is missing or unreadable, or whose ``SET`` the server refuses, fails alone.
        The report names the keys that succeeded (``JobResult.successful_keys``).
        The events name exactly the keys stored.

    Capacity
        Redis is the authority.
        Run the server with ``maxmemory`` and ``maxmemory-policy allkeys-lru``
        (or ``volatile-lru``/``allkeys-lfu``) so that it evicts.
        A block evicted by Redis is simply a ``MISS``, or a failed load, never an exception.
        When ``capacity_bytes`` is given, the tier additionally bounds its namespace.
        Every block stored is recorded in the sorted set ``namespace + ":__lru__"``.
        Its member is the hex key.
        Its score is the wall-clock time of last use, refreshed by loads and :meth:`touch`.
        After a store, the set may hold more than ``capacity_bytes // record_size`` members.
        The oldest are then removed together with their blocks by one atomic Lua script.
        So any number of processes sharing the namespace enforce one bound.
        The accounting is approximate.
        Blocks that Redis evicted on its own stay counted until they are the oldest.
        The tier emits ``OffloadingEvent(removed=False)`` for the blocks it stores.
        It emits ``removed=True`` for the blocks it removes (capacity evictions, corrupt records).
        Evictions made by Redis itself are not seen.

    Cluster (``cluster=True``)
        ``url`` names any node of a Redis Cluster (``redis://`` or ``rediss://``, database 0).
        :mod:`kvactors.tiers.redis_cluster` keeps the topology (redis-py's ``RedisCluster``).
        It sends one pipeline per shard, and every shard is written before any is read.
        A block is stored under ``namespace:{tag}hex(key)``.
        The tag is the key's bucket, one of :data:`~kvactors.tiers.redis_cluster.BUCKETS` hash tags
        spread evenly over the slots.
        So the namespace may not contain ``{``.
        A shard that fails fails its keys only.
        It fails when it is down, timed out, or answers ``MOVED``/``ASK``/``TRYAGAIN``/``CLUSTERDOWN``.
        Lookups then answer ``MISS``, or ``RETRY`` for a timeout or a moving slot.
        Jobs end per key, and an unreachable value is never deleted.
        The failed node is skipped for ``retry_after_s``, and the topology is read again.
        So failovers and migrations heal by themselves.
        Degraded mode (above) covers a cluster of which no node answers.
        ``capacity_bytes`` is split over the buckets.
        Each bucket has its own LRU set ``namespace:{tag}__lru__`` in its slot.
        Each keeps ``capacity_bytes // record_size // BUCKETS`` blocks, at least one.

    Threading
        As for every ``SecondaryTier``, the methods are called on the tier actor's thread, one at a time.
        ``lookup`` is synchronous there.
        It makes one pipelined round trip, and each socket read is bounded by ``timeout_s``.
        ``submit_store``, ``submit_load`` and ``touch`` return at once, and the I/O runs on the I/O threads.
        Each job is reported exactly once, even when the worker raises or the tier shuts down.
        It is reported from an I/O thread, or from the calling thread when it fails before reaching one.
        After a job is reported the tier no longer reads or writes its pool rows.
        ``take_events`` is thread-safe.
    """

    max_inflight_jobs = 16
    # The I/O runs on the I/O threads; a lookup is a network round trip, not inline.
    inline_calls = frozenset(("submit_store", "submit_load", "touch"))
    hooks = frozenset(("touch",))  # on_new_request and on_request_finished are no-ops here
    medium = "STORAGE"
    locality = "REMOTE"  # Redis Cluster too (cluster=True)

    def __init__(
        self,
        url: str,
        *,
        name: str = "redis",
        namespace: str = "kvactors",
        capacity_bytes: int | None = None,
        timeout_s: float = 1.0,
        io_workers: int = 4,
        retry_after_s: float = 0.5,
        cluster: bool = False,
    ) -> None:
        super().__init__(name=name)
        _check_options(namespace, capacity_bytes, timeout_s, io_workers, retry_after_s, cluster)
        self.url = url
        self.namespace = namespace
        self.capacity_bytes = capacity_bytes
        self.timeout_s = float(timeout_s)
        self.retry_after_s = float(retry_after_s)
        self._prefix = namespace.encode() + b":"
        self._lru_key = self._prefix + b"__lru__"
        self._log = component_logger("tiers.redis", tier=name)
        self.cluster = bool(cluster)
        self._cluster: rc.ClusterClient | None = None
        # Sets the capacity is split over: one per namespace, or one per bucket on a cluster.
        self._lru_sets = rc.BUCKETS if cluster else 1
        if cluster:
            _check_cluster_url(url)
            self._cluster = rc.ClusterClient(
                url, timeout_s=self.timeout_s, retry_after_s=self.retry_after_s,
                max_connections=io_workers + 2, socket_read_size=_SOCKET_READ_SIZE,
            )
        # Raises only on a malformed URL (a configuration error), never on an
        # unreachable server: redis-py connects lazily. Unused on a cluster.
        self._client = redis.Redis.from_url(
            url,
            socket_timeout=self.timeout_s,
            socket_connect_timeout=self.timeout_s,
            socket_keepalive=True,
            socket_read_size=_SOCKET_READ_SIZE,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
            max_connections=io_workers + 2,
        )
        self._evict_script = self._client.register_script(EVICT_LUA)  # one server only

        self._lock = threading.Lock()
        self._events = EventBuffer(name, on_overflow=warn_on_overflow(self._log))
        self._runner = JobRunner(name=name, workers=io_workers, thread_name=f"kvactors-redis-{name}",
                                 report=self.report, log=self._log, emit=self._record, on_error=self._failed)
        # Degraded mode makes no server calls before _down_until (monotonic), and answers _down_answer.
        self._down_until = 0.0
        self._down_answer = LookupResult.MISS
        self._degraded = False

    # ------------------------------------------------------------------ keys

    def redis_key(self, key: OffloadKey) -> bytes:
        """The Redis key a block is stored under: ``namespace:`` + hex of ``key``.

        On a cluster it is ``namespace:{tag}`` + hex, the tag naming the key's bucket.
        """
        if self._cluster is not None:
            return rc.bucket_prefix(self._prefix, rc.bucket_of(key)) + key.hex().encode()
        return self._prefix + key.hex().encode()

    def _lru_groups(self, keys: Sequence[OffloadKey]) -> dict[bytes, tuple[bytes, list[OffloadKey]]]:
        """``{LRU set: (key prefix of its blocks, keys)}``.

        Without a cluster, it holds the namespace's one set.
        On a cluster, it holds one set per bucket, in the bucket's slot with its blocks.
        """
        if self._cluster is None:
            return {self._lru_key: (self._prefix, list(keys))}
        groups: dict[bytes, tuple[bytes, list[OffloadKey]]] = {}
        for key in keys:
            prefix = rc.bucket_prefix(self._prefix, rc.bucket_of(key))
            groups.setdefault(prefix + b"__lru__", (prefix, []))[1].append(key)
        return groups

    def _pipeline(self) -> redis.client.Pipeline | rc.ShardPipeline:
        """One server's pipeline, or one pipeline per shard on a cluster."""
        if self._cluster is not None:
            return self._cluster.pipeline()
        return self._client.pipeline(transaction=False)

    # ------------------------------------------------------------- lifecycle

    def attach(self, pool: torch.Tensor, report: ReportFn) -> None:
        if pool.dtype != torch.uint8 or pool.dim() != 2 or pool.device.type != "cpu":
            raise ValueError(f"pool must be a 2-D uint8 CPU tensor, got {pool.dtype} {tuple(pool.shape)}")
        if not pool.is_contiguous():
            raise ValueError("pool must be contiguous")
        super().attach(pool, report)

    def drain(self, timeout: float | None) -> None:
        """Wait until every submitted job (and touch) has finished, or ``timeout`` passed."""
        self._runner.drain(timeout)

    def shutdown(self) -> None:
        """Drain briefly (``timeout_s``), then report every job still unreported as failed.

        Each is reported exactly once, because queued jobs are cancelled.
        Then close the connections and join the I/O threads.
        Safe to call twice.
        """
        if self._runner.closed:
            return
        self._runner.shutdown(self.timeout_s, abandon="tier shut down", interrupt=self._disconnect)
        with contextlib.suppress(Exception):
            self._client.close()

    def _disconnect(self) -> None:
        """Wake workers blocked on a socket (shutdown(SHUT_RDWR) on every connection)."""
        if self._cluster is not None:
            self._cluster.close()
        self._client.connection_pool.disconnect()

    @property
    def _closed(self) -> bool:
        return self._runner.closed

    # ---------------------------------------------------------------- lookup

    def lookup(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[LookupResult]:
        """``HIT`` or ``MISS`` per key from one pipelined round trip of ``EXISTS``.

        Runs on the caller's thread, with each socket operation bounded by ``timeout_s``.
        A timeout answers ``RETRY`` for every key, and any other failure ``MISS``.
        Never raises.
        A server that trickles its reply (a byte within each ``timeout_s``) holds the call longer.
        The manager's ``lookup_timeout_s`` still bounds the caller.
        The tier is reported stuck once it stays silent past its bound.
        """
        n = len(keys)
        if n == 0:
            return []
        if self._closed:
            return [LookupResult.MISS] * n
        if self._backing_off():
            return [self._down_answer] * n
        if self._cluster is not None:
            return self._lookup_shards(keys, ctx)
        try:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self.redis_key(key))
            replies = pipe.execute()
        except Exception as exc:
            answer = self._failed(exc)
            self._log.warning("lookup_failed", req_id=ctx.req_id, keys=n, error=_describe(exc))
            return [answer] * n
        self._mark_up()
        return [LookupResult.HIT if r else LookupResult.MISS for r in replies]

    def _lookup_shards(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[LookupResult]:
        """``lookup`` on a cluster, with one pipeline per shard.

        A shard that fails answers for its keys only.
        It answers ``RETRY`` for a timeout or a slot that is moving, else ``MISS``.
        """
        assert self._cluster is not None
        try:
            pipe = self._cluster.pipeline()
            for key in keys:
                pipe.exists(self.redis_key(key))
            replies = pipe.execute()
        except Exception as exc:  # no node of the cluster answers
            answer = self._failed(exc)
            self._log.warning("lookup_failed", req_id=ctx.req_id, keys=len(keys), error=_describe(exc))
            return [answer] * len(keys)
        self._mark_up()
        out: list[LookupResult] = []
        first_error: Exception | None = None
        failed = 0
        for reply in replies:
            if isinstance(reply, Exception):
                failed += 1
                first_error = first_error or reply
                transient = isinstance(reply, (redis.TimeoutError, *rc.TRANSIENT))
                out.append(LookupResult.RETRY if transient else LookupResult.MISS)
            else:
                out.append(LookupResult.HIT if reply else LookupResult.MISS)
        if first_error is not None:
            self._log.warning("lookup_failed", req_id=ctx.req_id, keys=failed, error=_describe(first_error))
        return out

    # ---------------------------------------------------------------- touch

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """Refresh recency on an I/O thread.

        That is Redis ``TOUCH``, and the LRU set when ``capacity_bytes`` is set.
        Best effort: it never raises, and failures are logged at debug.
        """
        if not keys or self._closed or self._backing_off():
            return
        self._runner.spawn(functools.partial(self._run_touch, list(keys)))

    def _run_touch(self, keys: list[OffloadKey]) -> None:
        try:
            pipe = self._pipeline()
            now = time.time()
            # TOUCH takes keys of one slot on a cluster: one TOUCH per bucket there.
            for lru_key, (_, members) in self._lru_groups(keys).items():
                pipe.touch(*[self.redis_key(k) for k in members])
                if self.capacity_bytes is not None:
                    pipe.zadd(lru_key, {k.hex(): now for k in members}, xx=True)
            pipe.execute()  # on a cluster, a shard's failure is its own: nothing raised
            self._mark_up()
        except Exception as exc:
            self._failed(exc)
            self._log.debug("touch_failed", keys=len(keys), error=_describe(exc))

    # ----------------------------------------------------------------- jobs

    def submit_store(self, job: TransferJob) -> None:
        """Store ``pool[job.block_ids]`` under ``job.keys`` on an I/O thread. Returns at once.

        One pipeline of ``SET`` stores them.
        With ``capacity_bytes``, a second one adds the keys stored to the LRU set.
        Reports exactly once.
        The server may take a key but refuse its LRU entry (out of memory).
        That key fails and is deleted, if the server still answers.
        A block left behind is logged (``forget_failed``).
        """
        self._submit(job, self._do_store)

    def submit_load(self, job: TransferJob) -> None:
        """Load ``job.keys`` into ``pool[job.block_ids]`` on an I/O thread. Returns at once.

        One pipeline of ``GET`` reads them, and each record is verified.
        Reports exactly once.
        A missing or unreadable block fails its key, and its row is not written.
        The others still load.
        """
        self._submit(job, self._do_load)

    def take_events(self) -> list[OffloadingEvent]:
        """Blocks stored or removed by this tier since the last call. Thread-safe."""
        with self._lock:
            return self._events.take()

    def _record(self, events: Sequence[OffloadingEvent]) -> None:
        with self._lock:
            for event in events:
                self._events.add(event.keys, event.removed)

    def _submit(self, job: TransferJob, work: Callable[[RunningJob], Outcome]) -> None:
        if self.pool is None:
            self._runner.fail(job, "tier is not attached")
        elif self._closed:
            self._runner.fail(job, "tier shut down")
        elif len(job.keys) != len(job.block_ids):
            self._runner.fail(job, f"{len(job.keys)} keys for {len(job.block_ids)} rows")
        elif not job.keys:  # nothing to move
            self._runner.finish(JobResult(job.job_id, True, None), job)
        elif self._backing_off():
            self._runner.fail(job, "unavailable: server unreachable, retrying later")
        elif not self._runner.submit(job, lambda running, lo, hi: work(running)):
            self._runner.fail(job, "tier shut down")

    # ------------------------------------------------------- degraded mode

    def _backing_off(self) -> bool:
        return self._degraded and time.monotonic() < self._down_until

    def _failed(self, exc: BaseException) -> LookupResult:
        """Classify a failure. Connection errors and timeouts start a back-off.

        Returns the lookup answer for it.
        """
        if isinstance(exc, redis.TimeoutError):
            answer = LookupResult.RETRY
        elif isinstance(exc, (redis.ConnectionError, OSError)):
            answer = LookupResult.MISS
        else:
            return LookupResult.MISS
        self._down_answer = answer
        self._down_until = time.monotonic() + self.retry_after_s
        if not self._degraded:
            self._degraded = True
            self._log.warning("tier_degraded", url=_redact(self.url), error=_describe(exc))
        return answer

    def _mark_up(self) -> None:
        if self._degraded:
            self._degraded = False
            self._log.info("tier_recovered", url=_redact(self.url))


def _check_options(namespace: str, capacity_bytes: int | None, timeout_s: float, io_workers: int,
                   retry_after_s: float, cluster: bool) -> None:
    """``ValueError`` for a constructor argument out of range (a configuration error)."""
    if not isinstance(namespace, str) or not namespace:
        raise ValueError(f"namespace must be a non-empty str, got {namespace!r}")
    if capacity_bytes is not None:
        check_int(capacity_bytes, "capacity_bytes")
    check_timeout(timeout_s, "timeout_s", allow_none=False, allow_zero=False)
    check_int(io_workers, "io_workers")
    check_timeout(retry_after_s, "retry_after_s", allow_none=False)
    check_flag(cluster, "cluster")
    if cluster and "{" in namespace:
        # The bucket's hash tag must be the first "{...}" of every key.
        raise ValueError(f"namespace must not contain '{{' with cluster=True, got {namespace!r}")


def _check_cluster_url(url: str) -> None:
    """``ValueError`` for a URL a cluster client cannot use (a configuration error)."""
    if not url.startswith(("redis://", "rediss://")):
        raise ValueError(f"cluster=True needs a redis:// or rediss:// URL naming a node, got {_redact(url)!r}")
    options = redis.connection.parse_url(url)
    if "host" not in options:
        raise ValueError(f"cluster=True needs a host in the URL, got {_redact(url)!r}")
    if options.get("db", 0) not in (0, None):
        raise ValueError(f"a Redis Cluster has only database 0, got {_redact(url)!r}")


def _redact(url: str) -> str:
    """``url`` without its password, for logs."""
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return url
    userinfo, _, hostpart = rest.rpartition("@")
    user = userinfo.split(":", 1)[0]
    return f"{scheme}://{user}:***@{hostpart}" if user else f"{scheme}://:***@{hostpart}"
