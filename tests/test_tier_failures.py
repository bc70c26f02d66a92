"""Issue 14 item 3: a load that fails is a miss, for that key only; jobs end per key.

Through the whole ``TieringManager``: three blocks are stored (and cascaded to
the tier), the pool is reset (the tier keeps them), one block is damaged at
the tier, and a lookup promotes all three in one job. The job must end per
key: the good keys become ``HIT`` (with their bytes), the bad one a ``MISS``
that has left the tier, within ``transfer_timeout_s``, and a second lookup
does not promote it again.
"""

from __future__ import annotations

import errno
import os
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import redis
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvactors import (
    DiskTier,
    JobResult,
    LookupResult,
    MemoryTier,
    OffloadingEvent,
    OffloadKey,
    RedisTier,
    ReqContext,
    TieringManager,
    TransferJob,
)
from kvactors.core.outcomes import key_outcomes
from kvactors.core.quarantine import PromotionQuarantine
from kvactors.testing import SimRuntime
from kvactors.testing.tiers import pattern
from kvactors.tiers import codec

HIT, MISS, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING
BLOCK = 4096
TIMEOUT_S = 10.0
A, B, C = b"key-a", b"key-b", b"key-c"
KEYS = (A, B, C)


def store_and_forget(manager: TieringManager, keys: Sequence[OffloadKey]) -> None:
    """Store ``keys`` (bytes ``pattern(key)``), let them cascade, then clear the pool."""
    writer = ReqContext("writer")
    manager.on_new_request(writer)
    out = manager.prepare_store(list(keys), writer)
    assert out is not None and out.keys_to_store == list(keys)
    for key, row in zip(out.keys_to_store, out.store_spec.block_ids, strict=True):
        manager.pool[row] = pattern(key, BLOCK)
    manager.complete_store(out.keys_to_store, writer)
    manager.on_request_finished(writer)
    assert manager.wait_idle(TIMEOUT_S)
    manager.reset_cache()
    manager.take_events()


def promote_and_check(manager: TieringManager, bad: OffloadKey, tier: str) -> None:
    """One promotion of A, B, C: B fails, A and C load; B stays a miss and is not promoted again."""
    reader = ReqContext("reader")
    manager.on_new_request(reader)
    started = time.monotonic()
    assert manager.lookup(list(KEYS), reader) == [PENDING] * 3
    assert manager.wait_idle(TIMEOUT_S)
    assert time.monotonic() - started < TIMEOUT_S  # ended by the tier's report, not by a deadline
    good = [key for key in KEYS if key != bad]
    expected = [MISS if key == bad else HIT for key in KEYS]
    assert manager.lookup(list(KEYS), reader) == expected  # the first promotion already settled it
    spec = manager.prepare_load(good, reader)
    for key, row in zip(good, spec.block_ids, strict=True):
        assert torch.equal(manager.pool[row], pattern(key, BLOCK)), "a good key loaded wrong bytes"
    manager.complete_load(good, reader)
    events = manager.take_events()
    stored_cpu = {k for e in events if e.tier == "cpu" and not e.removed for k in e.keys}
    assert stored_cpu == set(good)
    assert OffloadingEvent((bad,), tier, True) in events  # the bad block left the tier, and says so
    submitted = manager.stats()["jobs_submitted"]
    assert manager.lookup([bad], reader) == [MISS]
    assert manager.wait_idle(TIMEOUT_S)
    stats = manager.stats()
    assert stats["jobs_submitted"] == submitted, "the bad key was promoted again"
    assert stats["jobs_partial"] == 1 and stats["job_keys_failed"] == 1
    manager.on_request_finished(reader)
    stats = manager.stats() if manager.wait_idle(TIMEOUT_S) else {}
    assert stats["active_requests"] == 0 and stats["blocks_pinned"] == 0 and stats["blocks_pending"] == 0


# ---------------------------------------------------------------- DiskTier


def _fd_path(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


DISK_DAMAGE = ("eio", "eacces", "directory", "symlink", "missing", "empty", "truncated", "other_format",
               "key_mismatch", "checksum", "eio_in_group", "truncated_in_group", "checksum_in_group")
"""Kinds ending ``_in_group`` damage B inside a file that holds A, C and B (in that order);
the others damage a file that holds B alone (each key is stored on its own first)."""


def damage_file(kind: str, tier: DiskTier, monkeypatch: pytest.MonkeyPatch) -> None:
    found, other = tier.locate(B), tier.locate(A)
    assert found is not None and other is not None
    victim, offset, length = Path(found[0]), found[1], found[2]
    kind = kind.removesuffix("_in_group")
    if kind == "eio":  # a read that covers B's bytes fails
        preadv = os.preadv

        def failing_preadv(fd: int, buffers: Sequence[memoryview], at: int) -> int:
            size = sum(memoryview(b).nbytes for b in buffers)
            if _fd_path(fd) == str(victim) and at <= offset < at + size:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return preadv(fd, buffers, at)

        monkeypatch.setattr(os, "preadv", failing_preadv)
    elif kind == "eacces":  # chmod 000 does not deny root: refuse the open itself
        real_open = os.open

        def denying_open(path: str, flags: int, *args: int, **kwargs: int) -> int:
            if os.fspath(path) == str(victim):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
            return real_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(os, "open", denying_open)
    elif kind == "directory":
        victim.unlink()
        victim.mkdir()
    elif kind == "symlink":  # to a valid file of another key
        victim.unlink()
        victim.symlink_to(other[0])
    elif kind == "missing":
        victim.unlink()
    elif kind == "empty":
        victim.write_bytes(b"")
    elif kind == "truncated":  # in the middle of B's payload (the file's last)
        data = victim.read_bytes()
        assert len(data) == offset + length
        victim.write_bytes(data[: offset + length // 2])
    elif kind == "other_format":  # a file of another version: same layout, other magic
        data = victim.read_bytes()
        victim.write_bytes(b"KVA1" + data[4:])
    elif kind == "key_mismatch":  # the file holds another key's block
        shutil.copyfile(other[0], victim)
    elif kind == "checksum":
        data = bytearray(victim.read_bytes())
        data[offset + length - 1] ^= 0xFF
        victim.write_bytes(bytes(data))
    else:
        raise AssertionError(kind)


@pytest.mark.parametrize("kind", DISK_DAMAGE)
def test_disk_block_that_cannot_be_read_is_a_miss_for_that_key_only(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "disk"
    tier = DiskTier(root, capacity_bytes=1 << 24)
    with TieringManager.start(num_blocks=8, block_bytes=BLOCK, secondary_tiers=[tier],
                              transfer_timeout_s=TIMEOUT_S) as manager:
        if kind.endswith("_in_group"):
            store_and_forget(manager, (A, C, B))
            assert len({found[0] for found in map(tier.locate, KEYS) if found}) == 1  # one file
        else:
            for key in KEYS:
                store_and_forget(manager, [key])
        assert all(key in tier for key in KEYS)
        damage_file(kind, tier, monkeypatch)
        promote_and_check(manager, B, "disk")
        assert B not in tier and A in tier and C in tier


def test_disk_store_that_fails_for_one_key_stores_the_others(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cascade ends per key too: the key whose write failed is not in the tier, nor in its events."""
    tier = DiskTier(tmp_path / "disk", capacity_bytes=1 << 24)
    writev = os.writev
    payload_b = pattern(B, BLOCK).numpy().tobytes()

    def failing_writev(fd: int, buffers: Sequence[bytes | memoryview]) -> int:
        if any(bytes(buf) == payload_b for buf in buffers[1:]):  # a file that would hold B
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return writev(fd, buffers)

    monkeypatch.setattr(os, "writev", failing_writev)
    with TieringManager.start(num_blocks=8, block_bytes=BLOCK, secondary_tiers=[tier],
                              transfer_timeout_s=TIMEOUT_S) as manager:
        store_and_forget(manager, KEYS)
        assert [key in tier for key in KEYS] == [True, False, True]
        stats = manager.stats()
        assert stats["jobs_partial"] == 1 and stats["job_keys_failed"] == 1


def test_disk_store_events_name_exactly_the_keys_stored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = DiskTier(tmp_path / "disk", capacity_bytes=1 << 24)
    pool = torch.stack([pattern(key, BLOCK) for key in KEYS])
    reports: list[JobResult] = []
    tier.attach(pool, reports.append)
    real_open = os.open

    def no_space_for_b(path: str, flags: int, *args: int, **kwargs: int) -> int:
        if flags & os.O_CREAT and getattr(no_space_for_b, "next_is_b", False):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return real_open(path, flags, *args, **kwargs)

    # Store A and C first, then B fails on its own job: its events must not name it.
    tier.submit_store(TransferJob(1, (A, C), (0, 2), ReqContext("r"), False))
    tier.drain(TIMEOUT_S)
    no_space_for_b.next_is_b = True  # type: ignore[attr-defined]
    monkeypatch.setattr(os, "open", no_space_for_b)
    tier.submit_store(TransferJob(2, (A, B, C), (0, 1, 2), ReqContext("r"), False))
    tier.drain(TIMEOUT_S)
    tier.shutdown()
    assert reports[0] == JobResult(1, True)
    assert reports[1].success is False and reports[1].successful_keys == (A, C)
    assert [k for e in tier.take_events() if not e.removed for k in e.keys] == [A, C]


# ---------------------------------------------------------------- RedisTier


REDIS_DAMAGE = ("list", "hash", "set", "truncated", "garbage", "empty")


@pytest.mark.redis
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", REDIS_DAMAGE)
def test_redis_value_that_cannot_be_read_is_a_miss_for_that_key_only(kind: str, redis_server: object) -> None:
    url = redis_server.url  # type: ignore[attr-defined]
    tier = RedisTier(url, namespace=f"tierfail-{kind}")
    client = redis.Redis.from_url(url)
    with TieringManager.start(num_blocks=8, block_bytes=BLOCK, secondary_tiers=[tier],
                              transfer_timeout_s=TIMEOUT_S) as manager:
        store_and_forget(manager, KEYS)
        victim = tier.redis_key(B)
        record = client.get(victim)
        assert record is not None
        if kind == "truncated":
            client.set(victim, record[: len(record) - 100])
        elif kind == "garbage":
            client.set(victim, b"\x00garbage" * 100)
        elif kind == "empty":
            client.set(victim, b"")
        else:
            client.delete(victim)
            {"list": lambda: client.rpush(victim, record), "hash": lambda: client.hset(victim, "v", record),
             "set": lambda: client.sadd(victim, record)}[kind]()
        promote_and_check(manager, B, "redis")
        assert client.exists(victim) == 0  # the value that cannot be read is gone: a miss for everyone
    client.close()


# ---------------------------------------------------------------- sloppy custom tiers


class ScriptedTier(MemoryTier):
    """A MemoryTier whose loads report what ``script(job)`` says (after copying every row)."""

    def __init__(self, script: Callable[[TransferJob], Sequence[JobResult]]) -> None:
        super().__init__(name="scripted", capacity_blocks=64)
        self.script = script
        self.loads = 0

    def submit_load(self, job: TransferJob) -> None:
        assert self.pool is not None
        self.loads += 1
        for key, row in zip(job.keys, job.block_ids, strict=True):
            if key in self._blocks:
                self.pool[row].copy_(self._blocks[key])
        results = self.script(job)
        for key, row in zip(job.keys, job.block_ids, strict=True):
            # What may not become ready holds junk: serving it would show.
            if key not in _may_be_ready(job, results):
                self.pool[row].fill_(0xEE)
        for result in results:
            self.report(result)


def _may_be_ready(job: TransferJob, results: Sequence[JobResult]) -> set[OffloadKey]:
    own = [result for result in results if result.job_id == job.job_id]
    return set(key_outcomes(job.keys, own[0]).ok) if own else set()


SCRIPTS: dict[str, tuple[Callable[[TransferJob], Sequence[JobResult]], set[OffloadKey], dict[str, int]]] = {
    "per_key": (lambda j: [JobResult(j.job_id, False, "b failed", (A, C))], {A, C}, {"jobs_partial": 1}),
    "success_true_names_some": (lambda j: [JobResult(j.job_id, True, None, (A,))], {A}, {"jobs_partial": 1}),
    "duplicates": (lambda j: [JobResult(j.job_id, False, None, (C, C, A, C))], {A, C}, {"jobs_partial": 1}),
    "stranger_key": (lambda j: [JobResult(j.job_id, True, None, (A, B, C, b"other"))], set(), {"invalid_reports": 1}),
    "a_list": (lambda j: [JobResult(j.job_id, True, None, [A, B, C])], set(), {"invalid_reports": 1}),  # type: ignore[arg-type]
    "not_bytes": (lambda j: [JobResult(j.job_id, True, None, (A, "b"))], set(), {"invalid_reports": 1}),  # type: ignore[arg-type]
    # The tuple governs, whatever success says (docs/tiers.md, "A tier of your own"): every key named succeeded.
    "failed_names_all": (lambda j: [JobResult(j.job_id, False, None, (A, B, C))], {A, B, C}, {"invalid_reports": 0}),
    "success_not_bool": (lambda j: [JobResult(j.job_id, "yes")], set(), {"invalid_reports": 1}),  # type: ignore[arg-type]
    "empty_tuple": (lambda j: [JobResult(j.job_id, False, None, ())], set(), {"jobs_partial": 0}),
    "twice": (lambda j: [JobResult(j.job_id, True), JobResult(j.job_id, False)], {A, B, C},
              {"unexpected_reports": 1}),
    "unknown_job_first": (lambda j: [JobResult(j.job_id + 10_000, True), JobResult(j.job_id, False, None, (B,))],
                          {B}, {"unexpected_reports": 1}),
}


@pytest.mark.parametrize("case", sorted(SCRIPTS))
def test_a_sloppy_report_never_makes_wrong_bytes_ready(case: str) -> None:
    script, ready, counters = SCRIPTS[case]
    tier = ScriptedTier(script)
    with TieringManager.start(num_blocks=8, block_bytes=BLOCK, secondary_tiers=[tier],
                              transfer_timeout_s=TIMEOUT_S) as manager:
        store_and_forget(manager, KEYS)
        reader = ReqContext("reader")
        manager.on_new_request(reader)
        assert manager.lookup(list(KEYS), reader) == [PENDING] * 3
        assert manager.wait_idle(TIMEOUT_S)
        results = manager.lookup(list(KEYS), reader)
        assert results == [HIT if key in ready else MISS for key in KEYS]
        if ready:
            keys = [key for key in KEYS if key in ready]
            spec = manager.prepare_load(keys, reader)
            for key, row in zip(keys, spec.block_ids, strict=True):
                assert torch.equal(manager.pool[row], pattern(key, BLOCK))
            manager.complete_load(keys, reader)
        assert manager.wait_idle(TIMEOUT_S)
        assert tier.loads == 1, "a key that failed to load was promoted again at once"
        events = manager.take_events()
        assert {k for e in events if e.tier == "cpu" and not e.removed for k in e.keys} == ready
        manager.on_request_finished(reader)
        assert manager.wait_idle(TIMEOUT_S)
        stats = manager.stats()
        for name, value in counters.items():
            assert stats[name] == value, (name, stats[name])
        assert stats["active_requests"] == 0 and stats["blocks_pending"] == 0 and stats["blocks_pinned"] == 0
        assert stats["internal_errors"] == 0


# ---------------------------------------------------------------- every per-key pattern, in simulation


class SimScriptedTier(MemoryTier):
    """A MemoryTier that reports a drawn outcome per key, later (a deferred task of the simulation)."""

    def __init__(self, runtime: SimRuntime, outcomes: dict[OffloadKey, bool], success: bool,
                 as_tuple: bool) -> None:
        super().__init__(name="sim", capacity_blocks=64)
        self.runtime = runtime
        self.outcomes = outcomes
        self.success = success
        self.as_tuple = as_tuple
        self.finished: list[tuple[str, int]] = []

    def on_request_finished(self, ctx: ReqContext) -> None:
        self.finished.append(ctx.identity)

    def submit_load(self, job: TransferJob) -> None:
        assert self.pool is not None
        pool = self.pool

        def run() -> None:
            ok = tuple(key for key in job.keys if self.outcomes[key])
            for key, row in zip(job.keys, job.block_ids, strict=True):
                if self.outcomes[key]:
                    pool[row].copy_(self._blocks[key])
                else:
                    pool[row].fill_(0xEE)
            named = ok if self.as_tuple else None
            self.report(JobResult(job.job_id, self.success, None, named))

        self.runtime.defer("load", run)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), outcomes=st.lists(st.booleans(), min_size=1, max_size=5),
       success=st.booleans(), as_tuple=st.booleans())
def test_every_per_key_outcome_pattern_is_applied_per_key(seed: int, outcomes: list[bool], success: bool,
                                                          as_tuple: bool) -> None:
    keys = [b"hk%d" % i for i in range(len(outcomes))]
    runtime = SimRuntime(seed, time_jump_chance=0.0)
    table = dict(zip(keys, outcomes, strict=True))
    if not as_tuple:  # every key follows success: the tier copies all rows or none
        table = dict.fromkeys(keys, success)
    tier = SimScriptedTier(runtime, table, success, as_tuple)
    manager = TieringManager.start(num_blocks=8, block_bytes=64, secondary_tiers=[tier], transfer_timeout_s=5.0,
                                   lookup_timeout_s=5.0, runtime=runtime)
    try:
        writer, reader = ReqContext("w"), ReqContext("r")
        manager.on_new_request(writer)
        out = manager.prepare_store(keys, writer)
        assert out is not None
        for key, row in zip(keys, out.store_spec.block_ids, strict=True):
            manager.pool[row] = pattern(key, 64)
        manager.complete_store(keys, writer)
        manager.on_request_finished(writer)
        assert manager.wait_idle(5.0)
        manager.reset_cache()
        manager.take_events()
        manager.on_new_request(reader)
        assert manager.lookup(keys, reader) == [PENDING] * len(keys)
        assert manager.wait_idle(5.0)
        # A tuple governs, whatever success says; without one every key follows success.
        ready = {k for k in keys if table[k]} if as_tuple else set(keys) if success else set()
        results = manager.lookup(keys, reader)
        assert results == [HIT if key in ready else MISS for key in keys]
        for key in ready:
            spec = manager.prepare_load([key], reader)
            assert torch.equal(manager.pool[spec.block_ids[0]], pattern(key, 64))
            manager.complete_load([key], reader)
        events = manager.take_events()
        assert {k for e in events if e.tier == "cpu" and not e.removed for k in e.keys} == ready
        manager.on_request_finished(reader)
        assert manager.wait_idle(5.0)
        stats = manager.stats()
        assert stats["active_requests"] == 0 and stats["blocks_pending"] == 0 and stats["internal_errors"] == 0
        assert sorted(tier.finished) == [("r", 0), ("w", 0)]  # each finalized exactly once
    finally:
        manager.stop()


# ---------------------------------------------------------------- deadlines and back-off


class StallingTier(MemoryTier):
    """Loads are never reported: only deadlines end them."""

    max_inflight_jobs = 1

    def __init__(self) -> None:
        super().__init__(name="stall", capacity_blocks=64)
        self.loads: list[TransferJob] = []

    def submit_load(self, job: TransferJob) -> None:
        self.loads.append(job)


def test_a_queued_promotion_is_not_pending_past_the_transfer_timeout() -> None:
    """A promotion waiting for a tier slot has the same deadline as one sent: from its allocation."""
    runtime = SimRuntime(1, time_jump_chance=0.0)
    tier = StallingTier()
    manager = TieringManager.start(num_blocks=8, block_bytes=64, secondary_tiers=[tier], transfer_timeout_s=1.0,
                                   lookup_timeout_s=1.0, runtime=runtime)
    try:
        writer, reader = ReqContext("w"), ReqContext("r")
        manager.on_new_request(writer)
        out = manager.prepare_store([A, B], writer)
        assert out is not None
        manager.complete_store([A, B], writer)
        manager.on_request_finished(writer)
        assert manager.wait_idle(5.0)
        manager.reset_cache()
        manager.on_new_request(reader)
        assert manager.lookup([A], reader) == [PENDING]  # sent, stalls
        assert manager.lookup([B], reader) == [PENDING]  # queued behind it (one slot)
        started = runtime.now()
        assert manager.wait_idle(5.0)
        assert runtime.now() - started <= 1.0 + 1e-6  # both ended by their own deadline, not one after the other
        assert len(tier.loads) == 1  # the queued one never reached the tier
        assert manager.lookup([A, B], reader) == [MISS, MISS]  # backed off: not promoted again yet
        assert manager.wait_idle(5.0) and len(tier.loads) == 1
        stats = manager.stats()
        # The sent one timed out; the queued one failed unsent: dropped, counted once (as the metrics say).
        assert stats["jobs_timed_out"] == 1 and stats["jobs_dropped"] == 1
        assert stats["promotion_hits_ignored"] == 2
        manager.on_request_finished(reader)
    finally:
        manager.stop(timeout=1.0)


def test_back_off_doubles_up_to_its_bound_and_a_success_clears_it() -> None:
    q = PromotionQuarantine(base_s=1.0, max_s=4.0, capacity=2)
    assert q.failed("t", A, 0.0) == 1.0 and q.blocked("t", A, 0.5) and not q.blocked("t", A, 1.0)
    assert not q.blocked("u", A, 0.5)  # per tier
    assert [q.failed("t", A, 10.0), q.failed("t", A, 20.0), q.failed("t", A, 30.0)] == [2.0, 4.0, 4.0]
    assert q.strikes("t", A) == 4
    q.succeeded("t", A)
    assert not q.blocked("t", A, 30.5) and q.strikes("t", A) == 0
    for key in (A, B, C):
        q.failed("t", key, 40.0)
    assert len(q) == 2 and not q.blocked("t", A, 40.5)  # bounded: the oldest is forgotten
    with pytest.raises(ValueError):
        PromotionQuarantine(base_s=0.0)


@given(keys=st.lists(st.binary(min_size=1, max_size=3), min_size=1, max_size=6),
       named=st.one_of(st.none(), st.lists(st.binary(min_size=1, max_size=3), max_size=8)),
       success=st.booleans())
def test_key_outcomes_never_names_a_stranger_and_partitions_the_job(keys: list[bytes], named: list[bytes] | None,
                                                                    success: bool) -> None:
    result = JobResult(1, success, None, None if named is None else tuple(named))
    out = key_outcomes(keys, result)
    assert set(out.ok) | set(out.failed) == set(keys) and not set(out.ok) & set(out.failed)
    assert len(out.ok) == len(set(out.ok)) and len(out.failed) == len(set(out.failed))
    if named is None:
        assert set(out.ok) == (set(keys) if success else set())
    elif not set(named) <= set(keys):
        assert out.ok == () and out.problem is not None  # a stranger named: no one's word for any key
    else:  # the tuple governs, whatever success says
        assert set(out.ok) == set(named) and out.problem is None


def test_record_of_another_version_is_rejected_by_the_codec() -> None:
    record = codec.encode(A, b"x" * 16)
    with pytest.raises(codec.CorruptRecordError):
        codec.decode(b"KVA1" + record[4:], A, 16)
