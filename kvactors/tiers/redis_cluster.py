"""Redis Cluster plumbing for ``RedisTier(cluster=True)``: key names, topology, per-shard pipelines.

redis-py's :class:`redis.cluster.RedisCluster` keeps the topology and one connection pool per node.
The topology says which node serves which slot.
It is discovered from ``CLUSTER SLOTS`` and refreshed on demand.
Its ``NodesManager`` is thread-safe.

The commands themselves are not sent through its ``ClusterPipeline``.
Its failure handling does not fit a cache that must fail per shard.
A node it cannot connect to fails the whole pipeline (every key, on every shard)
after re-reading the topology.
A command answered ``MOVED``/``ASK`` or by a dead node is re-sent alone,
with the client's retries and back-off, one command after the other.

:class:`ShardPipeline` sends the same one pipeline per node.
As ``ClusterPipeline`` does, it writes all nodes and then reads all, so the shards work in parallel.
It turns each failure into an exception object for the commands of that node only.
"""

from __future__ import annotations

import binascii
import functools
import threading
import time
from typing import Any

import redis
import xxhash
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot
from redis.exceptions import AskError, ClusterDownError, MovedError, SlotNotCoveredError, TryAgainError
from redis.retry import Retry

from kvactors.types import OffloadKey

BUCKETS = 256
"""Blocks of a namespace are spread over this many hash tags, one every
``16384 / BUCKETS`` slots, so that every shard of an evenly sliced cluster holds
the same number of buckets. Fixed: every process sharing a namespace must name
a block the same way."""

# Errors that say the slot is elsewhere or busy now (resharding, failover).
# The key is neither there nor lost, so a lookup answers RETRY for it.
TRANSIENT = (MovedError, AskError, TryAgainError, ClusterDownError, SlotNotCoveredError)


@functools.cache
def bucket_tags() -> tuple[bytes, ...]:
    """``BUCKETS`` short hash tags.

    Tag ``b`` hashes to slot ``b * 16384 // BUCKETS + 16384 // BUCKETS // 2``.
    """
    step = REDIS_CLUSTER_HASH_SLOTS // BUCKETS
    wanted = {b * step + step // 2: b for b in range(BUCKETS)}
    tags: list[bytes | None] = [None] * BUCKETS
    left = BUCKETS
    n = 0
    while left:
        candidate = str(n).encode()
        b = wanted.get(binascii.crc_hqx(candidate, 0) % REDIS_CLUSTER_HASH_SLOTS)
        if b is not None and tags[b] is None:
            tags[b] = candidate
            left -= 1
        n += 1
    return tuple(t for t in tags if t is not None)


def bucket_of(key: OffloadKey) -> int:
    return xxhash.xxh3_64_intdigest(key) % BUCKETS


def bucket_prefix(namespace_prefix: bytes, bucket: int) -> bytes:
    """``namespace:{tag}``, which a bucket's block keys start with."""
    return namespace_prefix + b"{" + bucket_tags()[bucket] + b"}"


class ShardUnavailableError(redis.ConnectionError):
    """The node serving a key failed recently.

    It is not tried again before its back-off ends.
    """


class ClusterClient:
    """The topology and per-node connections of one cluster, shared by a tier's threads.

    Constructing contacts nothing.
    The first :meth:`pipeline` execution discovers the cluster (``RedisCluster`` from ``url``).
    While no node answers, execution raises ``redis.ConnectionError``.
    It is then not tried again before ``retry_after_s``.
    A node that fails (connection refused or lost, a timeout) is skipped for ``retry_after_s``.
    Its commands fail at once with :class:`ShardUnavailableError` meanwhile.
    The topology is then read again with ``CLUSTER SLOTS``, at most once per ``retry_after_s``.
    One thread reads it while the others go on with the map they have.
    So the tier follows a failover by itself.
    Thread-safe.
    """

    def __init__(self, url: str, *, timeout_s: float, retry_after_s: float, max_connections: int,
                 socket_read_size: int) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self._kwargs: dict[str, Any] = {
            "socket_timeout": timeout_s,
            "socket_connect_timeout": timeout_s,
            "socket_keepalive": True,
            "socket_read_size": socket_read_size,
            "max_connections": max_connections,
            # The tier decides what a failure means: no retries inside redis-py.
            "retry": Retry(NoBackoff(), 0),
            "require_full_coverage": False,
        }
        self._lock = threading.Lock()  # guards the fields below
        self._client: RedisCluster | None = None
        self._connecting = threading.Lock()  # held while one thread creates the client
        self._next_connect = 0.0
        self._node_down_until: dict[str, float] = {}
        self._stale = False
        self._next_refresh = 0.0
        self._refreshing = threading.Lock()
        self._closed = False

    def pipeline(self) -> ShardPipeline:
        return ShardPipeline(self)

    # --------------------------------------------------------------- topology

    def _cluster(self) -> RedisCluster:
        """The client, created on first use. Raises ``redis.ConnectionError`` while no node
        answers. Threads that need it while one creates it wait for that one (its connects
        and reads are bounded by ``timeout_s``)."""
        client = self._client
        if client is not None:
            return client
        with self._connecting:
            with self._lock:
                if self._closed:
                    raise redis.ConnectionError("tier shut down")
                if self._client is not None:
                    return self._client
                if time.monotonic() < self._next_connect:
                    raise redis.ConnectionError("cluster unreachable, retrying later")
            try:
                # Constructing reads CLUSTER SLOTS from the node in the URL.
                client = RedisCluster.from_url(self.url, **self._kwargs)
            except Exception as exc:
                with self._lock:
                    self._next_connect = time.monotonic() + self.retry_after_s
                raise redis.ConnectionError(f"cluster unreachable: {exc}") from exc
            with self._lock:
                if not self._closed:
                    self._client = client
                    return client
        client.close()
        raise redis.ConnectionError("tier shut down")

    def _node_failed(self, node: ClusterNode) -> None:
        with self._lock:
            self._node_down_until[node.name] = time.monotonic() + self.retry_after_s
            self._stale = True

    def _mark_stale(self) -> None:
        with self._lock:
            self._stale = True

    def _node_down(self, node: ClusterNode, now: float) -> bool:
        with self._lock:
            until = self._node_down_until.get(node.name)
            if until is None:
                return False
            if now >= until:
                del self._node_down_until[node.name]
                return False
            return True

    def _maybe_refresh(self, client: RedisCluster) -> None:
        """Re-read the topology if a failure made it suspect (one thread, rate-limited)."""
        now = time.monotonic()
        with self._lock:
            if not self._stale or now < self._next_refresh:
                return
        if not self._refreshing.acquire(blocking=False):
            return  # another thread refreshes; go on with the current map
        try:
            with self._lock:
                self._stale = False
                self._next_refresh = now + self.retry_after_s
            try:
                client.nodes_manager.initialize()
            except Exception:
                self._mark_stale()  # no node answered: try again after the back-off
        finally:
            self._refreshing.release()

    def close(self) -> None:
        """Close every node's connections. Safe to call twice.

        Later executions raise.
        """
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
        # A thread creating the client now sees _closed and closes it itself.
        if client is not None:
            try:
                for node in client.get_nodes():
                    if node.redis_connection is not None:
                        node.redis_connection.connection_pool.disconnect()
            finally:
                client.close()


class _NodeBatch:
    __slots__ = ("commands", "connection", "failed", "node", "pool", "written")

    def __init__(self, node: ClusterNode) -> None:
        self.node = node
        self.commands: list[int] = []  # indexes into the pipeline's commands
        self.connection: Any = None
        self.pool: Any = None
        self.written = False
        self.failed = False  # its replies are set (errors): nothing to read


class ShardPipeline:
    """Commands for a cluster, sent as one pipeline per node.

    Each command names the key that routes it.
    Every key of a command must be in one slot.
    :meth:`execute` returns one reply per command, in order.
    A reply is the raw RESP reply (``bytes``, ``int``, ``None``, lists),
    or an exception object for a command that failed.
    The exception is the command's own error reply (``MOVED``, ``ASK``, ``WRONGTYPE``, ...),
    or the failure of its node (``ConnectionError``, ``TimeoutError``, :class:`ShardUnavailableError`).
    A node's failure fails that node's commands only.
    :meth:`execute` raises ``redis.ConnectionError`` only when the cluster cannot be reached at all.
    Use from one thread.
    """

    def __init__(self, client: ClusterClient) -> None:
        self._client = client
        self._commands: list[tuple[bytes, tuple[Any, ...]]] = []

    def __len__(self) -> int:
        return len(self._commands)

    def command(self, route: bytes, *args: Any) -> ShardPipeline:
        self._commands.append((route, args))
        return self

    def set(self, key: bytes, value: bytes) -> ShardPipeline:
        return self.command(key, "SET", key, value)

    def get(self, key: bytes) -> ShardPipeline:
        return self.command(key, "GET", key)

    def exists(self, key: bytes) -> ShardPipeline:
        return self.command(key, "EXISTS", key)

    def touch(self, *keys: bytes) -> ShardPipeline:
        return self.command(keys[0], "TOUCH", *keys)

    def unlink(self, *keys: bytes) -> ShardPipeline:
        return self.command(keys[0], "UNLINK", *keys)

    def zadd(self, name: bytes, mapping: dict[str, float], xx: bool = False) -> ShardPipeline:
        args: list[Any] = ["ZADD", name, *(["XX"] if xx else [])]
        for member, score in mapping.items():
            args += [repr(score), member]
        return self.command(name, *args)

    def zcard(self, name: bytes) -> ShardPipeline:
        return self.command(name, "ZCARD", name)

    def zrem(self, name: bytes, *members: str) -> ShardPipeline:
        return self.command(name, "ZREM", name, *members)

    def eval(self, script: str, key: bytes, *args: Any) -> ShardPipeline:
        return self.command(key, "EVAL", script, 1, key, *args)

    def execute(self, raise_on_error: bool = False) -> list[Any]:
        """Send the commands (each node's in one write, all nodes before any read) and
        collect the replies. Failures are always returned per command, whatever
        ``raise_on_error`` (accepted for the signature of redis-py's pipelines)."""
        commands, self._commands = self._commands, []
        if not commands:
            return []
        owner = self._client
        cluster = owner._cluster()
        owner._maybe_refresh(cluster)
        replies: list[Any] = [None] * len(commands)
        batches: dict[str, _NodeBatch] = {}
        now = time.monotonic()
        nodes = cluster.nodes_manager
        for index, (route, _) in enumerate(commands):
            try:
                node = nodes.get_node_from_slot(key_slot(route))
            except SlotNotCoveredError as exc:
                owner._mark_stale()
                replies[index] = exc
                continue
            batch = batches.get(node.name)
            if batch is None:
                batch = batches[node.name] = _NodeBatch(node)
            batch.commands.append(index)
        try:
            for batch in batches.values():
                if owner._node_down(batch.node, now):
                    batch.failed = True
                    self._fail(batch, replies, ShardUnavailableError(f"shard {batch.node.name} failed recently"))
                    continue
                try:
                    redis_node = cluster.get_redis_connection(batch.node)
                    batch.pool = redis_node.connection_pool
                    batch.connection = batch.pool.get_connection()
                    batch.written = True  # from here on the connection may hold unread replies
                    conn = batch.connection
                    conn.send_packed_command(conn.pack_commands([commands[i][1] for i in batch.commands]))
                except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                    self._node_error(batch, replies, exc)
            for batch in batches.values():
                if batch.failed or batch.connection is None:
                    continue
                self._read(batch, commands, replies)
        finally:
            for batch in batches.values():
                if batch.connection is not None:
                    if batch.written:  # unread replies, or a broken socket: never reuse it
                        batch.connection.disconnect()
                    batch.pool.release(batch.connection)
        return replies

    def _read(self, batch: _NodeBatch, commands: list[tuple[bytes, tuple[Any, ...]]], replies: list[Any]) -> None:
        conn = batch.connection
        for index in batch.commands:
            try:
                replies[index] = conn.read_response()
            except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                self._node_error(batch, replies, exc, start=index)
                return
            except redis.ResponseError as exc:
                replies[index] = exc
                if isinstance(exc, MovedError):
                    # The slot has a new owner (resharding, failover): route there from now on.
                    move_slot = getattr(self._client._cluster().nodes_manager, "move_slot", None)
                    try:
                        move_slot(exc)  # type: ignore[misc]  # redis-py >= 6; else the re-read below
                    except Exception:
                        self._client._mark_stale()
                elif isinstance(exc, (ClusterDownError, TryAgainError)):
                    self._client._mark_stale()
        batch.written = False  # every reply read: the connection is clean

    def _node_error(self, batch: _NodeBatch, replies: list[Any], exc: BaseException, start: int | None = None) -> None:
        batch.failed = True
        self._client._node_failed(batch.node)
        failure = exc if isinstance(exc, redis.RedisError) else redis.ConnectionError(str(exc))
        self._fail(batch, replies, failure, start)

    @staticmethod
    def _fail(batch: _NodeBatch, replies: list[Any], exc: BaseException, start: int | None = None) -> None:
        begun = start is None
        for index in batch.commands:
            if index == start:
                begun = True
            if begun:
                replies[index] = exc
