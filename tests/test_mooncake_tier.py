"""MooncakeTier against a real Mooncake Store: a ``mooncake_master`` and holder clients in
separate processes (tests/mooncake_store.py), each fault of the issue in turn. Skipped when
Mooncake is not installed (scripts/setup.sh installs it)."""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Iterator, Sequence

import pytest
import torch

from kvactors.tiers import codec
from kvactors.tiers.mooncake_store import CallLane, LaneBusy, LaneTimeout, parse_master
from kvactors.types import JobResult, LookupResult, ReqContext, TransferJob
from tests.mooncake_store import Holder, MooncakeMaster, free_port, mooncake_usable
from tests.support import wait_for

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(90)]
needs_mooncake = pytest.mark.skipif(not mooncake_usable(), reason="Mooncake Store is not installed")

BLOCK = 64 * 1024
ROWS = 64
TIMEOUT = 1.0  # the tier's timeout_s: every bound below is a few of these
WAIT = 15.0
CTX = ReqContext("r")
HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY


class Harness:
    """A tier attached to its own random pool; reports go into a queue."""

    _job_ids = itertools.count(1)

    def __init__(self, master: str, **kwargs: object) -> None:
        from kvactors.tiers.mooncake import MooncakeTier

        gen = torch.Generator().manual_seed(0)
        self.pool = torch.randint(0, 256, (ROWS, BLOCK), dtype=torch.uint8, generator=gen)
        self.reports: queue.Queue[JobResult] = queue.Queue()
        options: dict = {"timeout_s": TIMEOUT, "retry_after_s": 0.2, "io_workers": 2} | kwargs
        self.tier = MooncakeTier(master, **options)
        self.tier.attach(self.pool, self.reports.put)

    def run(self, keys: Sequence[bytes], rows: Sequence[int], *, load: bool) -> tuple[JobResult, float]:
        job = TransferJob(next(self._job_ids), tuple(keys), tuple(rows), CTX, load)
        start = time.monotonic()
        (self.tier.submit_load if load else self.tier.submit_store)(job)
        result = self.reports.get(timeout=WAIT)
        assert result.job_id == job.job_id
        return result, time.monotonic() - start

    def store(self, keys: Sequence[bytes], rows: Sequence[int]) -> JobResult:
        return self.run(keys, rows, load=False)[0]

    def load(self, keys: Sequence[bytes], rows: Sequence[int]) -> JobResult:
        return self.run(keys, rows, load=True)[0]

    def lookup(self, keys: Sequence[bytes]) -> list[LookupResult]:
        return self.tier.lookup(keys, CTX)

    def close(self) -> None:
        self.tier.drain(5.0)
        self.tier.shutdown()


def keys_(n: int, tag: bytes = b"k") -> list[bytes]:
    return [tag + i.to_bytes(4, "big") for i in range(n)]


@pytest.fixture(scope="module")
def store() -> Iterator[tuple[MooncakeMaster, Holder]]:
    """One master and one holder (64 MiB) shared by the tests that break neither."""
    if not mooncake_usable():
        pytest.skip("Mooncake Store is not installed")
    with MooncakeMaster() as master, Holder(master.address) as holder:
        yield master, holder


@pytest.fixture
def harness(store: tuple[MooncakeMaster, Holder]) -> Iterator[Harness]:
    h = Harness(store[0].address, namespace=f"t{next(_namespaces)}")
    yield h
    h.close()


_namespaces = itertools.count()


# ---------------------------------------------------------------- no store needed

def test_lane_refuses_when_every_thread_is_stuck_and_bounds_each_wait() -> None:
    lane = CallLane(threads=2, thread_name="test-lane")
    release = threading.Event()
    try:
        assert lane.call(lambda: 7, 1.0) == 7
        for _ in range(2):
            with pytest.raises(LaneTimeout):
                lane.call(lambda: release.wait(30), 0.05)
        assert lane.in_flight == 2
        with pytest.raises(LaneBusy):
            lane.submit(lambda: 1)
        release.set()
        assert wait_for(lambda: lane.in_flight == 0, 5.0)
        assert lane.call(lambda: 8, 1.0) == 8
    finally:
        release.set()
        assert lane.close(5.0) == 0
    with pytest.raises(LaneBusy):
        lane.submit(lambda: 1)


@needs_mooncake
@pytest.mark.parametrize(("args", "kwargs", "error"), [
    ((None,), {}, TypeError),
    (("localhost",), {}, ValueError),
    (("host:0",), {}, ValueError),
    (("host:70000",), {}, ValueError),
    (("h:1",), {"segment_bytes": 1 << 20}, ValueError),
    (("h:1",), {"segment_bytes": -1}, ValueError),
    (("h:1",), {"segment_bytes": True}, ValueError),
    (("h:1",), {"namespace": ""}, ValueError),
    (("h:1",), {"timeout_s": 0}, ValueError),
    (("h:1",), {"io_workers": 0}, ValueError),
    (("h:1",), {"local_buffer_bytes": 10}, ValueError),
    (("h:1",), {"local_host": ""}, ValueError),
])
def test_bad_arguments_raise(args: tuple, kwargs: dict, error: type[Exception]) -> None:
    from kvactors.tiers.mooncake import MooncakeTier

    with pytest.raises(error):
        MooncakeTier(*args, **kwargs)


def test_parse_master() -> None:
    assert parse_master("mc-master:50051") == ("mc-master", 50051)
    assert parse_master("[::1]:50051") == ("::1", 50051)


@needs_mooncake
def test_no_master_fails_jobs_and_misses_promptly() -> None:
    h = Harness(f"127.0.0.1:{free_port()}")
    try:
        result, took = h.run(keys_(2), [0, 1], load=False)
        assert not result.success and took < 4 * TIMEOUT
        assert h.lookup(keys_(2)) == [MISS, MISS]
    finally:
        h.close()


# ---------------------------------------------------------------- a healthy store

@needs_mooncake
def test_round_trip_is_byte_exact(harness: Harness) -> None:
    keys = keys_(20)
    assert harness.lookup(keys) == [MISS] * 20
    assert harness.store(keys, range(20)).success
    assert harness.lookup([*keys, b"other"]) == [HIT] * 20 + [MISS]
    # Repeated keys, and a job spanning several chunks would be the same path: rows 20..39.
    result = harness.load([*keys, keys[0]], [*range(20, 40), 40])
    assert result.success, result
    assert torch.equal(harness.pool[20:40], harness.pool[0:20])
    assert torch.equal(harness.pool[40], harness.pool[0])
    events = harness.tier.take_events()
    assert [(set(e.keys), e.removed) for e in events] == [(set(keys), False)]


@needs_mooncake
def test_missing_key_fails_alone(harness: Harness) -> None:
    keys = keys_(3)
    assert harness.store(keys[:2], [0, 1]).success
    before = harness.pool[12].clone()
    result = harness.load(keys, [10, 11, 12])
    assert not result.success and result.successful_keys == tuple(keys[:2])
    assert torch.equal(harness.pool[10:12], harness.pool[0:2])
    assert torch.equal(harness.pool[12], before)  # the missing key's row is not written


@needs_mooncake
@pytest.mark.parametrize("damage", ["payload", "key", "short", "empty"])
def test_corrupt_or_foreign_object_is_a_miss(harness: Harness, damage: str) -> None:
    key = b"victim"
    payload = harness.pool[0].numpy().tobytes()
    record = bytearray(codec.encode(key, payload))
    if damage == "payload":
        record[-1] ^= 0xFF
    elif damage == "key":
        record = bytearray(codec.encode(b"VICTIM", payload))
    elif damage == "short":
        record = record[:100]
    else:
        record = bytearray(b"x")
    conn = harness.tier._connection(wait=5.0)
    assert conn is not None
    assert conn.store.upsert(harness.tier.object_key(key), bytes(record)) == 0
    before = harness.pool[5].clone()
    result = harness.load([key], [5])
    assert not result.success
    assert torch.equal(harness.pool[5], before)
    if damage in ("payload", "key"):  # a record of our size that fails verification is removed
        assert harness.lookup([key]) == [MISS]


# ---------------------------------------------------------------- faults

@needs_mooncake
def test_dead_holder_is_a_miss_never_data() -> None:
    with MooncakeMaster() as master:
        holder = Holder(master.address).start()
        h = Harness(master.address)
        try:
            keys = keys_(4)
            assert h.store(keys, range(4)).success
            holder.kill()
            before = h.pool[10:14].clone()
            result, took = h.run(keys, range(10, 14), load=True)
            assert not result.success and not result.successful_keys
            assert took < 4 * TIMEOUT
            assert torch.equal(h.pool[10:14], before)
            # Once the master drops the holder (client_ttl), its keys are misses.
            assert wait_for(lambda: h.lookup(keys) == [MISS] * 4, WAIT, interval=0.2)
        finally:
            h.close()
            holder.kill()


@needs_mooncake
def test_frozen_holder_fails_at_the_deadline_and_recovers() -> None:
    with MooncakeMaster() as master, Holder(master.address) as holder:
        h = Harness(master.address)
        try:
            keys = keys_(4)
            assert h.store(keys, range(4)).success
            holder.freeze()
            before = h.pool[10:14].clone()
            result, took = h.run(keys, range(10, 14), load=True)
            assert not result.success
            assert took < 3 * TIMEOUT + 1.0
            results = h.lookup(keys)  # metadata only: the master answers
            assert all(r in (HIT, MISS, RETRY) for r in results)
            assert h.tier._lane.in_flight <= h.tier.max_stuck_threads
            assert torch.equal(h.pool[10:14], before)
            holder.thaw()
            with Holder(master.address):
                # The store works again: a new key round-trips.
                def fresh_round_trip() -> bool:
                    return h.store([b"fresh"], [20]).success and h.load([b"fresh"], [21]).success
                assert wait_for(fresh_round_trip, WAIT * 2, interval=0.3)
                assert torch.equal(h.pool[21], h.pool[20])
        finally:
            holder.thaw()
            h.close()


@needs_mooncake
def test_master_killed_fails_jobs_then_recovers_after_restart_with_keys_lost() -> None:
    with MooncakeMaster() as master:
        h = Harness(master.address, segment_bytes=32 << 20)  # this process holds the data
        try:
            keys = keys_(4)
            assert h.store(keys, range(4)).success
            master.kill()
            result, took = h.run(keys, range(10, 14), load=True)
            assert not result.success and took < 4 * TIMEOUT
            assert not h.store(keys_(2, b"n"), [0, 1]).success
            assert all(r in (MISS, RETRY) for r in h.lookup(keys))
            master.start()

            def recovered() -> bool:
                return h.store([b"after"], [6]).success

            assert wait_for(recovered, WAIT * 2, interval=0.3)
            assert h.lookup(keys) == [MISS] * 4  # the restarted master lost every key
            assert not h.load(keys, range(10, 14)).success
            assert h.load([b"after"], [7]).success and torch.equal(h.pool[7], h.pool[6])
        finally:
            h.close()


@needs_mooncake
def test_frozen_master_is_bounded_then_recovers() -> None:
    with MooncakeMaster() as master:
        h = Harness(master.address, segment_bytes=32 << 20)
        try:
            keys = keys_(2)
            assert h.store(keys, [0, 1]).success
            master.freeze()
            start = time.monotonic()
            h.lookup(keys)  # any answer (the client may still know the keys), but in time
            assert time.monotonic() - start < 3 * TIMEOUT
            result, took = h.run(keys, [10, 11], load=True)
            assert not result.success and took < 3 * TIMEOUT + 1.0
            assert h.tier._lane.in_flight <= h.tier.max_stuck_threads
            master.thaw()
            assert wait_for(lambda: h.store([b"later"], [2]).success, WAIT * 3, interval=0.3)
        finally:
            master.thaw()
            h.close()


@needs_mooncake
def test_capacity_eviction_is_a_miss_never_data() -> None:
    with MooncakeMaster() as master, Holder(master.address, segment_bytes=16 << 20):
        h = Harness(master.address)
        try:
            # 16 MiB hold about 250 blocks of 64 KiB. Past them stores fail (the master
            # evicts in the background, objects whose lease ran out), then succeed again.
            batches = [keys_(32, b"b%02d" % i) for i in range(12)]
            outcomes = [h.store(batch, range(32)) for batch in batches]
            assert outcomes[0].success
            refused = [r for r in outcomes if not r.success]
            assert refused, "a 16 MiB segment took 24 MiB"

            def room_again() -> bool:
                return h.store(keys_(32, b"late"), range(32)).success

            assert wait_for(room_again, WAIT * 2, interval=0.3)
            all_keys = [k for batch in batches for k in batch]
            present = [r == HIT for r in h.lookup(all_keys)]
            assert not all(present)  # evicted, or never stored: misses
            for n, key in enumerate(all_keys[::7]):
                result = h.load([key], [40 + n % 8])
                if result.success:  # whatever survived is the right data
                    assert torch.equal(h.pool[40 + n % 8], h.pool[all_keys.index(key) % 32])
        finally:
            h.close()


# ---------------------------------------------------------------- the vLLM tiers entry

def test_vllm_entry_keys_are_checked() -> None:
    from kvactors.integrations.vllm.config import parse_config

    ok = parse_config({"cpu_bytes_to_use": 1 << 20, "tiers": [
        {"type": "mooncake", "master": "mc:50051", "segment_bytes": 16 << 20}]})
    assert ok.tiers[0].options["master"] == "mc:50051"
    with pytest.raises(ValueError, match=r"tiers\[0\]\.master is required"):
        parse_config({"cpu_bytes_to_use": 1 << 20, "tiers": [{"type": "mooncake"}]})
    with pytest.raises(ValueError, match=r"unknown key tiers\[0\]\.url"):
        parse_config({"cpu_bytes_to_use": 1 << 20, "tiers": [{"type": "mooncake", "master": "m:1", "url": "x"}]})
    with pytest.raises(ValueError, match=r"tiers\[0\]\.master must be a non-empty string"):
        parse_config({"cpu_bytes_to_use": 1 << 20, "tiers": [{"type": "mooncake", "master": ""}]})


@needs_mooncake
def test_vllm_entry_builds_a_mooncake_tier_and_names_a_bad_value() -> None:
    from kvactors.integrations.vllm.config import build_tiers, parse_config
    from kvactors.tiers.mooncake import MooncakeTier

    config = parse_config({"cpu_bytes_to_use": 1 << 20, "tiers": [
        {"type": "mooncake", "master": f"127.0.0.1:{free_port()}", "namespace": "n", "timeout_s": 0.5}]})
    (tier,) = build_tiers(config, None)
    try:
        assert isinstance(tier, MooncakeTier) and tier.namespace == "n" and tier.timeout_s == 0.5
        assert tier.max_stuck_threads == tier.io_workers + 2
    finally:
        tier.shutdown()
    bad = parse_config({"cpu_bytes_to_use": 1 << 20, "tiers": [
        {"type": "mooncake", "master": "m:1", "segment_bytes": 1 << 20}]})
    with pytest.raises(ValueError, match=r"tiers\[0\] \(mooncake\): segment_bytes"):
        build_tiers(bad, None)
