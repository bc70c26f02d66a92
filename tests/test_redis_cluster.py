"""RedisTier(cluster=True) on a real 6-node Redis Cluster (3 primaries, a replica each)."""

from __future__ import annotations

import itertools
import os
import pathlib
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future

import pytest
import redis
import torch

from kvactors import LookupResult, ReqContext, TieringManager, TransferEngine
from kvactors.tiers import redis_cluster as rc
from kvactors.tiers.redis import RedisTier
from kvactors.types import JobResult, TransferJob
from tests.redis_cluster import LocalCluster, command, find_redis_cli
from tests.redis_server import find_redis_server, free_port
from tests.support import settled, wait_for

pytestmark = [pytest.mark.redis, pytest.mark.timeout(90)]

BLOCK = 4096
ROWS = 256
WAIT = 10.0
CTX = ReqContext("r")
ROOT = pathlib.Path(__file__).resolve().parent.parent
HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY


def block_bytes(key: bytes) -> torch.Tensor:
    """What a block must hold: derived from its key, the same in every process."""
    generator = torch.Generator().manual_seed(int.from_bytes(key[-6:].ljust(6, b"\0"), "little"))
    return torch.randint(0, 256, (BLOCK,), dtype=torch.uint8, generator=generator)


class Harness:
    """A tier attached to a pool whose row ``i`` is filled by the test; reports go into a queue."""

    _job_ids = itertools.count(1)

    def __init__(self, tier: RedisTier, rows: int = ROWS) -> None:
        self.pool = torch.zeros((rows, BLOCK), dtype=torch.uint8)
        self.reports: queue.Queue[JobResult] = queue.Queue()
        self.tier = tier
        tier.attach(self.pool, self.reports.put)

    def run(self, keys: Sequence[bytes], rows: Sequence[int], *, promotion: bool) -> JobResult:
        job = TransferJob(next(self._job_ids), tuple(keys), tuple(rows), CTX, promotion)
        (self.tier.submit_load if promotion else self.tier.submit_store)(job)
        got = self.reports.get(timeout=WAIT)
        assert got.job_id == job.job_id
        return got

    def store(self, keys: Sequence[bytes], rows: Sequence[int] | None = None) -> JobResult:
        rows = list(range(len(keys))) if rows is None else list(rows)
        for key, row in zip(keys, rows, strict=True):
            self.pool[row].copy_(block_bytes(key))
        return self.run(keys, rows, promotion=False)

    def load(self, keys: Sequence[bytes], rows: Sequence[int]) -> JobResult:
        for row in rows:
            self.pool[row].zero_()
        return self.run(keys, rows, promotion=True)

    def loaded_exactly(self, keys: Sequence[bytes], rows: Sequence[int], result: JobResult) -> list[bytes]:
        """Asserts that every key the load reports loaded holds its bytes and every other
        row is untouched (zero); returns the loaded keys."""
        ok = set(keys) if result.success else set(result.successful_keys or ())
        for key, row in zip(keys, rows, strict=True):
            if key in ok:
                assert torch.equal(self.pool[row], block_bytes(key)), f"wrong bytes loaded for {key!r}"
            else:
                assert int(self.pool[row].count_nonzero()) == 0, f"row of failed key {key!r} written"
        return [k for k in keys if k in ok]


def keys_(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}-{i}".encode() for i in range(n)]


@pytest.fixture
def make_tier(redis_cluster: LocalCluster) -> Iterator[Callable[..., Harness]]:
    made: list[RedisTier] = []

    def make(url: str | None = None, rows: int = ROWS, **kwargs: object) -> Harness:
        kwargs.setdefault("cluster", True)
        tier = RedisTier(url or redis_cluster.url, **kwargs)  # type: ignore[arg-type]
        made.append(tier)
        return Harness(tier, rows)

    yield make
    for tier in made:
        tier.shutdown()


def keys_per_primary(cluster: LocalCluster, pattern: str) -> dict[int, int]:
    out = {}
    for node in cluster.primaries():
        client = redis.Redis(port=node.port)
        out[node.port] = sum(1 for _ in client.scan_iter(match=pattern, count=1000))
        client.close()
    return out


# ------------------------------------------------------------------ basics


def test_round_trip_is_byte_exact_and_spread_over_every_shard(
    redis_cluster: LocalCluster, make_tier: Callable[..., Harness], monkeypatch: pytest.MonkeyPatch
) -> None:
    h = make_tier(namespace="spread")
    keys = keys_("a", 96)
    res = h.store(keys)
    assert res.success, res.error
    per_primary = keys_per_primary(redis_cluster, "spread:*")
    assert len(per_primary) == 3 and all(n > 0 for n in per_primary.values()), per_primary
    assert sum(per_primary.values()) == 96

    rows = list(range(200, 104, -1))  # other rows, reversed
    res = h.load(keys, rows)
    assert res.success, res.error
    assert h.loaded_exactly(keys, rows, res) == keys

    # A lookup is one pipelined write per shard (3), not one per key.
    sends: list[int] = []
    original = redis.connection.Connection.send_packed_command

    def counting(self: redis.connection.Connection, command: object, check_health: bool = True) -> None:
        sends.append(self.port)
        original(self, command, check_health)

    monkeypatch.setattr(redis.connection.Connection, "send_packed_command", counting)
    assert h.tier.lookup([*keys[:5], b"nope", b"nope-2"], CTX) == [HIT] * 5 + [MISS, MISS]
    assert len(sends) == len(set(sends)) <= 3


def test_namespaces_are_isolated_on_a_cluster(make_tier: Callable[..., Harness]) -> None:
    a = make_tier(name="a", namespace="tenant")
    b = make_tier(name="b", namespace="tenant")
    other = make_tier(name="c", namespace="tenant2")
    prefix = make_tier(name="d", namespace="ten")
    keys = keys_("s", 24)
    assert a.store(keys).success
    assert b.tier.lookup(keys, CTX) == [HIT] * 24
    res = b.load(keys, range(24, 48))
    assert res.success and b.loaded_exactly(keys, range(24, 48), res) == keys
    for h in (other, prefix):
        assert h.tier.lookup(keys, CTX) == [MISS] * 24
        res = h.load(keys, range(24, 48))
        assert not res.success and res.successful_keys in ((), None)
        assert h.loaded_exactly(keys, range(24, 48), res) == []


def test_bad_cluster_configuration_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="namespace"):
        RedisTier("redis://127.0.0.1:1", cluster=True, namespace="a{b}")
    with pytest.raises(ValueError, match="database 0"):
        RedisTier("redis://127.0.0.1:1/3", cluster=True)
    with pytest.raises(ValueError, match="redis://"):
        RedisTier("unix:///tmp/x.sock", cluster=True)


def test_unreachable_cluster_at_construction_starts_degraded(make_tier: Callable[..., Harness]) -> None:
    h = make_tier(url=f"redis://127.0.0.1:{free_port()}", timeout_s=0.3, retry_after_s=0.05)
    keys = keys_("u", 4)
    assert h.tier.lookup(keys, CTX) == [MISS] * 4
    res = h.store(keys)
    assert not res.success and not res.successful_keys
    assert h.reports.empty()


def test_capacity_is_bounded_per_bucket_on_a_cluster(
    redis_cluster: LocalCluster, make_tier: Callable[..., Harness]
) -> None:
    record = BLOCK + 64
    per_bucket = 2
    h = make_tier(namespace="cap", capacity_bytes=per_bucket * rc.BUCKETS * record)
    keys = keys_("c", 1200)
    for i in range(0, len(keys), 100):
        batch = keys[i:i + 100]
        res = h.store(batch, range(100))
        # A bucket that gets more of one job's keys than its share evicts some of them at once:
        # those fail, and only those (exactly the keys reported successful are in the tier).
        ok = set(batch) if res.success else set(res.successful_keys or ())
        failed = [k for k in batch if k not in ok]
        assert res.success or "evicted by its own store" in (res.error or ""), res.error
        assert h.tier.lookup(failed, CTX) == [MISS] * len(failed)
    removed = [k for e in h.tier.take_events() if e.removed for k in e.keys]
    kept = sum(keys_per_primary(redis_cluster, "cap:*[0-9a-f]").values())  # blocks, not LRU sets
    assert kept + len(removed) == len(keys)
    assert kept <= per_bucket * rc.BUCKETS
    assert kept >= per_bucket * rc.BUCKETS * 0.8  # every bucket filled (1200 keys over 256)
    # Evicted blocks are gone; what is kept loads.
    assert h.tier.lookup(removed[:20], CTX) == [MISS] * 20
    survivors = [k for k in keys if k not in set(removed)][:50]
    res = h.load(survivors, range(100, 150))
    assert res.success and h.loaded_exactly(survivors, range(100, 150), res) == survivors


# ------------------------------------------------------ through the runtime

WRITER = textwrap.dedent(
    """
    import sys
    from kvactors import RedisTier, ReqContext, TieringManager
    from tests.test_redis_cluster import block_bytes

    url, namespace, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    keys = [b"shared-%04d" % n for n in range(count)]
    with TieringManager.start(num_blocks=count, block_bytes=4096,
                              secondary_tiers=[RedisTier(url, namespace=namespace, cluster=True)]) as manager:
        ctx = ReqContext("writer")
        manager.on_new_request(ctx)
        out = manager.prepare_store(keys, ctx)
        for key, row in zip(out.keys_to_store, out.store_spec.block_ids):
            manager.pool[row].copy_(block_bytes(key))
        manager.complete_store(out.keys_to_store, ctx)
        manager.on_request_finished(ctx)
        assert manager.wait_idle(30)
        stats = manager.stats()
        assert stats["jobs_succeeded"] >= 1 and stats["jobs_failed"] == 0, stats
        assert stats["contract_violations"] == 0, stats
    print("stored", len(out.keys_to_store))
    """
)


@pytest.mark.timeout(120)
def test_a_second_process_promotes_what_the_first_stored(redis_cluster: LocalCluster) -> None:
    count = 48
    written = subprocess.run([sys.executable, "-c", WRITER, redis_cluster.url, "proc-a", str(count)],
                             capture_output=True, text=True, timeout=90, cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert written.returncode == 0, written.stderr
    assert written.stdout.split() == ["stored", str(count)]
    assert all(n > 0 for n in keys_per_primary(redis_cluster, "proc-a:*").values())

    keys = [b"shared-%04d" % n for n in range(count)]
    tier = RedisTier(redis_cluster.url, namespace="proc-a", cluster=True)
    other = RedisTier(redis_cluster.url, name="other", namespace="proc-b", cluster=True)
    with TieringManager.start(num_blocks=count, block_bytes=BLOCK, secondary_tiers=[other, tier]) as manager:
        ctx = ReqContext("reader")
        manager.on_new_request(ctx)
        assert manager.lookup(keys, ctx) == [LookupResult.HIT_PENDING] * count  # from proc-a only
        assert manager.wait_idle(30)
        assert manager.lookup(keys, ctx) == [LookupResult.HIT] * count
        spec = manager.prepare_load(keys, ctx)
        for key, row in zip(keys, spec.block_ids, strict=True):
            assert torch.equal(manager.pool[row], block_bytes(key)), key
        manager.complete_load(keys, ctx)
        manager.on_request_finished(ctx)
        stats = settled(manager, 30)
        assert stats["contract_violations"] == 0 and stats["blocks_pinned"] == 0


# ------------------------------------------------------------ resharding


def _node_id(port: int) -> str:
    return command(port, "CLUSTER", "MYID")


def _migrate_keys(src: redis.Redis, target_port: int, slot: int, rkeys: Sequence[bytes] | None = None) -> None:
    """MIGRATE ``rkeys`` (default: every key left in ``slot``, other tests' too) to ``target_port``."""
    while True:
        batch = list(rkeys) if rkeys is not None else src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100)
        if batch:
            src.execute_command("MIGRATE", "127.0.0.1", target_port, "", 0, 5000, "KEYS", *batch)
        if rkeys is not None or not batch:
            return


def _move_slot(cluster: LocalCluster, slot: int, source: int, target: int) -> None:
    """The whole of ``slot`` from port ``source`` to port ``target``."""
    src, dst = redis.Redis(port=source), redis.Redis(port=target)
    dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", _node_id(source))
    src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", _node_id(target))
    _migrate_keys(src, target, slot)
    for node in cluster.primaries():
        redis.Redis(port=node.port).execute_command("CLUSTER", "SETSLOT", slot, "NODE", _node_id(target))


def test_slot_migration_during_loads_never_loads_wrong_bytes(
    redis_cluster: LocalCluster, make_tier: Callable[..., Harness]
) -> None:
    h = make_tier(namespace="mig")
    # Keys of one bucket share a slot: move that slot from its owner to another primary.
    keys = [k for k in keys_("m", 4000) if rc.bucket_of(k) == 7][:12]
    others = [k for k in keys_("o", 200) if rc.bucket_of(k) != 7][:12]
    assert len(keys) == 12
    assert h.store(keys + others).success
    slot = redis.crc.key_slot(h.tier.redis_key(keys[0]))
    source = next(p for p in redis_cluster.primaries()
                  if redis.Redis(port=p.port).execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) > 0)
    target = next(p for p in redis_cluster.primaries() if p is not source)
    rkeys = [h.tier.redis_key(k) for k in keys]
    both = keys + others
    rows = list(range(100, 100 + len(both)))
    errors: list[str] = []

    def load_all() -> list[bytes]:
        res = h.load(both, rows)
        errors.append(res.error or "")
        loaded = h.loaded_exactly(both, rows, res)
        assert set(others) <= set(loaded), "keys of other slots failed"
        return loaded

    assert load_all() == both
    src = redis.Redis(port=source.port)
    dst = redis.Redis(port=target.port)
    moved_slot = False
    try:
        dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", _node_id(source.port))
        src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", _node_id(target.port))
        # Half the keys moved: those answer ASK at the source, never wrong bytes here.
        _migrate_keys(src, target.port, slot, rkeys[:6])
        loaded = load_all()
        assert set(keys[6:]) <= set(loaded)  # not moved yet: still served by the source
        assert not set(keys[:6]) & set(loaded) and "AskError" in errors[-1], errors[-1]
        assert h.tier.lookup(keys[:6], CTX) == [RETRY] * 6
        _migrate_keys(src, target.port, slot)  # the rest of the slot, other tests' keys too
        load_all()
        for node in redis_cluster.primaries():
            redis.Redis(port=node.port).execute_command("CLUSTER", "SETSLOT", slot, "NODE", _node_id(target.port))
        moved_slot = True
        # MOVED teaches the tier the new owner: the keys load again, by themselves.
        assert wait_for(lambda: load_all() == both, timeout=10, interval=0.05)
        assert any("MovedError" in e for e in errors), errors
        assert h.tier.lookup(keys, CTX) == [HIT] * len(keys)
    finally:
        # Give the slot back, so that the module's cluster is as it was.
        if moved_slot:
            _move_slot(redis_cluster, slot, target.port, source.port)
        else:
            for node in (src, dst):
                node.execute_command("CLUSTER", "SETSLOT", slot, "STABLE")
        redis_cluster.wait_ok(30)


# -------------------------------------------------------------- failover


@pytest.mark.timeout(150)
def test_primary_killed_during_concurrent_offloads_then_failover() -> None:
    if find_redis_server() is None or find_redis_cli() is None:
        pytest.skip("redis-server/redis-cli not found")
    cluster = LocalCluster()  # ports chosen, nothing started yet
    early = Harness(RedisTier(cluster.url, name="early", namespace="early", cluster=True,
                              timeout_s=0.5, retry_after_s=0.05))
    try:
        # Constructed while no node runs: degraded, not an error.
        assert early.tier.lookup(keys_("e", 4), CTX) == [MISS] * 4
        assert not early.store(keys_("e", 4)).success
        with cluster:
            # It connects by itself once the cluster answers.
            assert wait_for(lambda: early.store(keys_("e", 4)).success, timeout=10, interval=0.1)
            assert early.tier.lookup(keys_("e", 4), CTX) == [HIT] * 4
            early.tier.shutdown()
            _failover_run(cluster)
    finally:
        early.tier.shutdown()
        cluster.stop()


def _failover_run(cluster: LocalCluster) -> None:
    tier = RedisTier(cluster.url, namespace="fo", cluster=True, timeout_s=0.5, retry_after_s=0.2)
    direct = Harness(RedisTier(cluster.url, name="direct", namespace="fo-direct", cluster=True,
                               timeout_s=0.5, retry_after_s=0.2))
    errors: list[BaseException] = []
    futures: list[Future[list[bytes]]] = []
    futures_lock = threading.Lock()
    stop = threading.Event()
    device = torch.zeros((64, BLOCK), dtype=torch.uint8)

    _hung_shard_is_retry_for_its_keys_only(cluster, direct)
    with TieringManager.start(num_blocks=1024, block_bytes=BLOCK, secondary_tiers=[tier],
                              transfer_timeout_s=5, lookup_timeout_s=2) as manager, \
            TransferEngine(manager, device) as engine:

        def frontend(thread: int) -> None:
            n = 0
            rows = list(range(thread * 16, thread * 16 + 4))
            try:
                while not stop.is_set() and n < 100_000:
                    ctx = ReqContext(f"t{thread}-{n}")
                    keys = [b"f-%d-%d-%d" % (thread, n, j) for j in range(4)]
                    for key, row in zip(keys, rows, strict=True):
                        device[row].copy_(block_bytes(key))
                    manager.on_new_request(ctx)
                    future = engine.offload(ctx, keys, rows)
                    with futures_lock:
                        futures.append(future)
                    future.result(30)
                    manager.on_request_finished(ctx)
                    n += 1
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=frontend, args=(t,)) for t in range(4)]
        for thread in threads:
            thread.start()
        assert wait_for(lambda: manager.stats()["jobs_succeeded"] >= 40, timeout=60)
        pre = keys_("pre", 48)
        assert direct.store(pre).success
        victim = cluster.primaries()[0]
        replica = cluster.replica_of(victim)
        on_victim = {k for k in pre if _owner_port(cluster, direct.tier.redis_key(k)) == victim.port}
        assert 0 < len(on_victim) < len(pre)
        victim.kill()
        # While it is down (before the failover): the other shards' keys still load.
        res = direct.load(pre, range(100, 148))
        loaded = direct.loaded_exactly(pre, range(100, 148), res)
        assert set(loaded) == set(pre) - on_victim, (len(loaded), len(on_victim))
        cluster.wait_failover(replica, timeout=60)
        # Stores land again after the failover (the tier follows it by itself).
        before = manager.stats()["jobs_succeeded"]
        assert wait_for(lambda: manager.stats()["jobs_succeeded"] >= before + 20, timeout=60)
        stop.set()
        for thread in threads:
            thread.join(60)
        assert not any(thread.is_alive() for thread in threads), "a frontend hung"
        assert not errors, errors[:3]
        assert all(f.done() for f in futures), "a future never resolved"
        stats = settled(manager, 60)
        print(f"failover run: futures={len(futures)} jobs_succeeded={stats['jobs_succeeded']} "
              f"jobs_failed={stats['jobs_failed']} jobs_partial={stats['jobs_partial']} "
              f"job_keys_failed={stats['job_keys_failed']} violations={stats['contract_violations']}")
        assert stats["contract_violations"] == 0 and stats["internal_errors"] == 0
        assert stats["active_requests"] == 0 and stats["jobs_in_flight"] == 0

        # After the failover, new stores land and load back, byte-exact. The tier follows the
        # failover by itself, but not at once (a node that failed is skipped for retry_after_s, the
        # slot map is re-read once per retry_after_s): a store may still miss the promoted replica.
        deadline = time.monotonic() + 30
        for attempt in itertools.count():
            assert time.monotonic() < deadline, f"no store landed whole in 30 s ({attempt} attempts)"
            ctx = ReqContext(f"after-{attempt}")
            manager.on_new_request(ctx)
            keys = [b"after-%d-%d" % (attempt, j) for j in range(24)]
            for key, row in zip(keys, range(24), strict=True):
                device[row].copy_(block_bytes(key))
            assert engine.offload(ctx, keys, list(range(24))).result(30) == keys
            assert manager.wait_idle(30)
            manager.reset_cache()
            if manager.lookup(keys, ctx) == [LookupResult.HIT_PENDING] * len(keys):
                break
            manager.on_request_finished(ctx)
        assert manager.wait_idle(30)
        spec = manager.prepare_load(keys, ctx)
        for key, row in zip(keys, spec.block_ids, strict=True):
            assert torch.equal(manager.pool[row], block_bytes(key))
        manager.complete_load(keys, ctx)
        manager.on_request_finished(ctx)
        assert settled(manager, 30)["contract_violations"] == 0
    direct.tier.shutdown()


def _hung_shard_is_retry_for_its_keys_only(cluster: LocalCluster, direct: Harness) -> None:
    """A primary that stops answering (SIGSTOP, shorter than the failover timeout) times
    out its keys only: RETRY for them, HIT for the others, within about ``timeout_s``."""
    keys = keys_("hung", 24)
    assert direct.store(keys).success
    hung = cluster.primaries()[1]
    on_hung = [_owner_port(cluster, direct.tier.redis_key(k)) == hung.port for k in keys]
    assert any(on_hung) and not all(on_hung)
    assert hung.pid is not None
    os.kill(hung.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        answers = direct.tier.lookup(keys, CTX)
        took = time.monotonic() - started
    finally:
        os.kill(hung.pid, signal.SIGCONT)
    assert answers == [RETRY if h else HIT for h in on_hung]
    assert took < 2.5, took  # one timeout (0.5 s), not one per key (8 or so on that shard)
    assert wait_for(lambda: direct.tier.lookup(keys, CTX) == [HIT] * len(keys), timeout=10, interval=0.05)


def _owner_port(cluster: LocalCluster, rkey: bytes) -> int:
    slot = redis.crc.key_slot(rkey)
    for line in cluster.node_lines():
        for part in line.slots:
            low, _, high = part.partition("-")
            if line.is_master and int(low) <= slot <= int(high or low):
                return line.port
    raise AssertionError(f"slot {slot} has no owner")
