"""Run a throwaway Redis Cluster (or Valkey cluster) for tests and benchmarks.

``masters`` primaries with ``replicas`` replicas each, every node a
:class:`tests.redis_server.RedisServer` started with ``--cluster-enabled yes`` on
a loopback port whose cluster bus port (``port + 10000``) is free too; the
cluster is formed by ``redis-cli --cluster create ... --cluster-yes``. Nothing
is kept on disk beyond each node's ``nodes.conf`` in its temporary directory,
removed by :meth:`LocalCluster.stop`. ``cluster-node-timeout`` is short
(``node_timeout_ms``) so that a killed primary fails over in a few seconds.

Usage::

    with LocalCluster() as cluster:
        client = redis.RedisCluster.from_url(cluster.url)
        victim = cluster.primaries()[0]
        replica = cluster.replica_of(victim)
        victim.kill()
        cluster.wait_failover(replica)

``$REDIS_SERVER`` and ``$REDIS_CLI`` pick the binaries (``valkey-server`` and
``valkey-cli`` work too). Only the standard library is imported here.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from types import TracebackType

from tests.redis_server import RedisServer, find_redis_server


def find_redis_cli() -> str | None:
    """The path of a ``redis-cli`` binary (``$REDIS_CLI`` first), or None."""
    explicit = os.environ.get("REDIS_CLI")
    if explicit and os.access(explicit, os.X_OK):
        return explicit
    return shutil.which("redis-cli") or shutil.which("valkey-cli")


def free_cluster_port() -> int:
    """A loopback port free right now whose cluster bus port (+10000) is free too."""
    for _ in range(200):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = int(a.getsockname()[1])
            if port + 10000 > 65535:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 10000))
                except OSError:
                    continue
                return port
    raise RuntimeError("no free port pair for a cluster node")


def command(port: int, *args: str, timeout: float = 2.0) -> str:
    """One command over raw RESP; the reply as text (bulk or status). Raises OSError
    when the node does not answer, RuntimeError on an error reply."""
    parts = [f"*{len(args)}\r\n".encode()]
    for arg in args:
        data = arg.encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(b"".join(parts))
        buf = b""
        while b"\r\n" not in buf:
            chunk = sock.recv(65536)
            if not chunk:
                raise OSError("connection closed")
            buf += chunk
        line, _, rest = buf.partition(b"\r\n")
        kind, body = line[:1], line[1:]
        if kind == b"-":
            raise RuntimeError(body.decode())
        if kind in (b"+", b":"):
            return body.decode()
        if kind == b"$":
            size = int(body)
            if size < 0:
                return ""
            while len(rest) < size + 2:
                chunk = sock.recv(65536)
                if not chunk:
                    raise OSError("connection closed")
                rest += chunk
            return rest[:size].decode()
        raise RuntimeError(f"unexpected reply {line!r}")


def _info_fields(text: str) -> dict[str, str]:
    fields = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key.strip()] = value.strip()
    return fields


class ClusterNodeLine:
    """One line of ``CLUSTER NODES``."""

    def __init__(self, line: str) -> None:
        parts = line.split()
        self.node_id = parts[0]
        self.port = int(parts[1].split("@")[0].rsplit(":", 1)[1])
        self.flags = set(parts[2].split(","))
        self.master_id = parts[3]
        self.slots = parts[8:]

    @property
    def is_master(self) -> bool:
        return "master" in self.flags and not self.failed

    @property
    def failed(self) -> bool:
        return "fail" in self.flags or "fail?" in self.flags


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``predicate`` (backing off to 0.1 s) until it holds; TimeoutError after ``timeout``."""
    deadline = time.monotonic() + timeout
    delay = 0.01
    while True:
        try:
            if predicate():
                return
        except (OSError, RuntimeError, ValueError, IndexError):
            pass
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what} within {timeout}s")
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


class LocalCluster:
    """A Redis Cluster of ``masters * (1 + replicas)`` local ``redis-server`` processes.

    Not thread-safe: drive it from the test's thread.
    """

    def __init__(
        self,
        *,
        masters: int = 3,
        replicas: int = 1,
        maxmemory: str = "64mb",
        node_timeout_ms: int = 1000,
        binary: str | None = None,
        cli: str | None = None,
        start_timeout: float = 60.0,
    ) -> None:
        binary = binary or find_redis_server()
        cli = cli or find_redis_cli()
        if binary is None or cli is None:
            raise FileNotFoundError("no redis-server/redis-cli binary found (install redis-server and redis-tools)")
        self.cli = cli
        self.masters = masters
        self.replicas = replicas
        self.start_timeout = start_timeout
        extra = (
            "--cluster-enabled", "yes",
            "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(node_timeout_ms),
            # A replica may always take over, however long its link was down.
            "--cluster-replica-validity-factor", "0",
            # Slots of a failed primary answer CLUSTERDOWN for their keys only.
            "--cluster-require-full-coverage", "no",
        )
        self.nodes = [
            RedisServer(port=free_cluster_port(), maxmemory=maxmemory, binary=binary, extra_args=extra)
            for _ in range(masters * (1 + replicas))
        ]

    @property
    def url(self) -> str:
        """A URL naming one node (any node will do for a cluster client)."""
        return f"redis://127.0.0.1:{self.nodes[0].port}"

    def start(self) -> LocalCluster:
        try:
            for node in self.nodes:
                node.start()
            create = subprocess.run(
                [self.cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
                 "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                capture_output=True, text=True, timeout=self.start_timeout, stdin=subprocess.DEVNULL,
            )
            if create.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed:\n{create.stdout}\n{create.stderr}")
            self.wait_ok(self.start_timeout)
            self.wait_replicas_synced(self.start_timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def running_nodes(self) -> list[RedisServer]:
        return [n for n in self.nodes if n.running]

    def node_lines(self, via: RedisServer | None = None) -> list[ClusterNodeLine]:
        via = via or self.running_nodes()[0]
        return [ClusterNodeLine(line) for line in command(via.port, "CLUSTER", "NODES").splitlines() if line]

    def primaries(self) -> list[RedisServer]:
        """The running nodes that are primaries owning slots, as the cluster sees them now."""
        by_port = {n.port: n for n in self.running_nodes()}
        return [by_port[line.port] for line in self.node_lines() if line.is_master and line.slots
                and line.port in by_port]

    def replica_of(self, primary: RedisServer) -> RedisServer:
        lines = self.node_lines()
        master_id = next(line.node_id for line in lines if line.port == primary.port)
        port = next(line.port for line in lines if line.master_id == master_id)
        return next(n for n in self.nodes if n.port == port)

    def node_for_port(self, port: int) -> RedisServer:
        return next(n for n in self.nodes if n.port == port)

    def _ok_everywhere(self) -> bool:
        for node in self.running_nodes():
            fields = _info_fields(command(node.port, "CLUSTER", "INFO"))
            if fields.get("cluster_state") != "ok" or fields.get("cluster_slots_assigned") != "16384":
                return False
        return True

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every running node says ``cluster_state:ok`` with all slots assigned."""
        wait_until(self._ok_everywhere, timeout, "cluster_state:ok on every node")

    def wait_replicas_synced(self, timeout: float = 30.0) -> None:
        def synced() -> bool:
            for node in self.running_nodes():
                fields = _info_fields(command(node.port, "INFO", "replication"))
                if fields.get("role") == "slave" and fields.get("master_link_status") != "up":
                    return False
            return True

        wait_until(synced, timeout, "every replica synced with its primary")

    def wait_failover(self, replica: RedisServer, timeout: float = 30.0) -> None:
        """Until every running node sees ``replica`` (of a primary killed) as a primary
        owning slots, and says ``cluster_state:ok``."""

        def promoted() -> bool:
            for via in self.running_nodes():  # every node's view, not only the replica's own
                line = next(line for line in self.node_lines(via) if line.port == replica.port)
                if not (line.is_master and line.slots):
                    return False
            return self._ok_everywhere()

        wait_until(promoted, timeout, f"replica on port {replica.port} promoted")

    def stop(self) -> None:
        """Kill every node and remove its directory. Safe to call twice."""
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
