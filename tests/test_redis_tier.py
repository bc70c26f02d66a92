"""RedisTier against a real redis-server (no mocks), driven directly (no manager)."""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import pytest
import redis
import torch

from kvactors.tiers.redis import RedisTier
from kvactors.types import JobResult, LookupResult, OffloadingEvent, ReqContext, TransferJob
from tests.redis_server import RedisServer, free_port

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]

BLOCK = 16 * 1024
ROWS = 64
WAIT = 10.0
CTX = ReqContext("r")

HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY


class Harness:
    """A tier attached to its own random pool; reports go into a queue."""

    _job_ids = itertools.count(1)

    def __init__(self, tier: RedisTier, *, rows: int = ROWS, block: int = BLOCK, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.pool = torch.randint(0, 256, (rows, block), dtype=torch.uint8, generator=gen)
        self.reports: queue.Queue[JobResult] = queue.Queue()
        self.tier = tier
        tier.attach(self.pool, self.reports.put)

    def job(self, keys: Sequence[bytes], rows: Sequence[int], *, promotion: bool) -> TransferJob:
        return TransferJob(next(self._job_ids), tuple(keys), tuple(rows), CTX, promotion)

    def store(self, keys: Sequence[bytes], rows: Sequence[int]) -> int:
        job = self.job(keys, rows, promotion=False)
        self.tier.submit_store(job)
        return job.job_id

    def load(self, keys: Sequence[bytes], rows: Sequence[int]) -> int:
        job = self.job(keys, rows, promotion=True)
        self.tier.submit_load(job)
        return job.job_id

    def result(self, job_id: int | None = None) -> JobResult:
        got = self.reports.get(timeout=WAIT)
        if job_id is not None:
            assert got.job_id == job_id
        return got

    def results(self, n: int) -> list[JobResult]:
        return [self.reports.get(timeout=WAIT) for _ in range(n)]

    def store_ok(self, keys: Sequence[bytes], rows: Sequence[int]) -> None:
        res = self.result(self.store(keys, rows))
        assert res.success, res.error

    def load_ok(self, keys: Sequence[bytes], rows: Sequence[int]) -> None:
        res = self.result(self.load(keys, rows))
        assert res.success, res.error


def keys_(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}-{i}".encode() for i in range(n)]


@pytest.fixture
def make_tier() -> Iterator[Callable[..., Harness]]:
    made: list[RedisTier] = []

    def make(url: str, *, seed: int = 0, rows: int = ROWS, block: int = BLOCK, **kwargs: object) -> Harness:
        tier = RedisTier(url, **kwargs)  # type: ignore[arg-type]
        made.append(tier)
        return Harness(tier, rows=rows, block=block, seed=seed)

    yield make
    for tier in made:
        tier.shutdown()


def test_store_zero_load_is_byte_exact(redis_server: RedisServer, make_tier: Callable[..., Harness]) -> None:
    h = make_tier(redis_server.url)
    keys = keys_("a", 8)
    original = h.pool[:8].clone()
    h.store_ok(keys, range(8))
    assert h.tier.take_events() == [OffloadingEvent(tuple(keys), "redis", removed=False)]
    h.pool.zero_()
    h.load_ok(keys[::-1], range(20, 28))  # other rows, reversed order
    assert torch.equal(h.pool[20:28], original.flip(0))
    assert int(h.pool[:20].sum()) == 0 and int(h.pool[28:].sum()) == 0
    assert h.tier.take_events() == []
    assert h.reports.empty()


def test_lookup_hit_miss_in_one_round_trip(
    redis_server: RedisServer, make_tier: Callable[..., Harness], monkeypatch: pytest.MonkeyPatch
) -> None:
    h = make_tier(redis_server.url)
    keys = keys_("l", 3)
    h.store_ok(keys, range(3))
    assert h.tier.lookup([], CTX) == []
    h.tier.lookup([b"warm-up"], CTX)  # the connection exists from now on

    sends: list[int] = []
    original = redis.connection.Connection.send_packed_command

    def counting(self: redis.connection.Connection, command: object, check_health: bool = True) -> None:
        sends.append(1)
        original(self, command, check_health)

    monkeypatch.setattr(redis.connection.Connection, "send_packed_command", counting)
    asked = [keys[0], b"nope", keys[1], b"nope-2", keys[2], *keys_("x", 50)]
    assert h.tier.lookup(asked, CTX) == [HIT, MISS, HIT, MISS, HIT] + [MISS] * 50
    assert len(sends) == 1


def test_two_tiers_share_a_namespace_others_are_isolated(
    redis_server: RedisServer, make_tier: Callable[..., Harness]
) -> None:
    a = make_tier(redis_server.url, name="a", namespace="tenant", seed=1)
    b = make_tier(redis_server.url, name="b", namespace="tenant", seed=2)
    other = make_tier(redis_server.url, name="c", namespace="tenant2", seed=3)
    prefix = make_tier(redis_server.url, name="d", namespace="ten", seed=4)
    keys = keys_("s", 4)
    a.store_ok(keys, range(4))
    assert b.tier.lookup(keys, CTX) == [HIT] * 4
    b.load_ok(keys, range(10, 14))
    assert torch.equal(b.pool[10:14], a.pool[:4])

    for h in (other, prefix):
        assert h.tier.lookup(keys, CTX) == [MISS] * 4
        before = h.pool[10:14].clone()
        res = h.result(h.load(keys, range(10, 14)))
        assert not res.success and res.error is not None and "missing" in res.error
        assert torch.equal(h.pool[10:14], before)  # nothing written on failure
    # redis keys are namespace + ":" + hex
    client = redis.Redis.from_url(redis_server.url)
    assert client.exists(b"tenant:" + keys[0].hex().encode()) == 1
    client.close()


@pytest.mark.parametrize("damage", ["garbage", "truncated", "flipped", "other_key"])
def test_corrupt_record_fails_load_then_misses(
    redis_server: RedisServer,
    make_tier: Callable[..., Harness],
    damage: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    h = make_tier(redis_server.url)
    keys = keys_("c", 3)
    h.store_ok(keys, range(3))
    h.tier.take_events()
    client = redis.Redis.from_url(redis_server.url)
    victim = h.tier.redis_key(keys[1])
    record = client.get(victim)
    assert record is not None
    if damage == "garbage":
        client.set(victim, b"garbage")
    elif damage == "truncated":
        client.set(victim, record[:-1])
    elif damage == "flipped":
        client.set(victim, record[:-5] + bytes([record[-5] ^ 0xFF]) + record[-4:])
    else:  # a valid record of another key
        client.set(victim, client.get(h.tier.redis_key(keys[0])))

    sentinel = torch.full((3, BLOCK), 7, dtype=torch.uint8)
    h.pool[30:33] = sentinel
    with caplog.at_level(logging.WARNING, logger="kvactors.tiers.redis"):
        res = h.result(h.load(keys, range(30, 33)))
    assert not res.success and res.error is not None and "corrupt" in res.error
    assert res.successful_keys == (keys[0], keys[2])  # the job ended per key
    assert torch.equal(h.pool[31], sentinel[1])  # the bad key's row is not written
    assert torch.equal(h.pool[30], h.pool[0]) and torch.equal(h.pool[32], h.pool[2])  # the others loaded
    assert h.tier.take_events() == [OffloadingEvent((keys[1],), "redis", removed=True)]
    assert h.tier.lookup(keys, CTX) == [HIT, MISS, HIT]
    assert client.exists(victim) == 0
    failed = [r for r in caplog.records if getattr(r, "kvactors_event", {}).get("event") == "job_failed"]
    assert failed and failed[0].kvactors_event["tier"] == "redis" and failed[0].kvactors_event["job_id"] == res.job_id
    client.close()


def test_unreachable_at_construction_then_recovers(
    redis_server_factory: Callable[..., RedisServer], make_tier: Callable[..., Harness]
) -> None:
    port = free_port()
    h = make_tier(f"redis://127.0.0.1:{port}/0", retry_after_s=0.05)
    keys = keys_("u", 2)
    assert h.tier.lookup(keys, CTX) == [MISS, MISS]
    res = h.result(h.store(keys, range(2)))
    assert not res.success
    res = h.result(h.load(keys, range(2)))
    assert not res.success
    h.tier.touch(keys, CTX)  # never raises

    redis_server_factory(port=port).start()
    deadline = time.monotonic() + WAIT
    while True:  # poll: the tier retries once its back-off has passed
        res = h.result(h.store(keys, range(2)))
        if res.success:
            break
        assert time.monotonic() < deadline, res.error
        time.sleep(0.01)
    assert h.tier.lookup(keys, CTX) == [HIT, HIT]
    h.load_ok(keys, range(5, 7))
    assert torch.equal(h.pool[5:7], h.pool[0:2])


def test_timeout_answers_retry(redis_server: RedisServer, make_tier: Callable[..., Harness]) -> None:
    h = make_tier(redis_server.url, timeout_s=0.2, retry_after_s=0.05)
    keys = keys_("t", 2)
    h.store_ok(keys, range(2))
    admin = redis.Redis.from_url(redis_server.url)
    # Pauses every client (CLIENT UNPAUSE included) for 2 s: both lookups below must see it on a
    # loaded machine too (each gives up after timeout_s).
    admin.execute_command("CLIENT", "PAUSE", 2000, "ALL")
    admin.close()
    assert h.tier.lookup(keys, CTX) == [RETRY, RETRY]
    assert h.tier.lookup(keys, CTX) == [RETRY, RETRY]  # backing off: no round trip
    deadline = time.monotonic() + WAIT
    while (got := h.tier.lookup(keys, CTX)) != [HIT, HIT]:
        assert time.monotonic() < deadline, got
        time.sleep(0.01)


def test_server_killed_mid_run_every_job_reported_once_then_restart(
    redis_server: RedisServer, make_tier: Callable[..., Harness]
) -> None:
    h = make_tier(redis_server.url, rows=128, block=64 * 1024, io_workers=4, retry_after_s=0.05)
    h.store_ok(keys_("warm", 1), [0])
    admin = redis.Redis.from_url(redis_server.url)
    admin.execute_command("CLIENT", "PAUSE", 10_000, "WRITE")  # stores stay in flight until the kill
    admin.close()
    ids: list[int] = []
    for j in range(40):
        rows = [(j * 8 + i) % 128 for i in range(8)]
        keys = [f"k-{j}-{i}".encode() for i in range(8)]
        ids.append(h.store(keys, rows) if j % 2 == 0 else h.load(keys, rows))
    first = h.result()
    redis_server.kill()
    got = [first, *h.results(len(ids) - 1)]
    assert sorted(r.job_id for r in got) == sorted(ids)
    h.tier.drain(WAIT)
    assert h.reports.empty()
    stores = {i for j, i in enumerate(ids) if j % 2 == 0}
    assert all(not r.success for r in got if r.job_id in stores)
    assert h.tier.lookup([b"k-0-0"], CTX) == [MISS]

    redis_server.restart()
    keys = keys_("after", 4)
    deadline = time.monotonic() + WAIT
    while not (res := h.result(h.store(keys, range(4)))).success:
        assert time.monotonic() < deadline, res.error
        time.sleep(0.01)
    h.load_ok(keys, range(100, 104))
    assert torch.equal(h.pool[100:104], h.pool[:4])


def test_shutdown_reports_queued_jobs_exactly_once(
    redis_server: RedisServer, make_tier: Callable[..., Harness]
) -> None:
    h = make_tier(redis_server.url, io_workers=1, timeout_s=0.3)
    h.store_ok(keys_("w", 1), [0])  # connected
    admin = redis.Redis.from_url(redis_server.url)
    admin.execute_command("CLIENT", "PAUSE", 5000, "WRITE")  # stores block in the server
    try:
        ids = [h.store(keys_(f"q{j}", 2), [2 * j, 2 * j + 1]) for j in range(20)]
        ids.append(h.load(keys_("w", 1), [50]))
        h.tier.shutdown()
        got = [h.reports.get_nowait() for _ in range(len(ids))]  # all reported by now
        assert sorted(r.job_id for r in got) == sorted(ids)
        assert h.reports.empty()
        assert sum(not r.success for r in got) >= 19
        # after shutdown: jobs fail at once (reported once), lookups miss, nothing raises
        late = h.store(keys_("late", 1), [0])
        assert h.reports.get_nowait() == JobResult(late, False, "tier shut down")
        assert h.tier.lookup(keys_("w", 1), CTX) == [MISS]
        h.tier.touch(keys_("w", 1), CTX)
        h.tier.shutdown()  # twice is fine
        assert h.reports.empty()
    finally:
        admin.execute_command("CLIENT", "UNPAUSE")
        admin.close()


def test_capacity_evicts_least_recently_used(
    redis_server: RedisServer, make_tier: Callable[..., Harness]
) -> None:
    record = BLOCK + 64  # header + key + payload, approximately
    h = make_tier(redis_server.url, capacity_bytes=4 * record, namespace="cap")
    keys = keys_("e", 6)
    for i in range(4):
        h.store_ok([keys[i]], [i])
    h.tier.touch([keys[0]], CTX)  # keys[1] becomes the oldest
    h.tier.drain(WAIT)
    h.tier.take_events()
    h.store_ok([keys[4]], [4])
    h.store_ok([keys[5]], [5])
    events = h.tier.take_events()
    removed = [k for e in events if e.removed for k in e.keys]
    stored = [k for e in events if not e.removed for k in e.keys]
    assert stored == [keys[4], keys[5]]
    assert removed == [keys[1], keys[2]]
    assert h.tier.lookup(keys, CTX) == [HIT, MISS, MISS, HIT, HIT, HIT]
    res = h.result(h.load([keys[1]], [40]))  # evicted: a failed job, not an exception
    assert not res.success and res.error is not None and "missing" in res.error


def test_a_store_larger_than_the_room_fails_the_keys_it_evicted_itself(
    redis_server: RedisServer, make_tier: Callable[..., Harness]
) -> None:
    """Exactly the keys reported successful are in the tier, as DiskTier and MemoryTier promise."""
    record = BLOCK + 64
    h = make_tier(redis_server.url, capacity_bytes=2 * record, namespace="self")
    keys = keys_("s", 6)
    res = h.result(h.store(keys, range(6)))
    assert not res.success and res.successful_keys is not None and len(res.successful_keys) == 2
    present = [k for k, r in zip(keys, h.tier.lookup(keys, CTX), strict=True) if r is HIT]
    assert sorted(res.successful_keys) == sorted(present)
    for key in res.successful_keys:
        h.load_ok([key], [20])
        assert torch.equal(h.pool[20], h.pool[keys.index(key)])


def test_out_of_memory_leaves_no_block_uncounted(
    redis_server_factory: Callable[..., RedisServer], make_tier: Callable[..., Harness]
) -> None:
    """A full server with ``noeviction`` refuses writes, and may take a job's blocks and then
    refuse their LRU entries: such a block would never be counted or evicted by the tier.
    However the refusals fall, every block present is tracked (and only those), and every key
    reported stored is present."""
    server = redis_server_factory(maxmemory="3mb", extra_args=("--maxmemory-policy", "noeviction")).start()
    h = make_tier(server.url, capacity_bytes=1 << 30, namespace="oom")
    client = redis.Redis.from_url(server.url)
    reported: set[bytes] = set()
    refused = 0
    for job in range(40):  # 40 jobs of 8 blocks of 16 KiB: 5 MiB, past the 3 MiB
        keys = keys_(f"o{job}", 8)
        res = h.result(h.store(keys, range(8)))
        stored = keys if res.success else list(res.successful_keys or ())
        reported.update(stored)
        refused += len(keys) - len(stored)
    assert refused, "the server never ran out of memory"
    members = {bytes.fromhex(m.decode()) for m in client.zrange(b"oom:__lru__", 0, -1)}
    present = {bytes.fromhex(k[len(b"oom:"):].decode()) for k in client.scan_iter(match=b"oom:*")
               if k != b"oom:__lru__"}
    assert present == members
    assert reported <= present
    client.close()


def test_a_key_deleted_after_its_lru_entry_was_refused_is_announced_removed(
    redis_server: RedisServer, make_tier: Callable[..., Harness]
) -> None:
    """A re-store whose LRU entry the server refuses deletes the key, which the first store
    announced: its removal is announced too, even when the rest of the clean-up fails."""
    h = make_tier(redis_server.url, capacity_bytes=1 << 30, namespace="wt")
    (key,) = keys_("w", 1)
    h.store_ok([key], [0])
    assert h.tier.take_events() == [OffloadingEvent((key,), "redis", removed=False)]
    client = redis.Redis.from_url(redis_server.url)
    client.set(b"wt:__lru__", b"not a sorted set")  # every ZADD and ZREM on it fails (WRONGTYPE)
    res = h.result(h.store([key], [1]))
    assert not res.success and not res.successful_keys and res.error is not None and "WRONGTYPE" in res.error
    assert not client.exists(h.tier.redis_key(key))
    assert h.tier.take_events() == [OffloadingEvent((key,), "redis", removed=True)]
    assert h.tier.lookup([key], CTX) == [MISS]
    client.close()


def test_io_threads_are_named(redis_server: RedisServer, make_tier: Callable[..., Harness]) -> None:
    h = make_tier(redis_server.url, name="named", io_workers=2)
    h.store_ok(keys_("n", 1), [0])
    names = {t.name for t in threading.enumerate()}
    assert "kvactors-redis-named-0" in names


def test_bad_job_and_unattached_are_reported_not_raised(redis_server: RedisServer) -> None:
    tier = RedisTier(redis_server.url)
    try:
        reports: queue.Queue[JobResult] = queue.Queue()
        tier.attach(torch.zeros((4, 128), dtype=torch.uint8), reports.put)
        tier.submit_store(TransferJob(7, (b"a", b"b"), (0,), CTX, False))
        res = reports.get(timeout=WAIT)
        assert res.job_id == 7 and not res.success
        tier.submit_load(TransferJob(8, (), (), CTX, True))  # empty: succeeds, no I/O
        assert reports.get(timeout=WAIT) == JobResult(8, True, None)
    finally:
        tier.shutdown()
    with pytest.raises(ValueError):
        RedisTier(redis_server.url, namespace="")
    with pytest.raises(ValueError):
        RedisTier(redis_server.url, capacity_bytes=0)
