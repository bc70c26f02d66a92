"""Shared pytest fixtures.

Each section is self-contained (its own imports and helpers); add new sections
below rather than editing existing ones.
"""

from __future__ import annotations

# ---------------------------------------------------------------------------
# Redis: a real redis-server per test (tests marked ``@pytest.mark.redis``)
# ---------------------------------------------------------------------------
from collections.abc import Callable, Iterator

import pytest

from tests.redis_server import RedisServer, find_redis_server


@pytest.fixture
def redis_server_factory() -> Iterator[Callable[..., RedisServer]]:
    """Make ``RedisServer`` objects (not started); every one is stopped afterwards.

    Skips the test when no ``redis-server`` binary is installed. Pass ``port=``
    to put a server on a port chosen earlier (for "the server comes up later").
    """
    binary = find_redis_server()
    if binary is None:
        pytest.skip("redis-server binary not found (apt-get install redis-server)")
    made: list[RedisServer] = []

    def make(**kwargs: object) -> RedisServer:
        server = RedisServer(binary=binary, **kwargs)  # type: ignore[arg-type]
        made.append(server)
        return server

    yield make
    for server in made:
        server.stop()


@pytest.fixture
def redis_server(redis_server_factory: Callable[..., RedisServer]) -> RedisServer:
    """A started ``redis-server`` on a free loopback port (64 MiB, allkeys-lru), empty.

    Function scope: tests kill and restart it. Skips without a binary.
    """
    return redis_server_factory().start()


# ---------------------------------------------------------------------------
# Redis Cluster: 3 primaries with a replica each, one per test module
# ---------------------------------------------------------------------------
from tests.redis_cluster import LocalCluster, find_redis_cli  # noqa: E402


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[LocalCluster]:
    """A started 6-node Redis Cluster (3 primaries, 1 replica each) on loopback ports,
    shared by the tests of one module and removed after it. Skips without
    ``redis-server``/``redis-cli``. Tests must not kill its nodes (start their own)."""
    if find_redis_server() is None or find_redis_cli() is None:
        pytest.skip("redis-server/redis-cli not found (apt-get install redis-server redis-tools)")
    cluster = LocalCluster().start()
    try:
        yield cluster
    finally:
        cluster.stop()


# ---------------------------------------------------------------------------
# Event names: every logger built during the tests checks its events against
# kvactors.log_schema, so an event added or renamed without the schema fails
# the test that emits it (read when a logger is built; subprocesses inherit it).
# ---------------------------------------------------------------------------
import os  # noqa: E402

os.environ.setdefault("KVACTORS_STRICT_EVENTS", "1")


# ---------------------------------------------------------------------------
# Hypothesis: no per-example deadline and no too_slow health check (an example is
# ~1 ms; a loaded CI machine can stall one past the default 200 ms, which fails a
# correct test). Every other setting stays the loaded profile's (Hypothesis' "ci"
# profile under CI).
# ---------------------------------------------------------------------------
from hypothesis import HealthCheck as _HealthCheck  # noqa: E402
from hypothesis import settings as _hypothesis_settings  # noqa: E402

_hypothesis_settings.register_profile("kvactors", parent=_hypothesis_settings(), deadline=None,
                                      suppress_health_check=[_HealthCheck.too_slow])
_hypothesis_settings.load_profile("kvactors")
