"""DiskTier's group files: the format (``disk_group``), the index (``disk_index``, a plain
class), and the tier's behaviour that grouping brings (dead slots, overlapping stores,
capacity under a stress, a crash mid-write)."""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import random
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvactors.tiers import codec
from kvactors.tiers.disk import TMP_PREFIX, DiskTier
from kvactors.tiers.disk_group import (
    ALIGN,
    decode_head,
    encode_head,
    group_size,
    key_checksum,
    read_table,
    write_group,
)
from kvactors.tiers.disk_index import DiskFile, DiskIndex, NoRoomError
from kvactors.types import JobResult, LookupResult, OffloadKey, ReqContext, TransferJob

BLOCK = 4096
CTX = ReqContext("g")
WAIT = 10.0
HIT, MISS = LookupResult.HIT, LookupResult.MISS
_ids = itertools.count(1)


# ---------------------------------------------------------------- format


def test_group_file_round_trip_and_layout(tmp_path: Path) -> None:
    keys = [b"a", b"bb" * 40, b""]
    payloads = [memoryview(bytes([i]) * BLOCK) for i in range(3)]
    table = encode_head(keys, [key_checksum(k, p) for k, p in zip(keys, payloads, strict=True)], BLOCK)
    path = str(tmp_path / "g.kvg")
    write_group(path, table, payloads, fsync=True)
    assert os.path.getsize(path) == table.file_size == group_size(keys, BLOCK)
    assert table.offsets[0] % ALIGN == 0
    assert os.stat(path).st_mode & 0o777 == 0o600
    back = read_table(path)
    assert back == table
    data = Path(path).read_bytes()
    for off, p in zip(back.offsets, payloads, strict=True):
        assert data[off : off + BLOCK] == p


@pytest.mark.parametrize("damage", ["magic", "table", "digest", "longer", "shorter", "empty"])
def test_group_head_damage_is_rejected(damage: str) -> None:
    keys = [b"x", b"y"]
    table = encode_head(keys, [1, 2], BLOCK)
    head, size = bytearray(table.head_bytes), table.file_size
    if damage == "magic":
        head[:4] = codec.MAGIC  # a KVA2 record is no group file
    elif damage == "table":
        head[20] ^= 1
    elif damage == "digest":
        head[-1] ^= 1
    elif damage == "longer":
        size += 1
    elif damage == "shorter":
        size -= 1
    else:
        head = bytearray()
    with pytest.raises(codec.CorruptRecordError):
        decode_head(bytes(head), size)


def test_head_larger_than_a_page_is_read_whole(tmp_path: Path) -> None:
    keys = [bytes([i]) * 300 for i in range(40)]  # a table of ~12 KiB
    payloads = [memoryview(bytes(64)) for _ in keys]
    table = encode_head(keys, [key_checksum(k, p) for k, p in zip(keys, payloads, strict=True)], 64)
    assert table.offsets[0] > ALIGN
    write_group(str(tmp_path / "g"), table, payloads, fsync=False)
    assert read_table(str(tmp_path / "g")).keys == tuple(keys)


# ---------------------------------------------------------------- index (plain class)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["store", "remove", "touch", "pin", "unpin"]),
                          st.lists(st.integers(0, 11), min_size=1, max_size=4)), max_size=60),
       st.integers(1, 8))
# A key removed from a file and stored again in another, then evicted: the test read its old file.
@example(ops=[("store", [0]), ("store", [1, 2]), ("remove", [2]), ("store", [2]), ("touch", [0, 1]),
              ("store", [0])], cap_files=2)
def test_index_counts_exactly_the_files_that_hold_live_keys(ops: list[tuple[str, list[int]]], cap_files: int) -> None:
    unlinked: list[str] = []
    index = DiskIndex(cap_files * 100, lambda name: unlinked.append(name) is None)
    files: dict[str, DiskFile] = {}
    pins: list[OffloadKey] = []
    seq = itertools.count()
    for op, ids in ops:
        keys = [bytes([i]) for i in ids]
        if op == "store":
            size = 50 + 10 * len(set(keys))
            evicted: list[OffloadKey] = []
            holder = {k: f for f in index.files() for k in index_keys(index, f)}  # each live key's file now
            try:
                index.reserve(size, evicted)
            except NoRoomError:
                # Refused only when the files without a pinned key free too little, and then
                # nothing was evicted (a key whose file stays frees no room).
                unpinned = [f for f in index.files()
                            if not any(index.pinned(k) for k in index_keys(index, f))]
                assert index.used + size - sum(f.size for f in unpinned) > index.capacity
                assert evicted == []
                continue
            assert not any(index.pinned(k) for k in evicted)
            # Every key evicted took its whole file with it: none was evicted for nothing. (The file
            # that held it when evicted: a key removed from one file may be stored again in another.)
            assert all(index_keys(index, holder[k]) == [] for k in evicted)
            f = DiskFile(f"f{next(seq)}", size, 10)
            if index.add(f, [(k, j, 0) for j, k in enumerate(dict.fromkeys(keys))], reserved=size):
                files[f.name] = f
            else:
                index.release(size)
        elif op == "remove":
            for k in keys:
                index.remove(k)
        elif op == "touch":
            for k in keys:
                index.touch(k)
        elif op == "pin":
            index.pin(keys)
            pins.extend(keys)
        elif pins:
            index.unpin([pins.pop()])
        live = {f.name for f in index.files()}
        assert index.reserved == 0
        assert index.used == sum(files[n].size for n in live) <= index.capacity
        assert set(unlinked) == set(files) - live  # a file goes exactly when its last key does
        assert len(unlinked) == len(set(unlinked))


def index_keys(index: DiskIndex, file: DiskFile) -> list[OffloadKey]:
    """The keys of the index that live in ``file``."""
    return [k for k in (bytes([i]) for i in range(256)) if (slot := index.get(k)) is not None and slot.file is file]


def test_index_reserve_never_evicts_a_key_whose_file_would_stay() -> None:
    """A group file of (a, b) with b pinned: evicting a frees no byte. A store that needs
    the room is refused without evicting a; one that fits beside evicts a whole file only."""
    index = DiskIndex(100, lambda name: True)
    group, single = DiskFile("g", 60, 10), DiskFile("s", 30, 10)
    for f, entries in ((group, [(b"a", 0, 0), (b"b", 10, 0)]), (single, [(b"c", 0, 0)])):
        index.reserve(f.size, [])
        index.add(f, entries, reserved=f.size)
    index.touch(b"c")  # LRU: a, b, c
    index.pin([b"b"])
    evicted: list[OffloadKey] = []
    with pytest.raises(NoRoomError):
        index.reserve(50, evicted)  # needs 40: only c's file (30) can go
    assert evicted == [] and b"a" in index and b"c" in index and index.reserved == 0
    index.reserve(20, evicted)  # needs 10: c's whole file, not a (less recent, but it frees nothing)
    assert evicted == [b"c"] and b"a" in index and index.used == 60 and index.reserved == 20


def test_index_reserve_never_evicts_a_pinned_key() -> None:
    index = DiskIndex(100, lambda name: True)
    f = DiskFile("f", 60, 10)
    index.reserve(60, [])
    index.add(f, [(b"a", 0, 0)], reserved=60)
    index.pin([b"a"])
    with pytest.raises(NoRoomError, match="being read"):
        index.reserve(60, [])
    index.unpin([b"a"])
    evicted: list[OffloadKey] = []
    index.reserve(60, evicted)
    assert evicted == [b"a"] and index.used == 0 and index.reserved == 60


# ---------------------------------------------------------------- the tier


class Harness:
    def __init__(self, root: Path, rows: int = 32, **kwargs: object) -> None:
        kwargs.setdefault("capacity_bytes", 1 << 30)
        self.tier = DiskTier(root, **kwargs)  # type: ignore[arg-type]
        self.root = root
        self.pool = torch.randint(0, 256, (rows, BLOCK), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
        self.results: queue.Queue[JobResult] = queue.Queue()
        self.tier.attach(self.pool, self.results.put)

    def submit(self, keys: list[OffloadKey], rows: list[int], promotion: bool) -> int:
        job = TransferJob(next(_ids), tuple(keys), tuple(rows), CTX, promotion)
        (self.tier.submit_load if promotion else self.tier.submit_store)(job)
        return job.job_id

    def run(self, keys: list[OffloadKey], rows: list[int], promotion: bool) -> JobResult:
        job_id = self.submit(keys, rows, promotion)
        result = self.results.get(timeout=WAIT)
        assert result.job_id == job_id
        return result


@pytest.fixture
def harness(tmp_path: Path):  # type: ignore[no-untyped-def]
    made: list[Harness] = []

    def make(**kwargs: object) -> Harness:
        h = Harness(tmp_path / "tier", **kwargs)
        made.append(h)
        return h

    yield make
    for h in made:
        h.tier.shutdown()


def disk_bytes(root: Path) -> int:
    total = 0
    for p in root.iterdir():
        with contextlib.suppress(FileNotFoundError):  # gone between listing and stat
            total += p.stat().st_size
    return total


def removed(h: Harness) -> list[OffloadKey]:
    return [k for e in h.tier.take_events() if e.removed for k in e.keys]


def test_dead_slots_count_until_their_file_goes(harness) -> None:  # type: ignore[no-untyped-def]
    two, one = group_size([b"a", b"b"], BLOCK), group_size([b"c"], BLOCK)
    h = harness(capacity_bytes=two + one)
    assert h.run([b"a", b"b"], [0, 1], False).success  # one file
    assert h.run([b"c"], [2], False).success
    h.tier.touch([b"b"], CTX)  # LRU: a, c, b
    h.tier.take_events()
    assert h.run([b"d"], [3], False).success
    # a is the least recent, but evicting it would free nothing (b keeps the file): c's
    # file makes the room, and a stays.
    assert removed(h) == [b"c"]
    assert h.tier.lookup([b"a", b"b", b"c", b"d"], CTX) == [HIT, HIT, MISS, HIT]
    assert h.tier.used_bytes == disk_bytes(h.root) == two + one
    h.tier.take_events()
    assert h.run([b"e"], [4], False).success  # a, b are the least recent: their file goes
    assert removed(h) == [b"a", b"b"]
    assert h.tier.used_bytes == disk_bytes(h.root) == 2 * one


def test_two_jobs_storing_overlapping_keys(harness) -> None:  # type: ignore[no-untyped-def]
    h = harness(io_workers=4)
    first, second = [b"k%d" % i for i in range(8)], [b"k%d" % i for i in range(4, 12)]
    ids = [h.submit(first, list(range(8)), False), h.submit(second, list(range(4, 12)), False)]
    results = {r.job_id: r for r in (h.results.get(timeout=WAIT) for _ in ids)}
    assert all(results[i].success for i in ids)
    stored = [k for e in h.tier.take_events() if not e.removed for k in e.keys]
    assert sorted(stored) == sorted(set(first + second))  # each key stored once
    assert len(h.tier) == 12 and h.tier.used_bytes == disk_bytes(h.root)
    h.pool[16:28].zero_()
    keys = sorted(set(first + second))
    assert h.run(keys, list(range(16, 28)), True).success
    for key, row in zip(keys, range(16, 28), strict=True):
        assert torch.equal(h.pool[row], h.pool[int(key[1:])])


@pytest.mark.timeout(60)
def test_capacity_never_exceeded_under_a_stress_of_stores_loads_and_evictions(harness) -> None:  # type: ignore[no-untyped-def]
    cap = 6 * group_size([b"s000-0-0"] * 3, BLOCK)
    h = harness(capacity_bytes=cap, io_workers=4, rows=64)
    stop = threading.Event()
    peak = [0]

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], disk_bytes(h.root))

    watcher = threading.Thread(target=watch)
    watcher.start()
    rng = random.Random(7)
    stored: list[list[OffloadKey]] = []
    try:
        for step in range(120):
            pending: dict[int, bool] = {}  # job id -> is a store
            for part in range(2):  # two stores at once, and a load of an earlier one
                keys = [b"s%03d-%d-%d" % (step, part, j) for j in range(rng.randint(1, 4))]
                pending[h.submit(keys, [8 * part + j for j in range(len(keys))], False)] = True
                stored.append(keys)
            old = rng.choice(stored[:-2] or stored)
            pending[h.submit(old, [32 + j for j in range(len(old))], True)] = False
            for _ in pending:
                result = h.results.get(timeout=WAIT)
                assert result.success or not pending[result.job_id], result.error  # loads may miss (evicted)
    finally:
        stop.set()
        watcher.join(WAIT)
    h.tier.drain(WAIT)
    assert peak[0] <= cap
    assert h.tier.used_bytes == disk_bytes(h.root) <= cap
    assert 0 < len(h.tier) < sum(map(len, stored))


def test_restart_after_a_crash_mid_write(harness, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    h = harness()
    assert h.run([b"a", b"b"], [0, 1], False).success
    h.tier.shutdown()
    # What a crash in the middle of a store leaves: a temporary file, part written.
    keys = [b"c", b"d"]
    payloads = [memoryview(h.pool[i].numpy()) for i in (2, 3)]
    table = encode_head(keys, [key_checksum(k, p) for k, p in zip(keys, payloads, strict=True)], BLOCK)
    partial = h.root / f"{TMP_PREFIX}crashed-0"
    partial.write_bytes(table.head_bytes + bytes(table.offsets[0] - len(table.head_bytes)) + bytes(payloads[0]))
    h2 = harness()
    assert not partial.exists()
    assert h2.tier.lookup([b"a", b"b", b"c", b"d"], CTX) == [HIT, HIT, MISS, MISS]
    assert h2.tier.used_bytes == disk_bytes(h2.root)
    res = h2.run([b"a", b"b"], [4, 5], True)
    assert res.success and torch.equal(h2.pool[4], h.pool[0]) and torch.equal(h2.pool[5], h.pool[1])


def test_a_failed_group_write_is_retried_key_by_key(harness, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    h = harness()
    real = os.writev

    def fail_groups(fd: int, buffers: list[memoryview]) -> int:
        if len(buffers) > 2:  # head and more than one payload
            raise OSError(5, "EIO")
        return real(fd, buffers)

    monkeypatch.setattr(os, "writev", fail_groups)
    assert h.run([b"a", b"b", b"c"], [0, 1, 2], False).success
    monkeypatch.undo()
    assert len({h.tier.locate(k)[0] for k in (b"a", b"b", b"c")}) == 3  # type: ignore[index]
    assert [p.name.startswith(TMP_PREFIX) for p in h.root.iterdir()] == [False] * 3


# ---------------------------------------------------------------- found in review


def _ok(result: JobResult, keys: list[OffloadKey]) -> set[OffloadKey]:
    return set(keys) if result.success else set(result.successful_keys or ())


@pytest.mark.parametrize("fit", [1, 2, 4])
def test_a_store_larger_than_the_room_reports_exactly_the_keys_left_in_the_tier(harness, fit: int) -> None:  # type: ignore[no-untyped-def]
    keys = [b"j%02d" % i for i in range(12)]
    h = harness(capacity_bytes=group_size(keys[:fit], BLOCK))
    result = h.run(keys, list(range(12)), False)
    present = {k for k in keys if h.tier.lookup([k], CTX) == [HIT]}
    assert _ok(result, keys) == present and present
    assert disk_bytes(h.root) == h.tier.used_bytes <= h.tier.capacity_bytes


@pytest.mark.parametrize("key_len", [10, 2000, 2018, 2030])
def test_two_keys_whose_group_fits_the_capacity_exactly_share_one_file(harness, key_len: int) -> None:  # type: ignore[no-untyped-def]
    keys = [b"p" * key_len, b"q" * (key_len + 1)]
    h = harness(capacity_bytes=group_size(keys, BLOCK))
    assert h.run(keys, [0, 1], False).success
    assert len(list(h.root.iterdir())) == 1
    assert h.tier.lookup(keys, CTX) == [HIT, HIT]
    assert disk_bytes(h.root) == h.tier.used_bytes == h.tier.capacity_bytes


def test_a_failed_directory_sync_leaves_a_key_another_job_stored(harness, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import kvactors.tiers.disk as disk_mod

    h = harness(io_workers=2, fsync=True)
    held, entered, holder = threading.Event(), threading.Event(), []
    write, sync = disk_mod.write_group, disk_mod.fsync_dir

    def held_write(path, table, views, *, fsync):  # type: ignore[no-untyped-def]
        if table.keys == (b"x", b"k") and not holder:  # job A's group waits until B has stored k
            holder.append(threading.current_thread())
            entered.set()
            assert held.wait(WAIT)
        return write(path, table, views, fsync=fsync)

    def failing_sync(root):  # type: ignore[no-untyped-def]
        if holder and threading.current_thread() is holder[0]:
            raise OSError(5, "EIO (injected)")
        return sync(root)

    monkeypatch.setattr(disk_mod, "write_group", held_write)
    monkeypatch.setattr(disk_mod, "fsync_dir", failing_sync)
    job_a = h.submit([b"x", b"k"], [0, 1], False)
    assert entered.wait(WAIT)
    assert h.run([b"k"], [1], False).success  # job B
    held.set()
    result_a = h.results.get(timeout=WAIT)
    assert result_a.job_id == job_a and not result_a.success
    assert _ok(result_a, [b"x", b"k"]) == {b"k"}  # k is B's, stored and synced; x was A's own
    assert h.tier.lookup([b"x", b"k"], CTX) == [MISS, HIT]
    assert disk_bytes(h.root) == h.tier.used_bytes


def test_a_restart_keeps_the_newer_copy_of_a_key_when_two_files_share_an_mtime(harness, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    h = harness()
    for i in range(9):  # the old file is the 10th, the new the 11th: by a bare sequence, "10" < "9"
        assert h.run([b"d%d" % i], [10 + i], False).success
    assert h.run([b"x", b"k"], [0, 1], False).success
    old_path, offset, _ = h.tier.locate(b"k")
    with open(old_path, "r+b") as f:  # k's bytes in the old file go bad
        f.seek(offset + 7)
        byte = f.read(1)
        f.seek(offset + 7)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert not h.run([b"k"], [20], True).success  # dropped: a dead slot in the old file
    assert h.run([b"k"], [1], False).success  # stored again, in a newer file
    new_path = h.tier.locate(b"k")[0]
    h.tier.shutdown()
    st = os.stat(new_path)
    os.utime(old_path, ns=(st.st_atime_ns, st.st_mtime_ns))  # coarse clocks: one mtime for both
    again = harness()
    assert again.tier.locate(b"k")[0] == new_path
    assert again.run([b"k"], [21], True).success
    assert torch.equal(again.pool[21], again.pool[1])


@settings(max_examples=200, deadline=None)
@given(lens=st.lists(st.integers(1, 3000), min_size=1, max_size=40), block=st.sampled_from([1, 4096, 5000]),
       room=st.integers(0, 40_000))
def test_planned_groups_fit_the_capacity_exactly_and_keep_every_position_in_order(
        lens: list[int], block: int, room: int) -> None:
    from kvactors.tiers.disk_group import plan_groups

    keys = [bytes([65 + i % 26]) * n for i, n in enumerate(lens)]
    capacity = group_size(keys[:1], block) + room
    groups = list(plan_groups(keys, list(range(len(keys))), block, capacity))
    assert [i for g in groups for i in g] == list(range(len(keys)))
    for g, following in zip(groups, [*groups[1:], []], strict=True):
        assert group_size([keys[i] for i in g], block) <= capacity or len(g) == 1
        if following:  # a group ends only when the next key would not fit
            assert group_size([keys[i] for i in g + following[:1]], block) > capacity


def test_a_file_that_cannot_be_removed_keeps_counting_until_it_is_gone() -> None:
    removable = {"a": False}
    index = DiskIndex(100, lambda name: removable.get(name, True))
    for name, key in (("a", b"1"), ("b", b"2")):
        index.reserve(50, [])
        assert index.add(DiskFile(name, 50, 10), [(key, 0, 0)], reserved=50)
    evicted: list[OffloadKey] = []
    with pytest.raises(NoRoomError):  # "a" cannot be unlinked: evicting b frees b only
        index.reserve(60, evicted)
    assert evicted == [b"1", b"2"] and index.used == 50 and index.stuck_files == 1
    removable["a"] = True  # the next reservation tries it again
    index.reserve(60, [])
    assert index.used == 0 and index.reserved == 60 and index.stuck_files == 0


def test_the_tier_never_exceeds_its_capacity_when_an_unlink_fails(harness, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import errno

    h = harness(capacity_bytes=2 * group_size([b"k0"], BLOCK))
    refused: list[str] = []
    unlink = os.unlink

    def busy_once(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        if str(path).endswith(".kvg") and not refused:
            refused.append(str(path))
            raise OSError(errno.EBUSY, "Device or resource busy", str(path))
        return unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", busy_once)
    for i in range(6):
        h.run([b"k%d" % i], [i], False)
        assert disk_bytes(h.root) == h.tier.used_bytes <= h.tier.capacity_bytes
    assert refused and not os.path.exists(refused[0])  # removed on a later try
    assert h.tier.lookup([b"k5"], CTX) == [HIT]


def test_a_chunk_that_evicts_another_chunks_key_of_its_job_fails_that_key(harness, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Exactly the keys reported successful are in the tier, also when a job's chunks (one per
    worker) make room by evicting each other's files."""
    import kvactors.tiers.disk as disk_mod

    monkeypatch.setattr(disk_mod, "_MIN_CHUNK_BYTES", 1)  # one chunk per key, with two workers
    keys = [b"chunk-0", b"chunk-1"]
    h = harness(io_workers=2, capacity_bytes=group_size(keys[:1], BLOCK) + 100)  # room for one file
    first_stored = threading.Event()
    store_group = DiskTier._store_group

    def ordered(tier, job, positions, evicted_here=None):  # type: ignore[no-untyped-def]
        if positions == [1]:
            assert first_stored.wait(WAIT)  # chunk 1 reserves once chunk 0's file is in: it evicts it
            return store_group(tier, job, positions, evicted_here)
        try:
            return store_group(tier, job, positions, evicted_here)
        finally:
            first_stored.set()

    monkeypatch.setattr(DiskTier, "_store_group", ordered)
    result = h.run(keys, [0, 1], False)
    present = {k for k in keys if h.tier.lookup([k], CTX) == [HIT]}
    assert present == {keys[1]}
    assert not result.success and set(result.successful_keys or ()) == present
    assert "evicted to make room" in (result.error or "")
