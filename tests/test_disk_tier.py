"""DiskTier driven directly: a pool, a report queue, TransferJobs."""

from __future__ import annotations

import collections
import contextlib
import errno
import itertools
import os
import queue
import re
import shutil
import stat
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

from kvactors.tiers import codec
from kvactors.tiers.disk import GROUP_SUFFIX, SUFFIX, TMP_PREFIX, DiskTier, file_name
from kvactors.tiers.disk_group import group_size
from kvactors.types import JobResult, LookupResult, OffloadingEvent, OffloadKey, ReqContext, TransferJob

N_ROWS = 16
BLOCK = 4096
CTX = ReqContext("r")
WAIT = 10.0
HIT, MISS = LookupResult.HIT, LookupResult.MISS
_job_ids = itertools.count(1)


def record_size(key: OffloadKey, block: int = BLOCK) -> int:
    """The bytes of a group file holding ``key`` alone."""
    return group_size([key], block)


def where(h: Harness, key: OffloadKey) -> tuple[Path, int, int]:
    """The file holding ``key``, its payload's offset and length (``DiskTier.locate``)."""
    found = h.tier.locate(key)
    assert found is not None, key
    return Path(found[0]), found[1], found[2]


class Harness:
    """A tier attached to a random pool, with its reports in a queue."""

    def __init__(self, tier: DiskTier, rows: int = N_ROWS, block: int = BLOCK, seed: int = 0) -> None:
        self.tier = tier
        gen = torch.Generator().manual_seed(seed)
        self.pool = torch.randint(0, 256, (rows, block), dtype=torch.uint8, generator=gen)
        self.results: queue.Queue[JobResult] = queue.Queue()
        tier.attach(self.pool, self.results.put)

    def job(self, keys: Sequence[OffloadKey], rows: Sequence[int], promotion: bool) -> TransferJob:
        return TransferJob(next(_job_ids), tuple(keys), tuple(rows), CTX, promotion)

    def run(self, keys: Sequence[OffloadKey], rows: Sequence[int], promotion: bool) -> JobResult:
        job = self.job(keys, rows, promotion)
        if promotion:
            self.tier.submit_load(job)
        else:
            self.tier.submit_store(job)
        result = self.results.get(timeout=WAIT)
        assert result.job_id == job.job_id
        return result

    def store(self, keys: Sequence[OffloadKey], rows: Sequence[int]) -> JobResult:
        return self.run(keys, rows, promotion=False)

    def load(self, keys: Sequence[OffloadKey], rows: Sequence[int]) -> JobResult:
        return self.run(keys, rows, promotion=True)

    def assert_no_more_reports(self) -> None:
        self.tier.drain(WAIT)
        assert self.results.empty()


@pytest.fixture
def make(tmp_path: Path) -> Iterator:
    tiers: list[DiskTier] = []

    def factory(root: Path | None = None, *, rows: int = N_ROWS, block: int = BLOCK, seed: int = 0,
                **kwargs: object) -> Harness:
        kwargs.setdefault("capacity_bytes", 1 << 30)
        tier = DiskTier(root if root is not None else tmp_path / "tier", **kwargs)  # type: ignore[arg-type]
        tiers.append(tier)
        return Harness(tier, rows=rows, block=block, seed=seed)

    yield factory
    for tier in tiers:
        tier.shutdown()


def keys_of(n: int, prefix: bytes = b"k") -> list[OffloadKey]:
    return [prefix + i.to_bytes(4, "big") for i in range(n)]


def block_files(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.name.endswith((SUFFIX, GROUP_SUFFIX)))


def disk_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.iterdir())


def flatten(events: list[OffloadingEvent], removed: bool) -> list[OffloadKey]:
    return [k for e in events if e.removed == removed for k in e.keys]


# ---------------------------------------------------------------- basics


def test_round_trip_is_byte_exact(make, tmp_path: Path) -> None:
    h = make()
    keys = keys_of(8)
    original = h.pool[:8].clone()
    assert h.store(keys, range(8)).success
    h.pool.zero_()
    res = h.load(keys, range(8, 16))
    assert res.success, res.error
    assert torch.equal(h.pool[8:16], original)
    assert torch.count_nonzero(h.pool[:8]) == 0  # only the target rows were written
    h.assert_no_more_reports()


def test_store_reports_success_once(make) -> None:
    h = make()
    res = h.store(keys_of(3), [0, 1, 2])
    assert res.success and res.error is None
    h.assert_no_more_reports()


def test_lookup_hit_and_miss_without_io(make, tmp_path: Path) -> None:
    h = make()
    keys = keys_of(4)
    assert h.tier.lookup(keys, CTX) == [MISS] * 4
    assert h.store(keys[:2], [0, 1]).success
    assert h.tier.lookup(keys, CTX) == [HIT, HIT, MISS, MISS]
    # The index answers, not the disk: the directory moved away changes nothing.
    os.rename(tmp_path / "tier", tmp_path / "moved")
    assert h.tier.lookup(keys, CTX) == [HIT, HIT, MISS, MISS]


def test_store_of_present_key_skips_write(make, tmp_path: Path) -> None:
    h = make()
    key = b"same"
    assert h.store([key], [0]).success
    path, _, _ = where(h, key)
    inode = path.stat().st_ino
    assert h.store([key], [1]).success  # different row: not rewritten
    assert path.stat().st_ino == inode
    assert flatten(h.tier.take_events(), removed=False) == [key]
    h.pool[0].zero_()
    assert h.load([key], [0]).success
    assert not torch.equal(h.pool[0], h.pool[1])


def test_load_of_missing_key_fails(make) -> None:
    h = make()
    res = h.load([b"absent"], [0])
    assert not res.success
    assert "not in tier" in (res.error or "")
    h.assert_no_more_reports()


def test_events_stored_then_taken_once(make) -> None:
    h = make()
    keys = keys_of(3)
    assert h.store(keys, [0, 1, 2]).success
    events = h.tier.take_events()
    assert all(e.tier == "disk" for e in events)
    assert sorted(flatten(events, removed=False)) == sorted(keys)
    assert flatten(events, removed=True) == []
    assert h.tier.take_events() == []


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path, 0o600)


def _directory(path: Path) -> None:
    path.unlink()
    path.mkdir()


def _symlink(path: Path) -> None:
    target = path.with_name("elsewhere")
    path.rename(target)
    path.symlink_to(target)


@pytest.mark.parametrize("replace", [_fifo, _directory, _symlink], ids=lambda f: f.__name__[1:])
def test_a_load_from_what_is_not_a_regular_file_fails_at_once(make, tmp_path: Path, replace) -> None:
    """Never a wait (a FIFO's open waits for a writer) nor a read of something else."""
    h = make(io_workers=1)
    key = b"key"
    assert h.store([key], [0]).success
    path, _, _ = where(h, key)
    replace(path)
    try:
        res = h.load([key], [5])
        assert not res.success and "key" not in (res.successful_keys or ())
        assert h.tier.lookup([key], CTX) == [MISS]
        assert h.store([key], [1]).success  # stored again, into a new file
        h.pool[5].zero_()
        assert h.load([key], [5]).success and torch.equal(h.pool[5], h.pool[1])
    finally:
        if path.is_fifo():  # a worker stuck in open() (the bug) gets its writer: no hung teardown
            with contextlib.suppress(OSError):
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


def test_a_file_turned_into_a_fifo_during_the_restart_scan_is_unreadable(make, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import kvactors.tiers.disk_read as disk_read

    root = tmp_path / "tier"
    h1 = make(root)
    assert h1.store([b"key"], [0]).success and h1.store([b"other"], [1]).success
    path, _, _ = where(h1, b"key")
    h1.tier.shutdown()
    open_group = disk_read._open_group

    def swapped(file_path, fname):  # type: ignore[no-untyped-def]
        if file_path == str(path):  # listed as a regular file, a FIFO by the time it is opened
            _fifo(path)
        return open_group(file_path, fname)

    monkeypatch.setattr(disk_read, "_open_group", swapped)
    h2 = make(root)  # the constructor returns: the FIFO is an unreadable file, kept
    assert h2.tier.lookup([b"key", b"other"], CTX) == [MISS, HIT]


def test_a_restart_skips_a_fifo_named_as_a_tier_file(make, tmp_path: Path) -> None:
    root = tmp_path / "tier"
    h1 = make(root)
    assert h1.store([b"key"], [0]).success
    h1.tier.shutdown()
    os.mkfifo(root / ("0" * 16 + GROUP_SUFFIX), 0o600)
    os.mkfifo(root / file_name(b"fifo"), 0o600)
    h2 = make(root)
    assert h2.tier.lookup([b"key", b"fifo"], CTX) == [HIT, MISS]


def test_constructor_validation(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        DiskTier(tmp_path / "a", capacity_bytes=0)
    with pytest.raises(ValueError):
        DiskTier(tmp_path / "b", capacity_bytes=-5)
    with pytest.raises(ValueError):
        DiskTier(tmp_path / "c", capacity_bytes=100, io_workers=0)


@pytest.mark.parametrize("root", ["", 5, None, b"/tmp/x", "a\0b", ["/tmp"]])
def test_a_root_that_is_not_a_path_is_refused(root, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".tmp-user-notes").write_bytes(b"mine")
    with pytest.raises(ValueError, match="root must be"):
        DiskTier(root, capacity_bytes=1 << 20)
    assert [p.name for p in tmp_path.iterdir()] == [".tmp-user-notes"]  # nothing touched


# ---------------------------------------------------------------- files


def test_dir_created_0700_and_files_0600(make, tmp_path: Path) -> None:
    root = tmp_path / "deep" / "tier"
    h = make(root)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert h.store(keys_of(2), [0, 1]).success  # one job: one file
    assert h.store([b"other"], [2]).success
    files = block_files(root)
    assert len(files) == 2
    for f in files:
        assert stat.S_IMODE(f.stat().st_mode) == 0o600


def test_odd_keys_stay_inside_root(make, tmp_path: Path) -> None:
    root = tmp_path / "tier"
    h = make(root)
    odd = [b"../../x", b"\x00/", b"/etc/passwd", b"."]
    assert h.store(odd, range(4)).success
    (name,) = [p.name for p in root.iterdir()]  # the keys are in the file's table, not its name
    assert re.fullmatch(r"g-[0-9a-f]{16}-[0-9a-f]+-[0-9a-f]{8}" + re.escape(GROUP_SUFFIX), name)
    assert not (tmp_path / "x").exists()
    h.pool[:4].zero_()
    assert h.load(odd, range(4, 8)).success


def test_long_key_round_trip_short_name(make, tmp_path: Path) -> None:
    h = make()
    key = bytes(range(256)) * 2
    expected = h.pool[3].clone()
    assert h.store([key], [3]).success
    (name,) = [p.name for p in block_files(tmp_path / "tier")]
    assert len(name) < 100
    h.pool.zero_()
    assert h.load([key], [0]).success
    assert torch.equal(h.pool[0], expected)


def test_no_temp_files_left_and_leftovers_removed_on_open(make, tmp_path: Path) -> None:
    root = tmp_path / "tier"
    h = make(root)
    assert h.store(keys_of(4), range(4)).success
    assert [p.name.endswith(GROUP_SUFFIX) for p in root.iterdir()] == [True]
    h.tier.shutdown()
    (root / ".tmp-deadbeef").write_bytes(b"partial")
    (root / "unrelated.txt").write_bytes(b"not ours")
    make(root)
    assert not (root / ".tmp-deadbeef").exists()
    assert (root / "unrelated.txt").exists()


# ---------------------------------------------------------------- capacity


def test_capacity_evicts_lru_and_never_exceeded(make, tmp_path: Path) -> None:
    root = tmp_path / "tier"
    keys = keys_of(8)
    cap = 3 * record_size(keys[0]) + 10
    h = make(root, capacity_bytes=cap)
    for i, key in enumerate(keys[:3]):
        assert h.store([key], [i]).success
        assert disk_bytes(root) <= cap
    # Recency: lookup hit on k0, touch k1 -> k2 is the LRU.
    assert h.tier.lookup([keys[0]], CTX) == [HIT]
    h.tier.touch([keys[1]], CTX)
    h.tier.take_events()
    assert h.store([keys[3]], [3]).success
    assert disk_bytes(root) <= cap
    assert flatten(h.tier.take_events(), removed=True) == [keys[2]]
    assert h.tier.lookup(keys[:4], CTX) == [HIT, HIT, MISS, HIT]
    # A load refreshes recency too: load k0, then k1 is the LRU.
    assert h.load([keys[0]], [8]).success
    assert h.store([keys[4]], [4]).success
    assert flatten(h.tier.take_events(), removed=True) == [keys[1]]
    assert h.tier.used_bytes == 3 * record_size(keys[0]) == disk_bytes(root)


def test_capacity_under_concurrent_stores(make, tmp_path: Path) -> None:
    root = tmp_path / "tier"
    keys = keys_of(64)
    cap = 5 * record_size(keys[0])
    h = make(root, capacity_bytes=cap, io_workers=4)
    stop = threading.Event()
    peak = [0]

    def watch() -> None:
        while not stop.is_set():
            with contextlib.suppress(FileNotFoundError):  # a file vanished between listing and stat
                peak[0] = max(peak[0], disk_bytes(root))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        jobs = [h.job([k], [i % N_ROWS], promotion=False) for i, k in enumerate(keys)]
        for job in jobs:
            h.tier.submit_store(job)
        results = [h.results.get(timeout=WAIT) for _ in jobs]
    finally:
        stop.set()
        watcher.join()
    assert all(r.success for r in results)
    assert peak[0] <= cap
    assert len(h.tier) == 5 and disk_bytes(root) == 5 * record_size(keys[0])
    events = h.tier.take_events()
    assert len(flatten(events, removed=False)) == 64
    assert len(flatten(events, removed=True)) == 59


def test_block_larger_than_capacity_fails(make) -> None:
    h = make(capacity_bytes=BLOCK // 2)
    res = h.store([b"big"], [0])
    assert not res.success and "exceeds capacity" in (res.error or "")
    assert h.tier.lookup([b"big"], CTX) == [MISS]


# ---------------------------------------------------------------- restart


def test_restart_finds_blocks_byte_exact(make, tmp_path: Path) -> None:
    root = tmp_path / "tier"
    h1 = make(root)
    keys = keys_of(6)
    original = h1.pool[:6].clone()
    assert h1.store(keys, range(6)).success
    h1.tier.shutdown()

    h2 = make(root, seed=1)
    assert h2.tier.lookup([*keys, b"other"], CTX) == [HIT] * 6 + [MISS]
    assert h2.tier.used_bytes == group_size(keys, BLOCK) == disk_bytes(root)
    assert h2.load(keys, range(10, 16)).success
    assert torch.equal(h2.pool[10:16], original)
    assert h2.tier.take_events() == []


def test_restart_over_capacity_evicts_oldest(make, tmp_path: Path) -> None:
    root = tmp_path / "tier"
    h1 = make(root)
    keys = keys_of(4)
    for i, key in enumerate(keys):
        assert h1.store([key], [i]).success
        path, _, _ = where(h1, key)
        os.utime(path, ns=(10**18 + i * 10**9, 10**18 + i * 10**9))  # distinct, increasing mtimes
    h1.tier.shutdown()
    h2 = make(root, capacity_bytes=2 * record_size(keys[0]))
    assert h2.tier.lookup(keys, CTX) == [MISS] * 2 + [HIT] * 2
    assert disk_bytes(root) == 2 * record_size(keys[0])


def test_restart_discards_invalid_files(make, tmp_path: Path) -> None:
    root = tmp_path / "tier"
    h1 = make(root)
    keys = keys_of(7)
    for i, key in enumerate(keys):  # one file each
        assert h1.store([key], [i]).success
    paths = [where(h1, key)[0] for key in keys]
    h1.tier.shutdown()
    paths[0].write_bytes(b"garbage")  # bad head
    data = bytearray(paths[1].read_bytes())
    data[20] ^= 0x01  # a byte of the table: its checksum fails
    paths[1].write_bytes(bytes(data))
    with open(paths[2], "ab") as f:  # longer than its table says
        f.write(b"\0")
    with open(paths[3], "r+b") as f:  # cut short
        f.truncate(paths[3].stat().st_size - 1)
    os.replace(paths[4], root / file_name(keys[4]))  # a group file under a KVA2 name
    # A valid KVA2 record, but under another key's name.
    (root / file_name(b"elsewhere")).write_bytes(codec.encode(keys[5], h1.pool[5].numpy().tobytes()))
    h2 = make(root)
    assert h2.tier.lookup([*keys, b"elsewhere"], CTX) == [MISS] * 5 + [HIT, HIT, MISS]
    assert block_files(root) == sorted(paths[5:])
    assert h2.tier.used_bytes == disk_bytes(root) == 2 * record_size(keys[0])


def test_restart_reads_kva2_files_of_the_old_version(make, tmp_path: Path) -> None:
    """A directory written by the one-file-per-block code loads after an upgrade."""
    root = tmp_path / "tier"
    root.mkdir(mode=0o700)
    gen = torch.Generator().manual_seed(5)
    old = torch.randint(0, 256, (3, BLOCK), dtype=torch.uint8, generator=gen)
    long_key = bytes(range(256)) * 2  # its old file name is a hash
    old_keys = [b"old-a", b"old-b", long_key]
    for key, row in zip(old_keys, old, strict=True):
        (root / file_name(key)).write_bytes(codec.encode(key, row.numpy().tobytes()))  # the KVA2 record
    h = make(root, capacity_bytes=3 * (codec.HEADER_SIZE + len(long_key) + BLOCK) + 2 * record_size(b"new"))
    assert h.tier.lookup(old_keys, CTX) == [HIT] * 3
    assert h.tier.used_bytes == disk_bytes(root)
    assert h.store([b"new"], [0]).success  # new blocks go to group files beside them
    res = h.load([*old_keys, b"new"], [4, 5, 6, 7])
    assert res.success, res.error
    assert torch.equal(h.pool[4:7], old) and torch.equal(h.pool[7], h.pool[0])
    # A damaged old file fails its key alone, and goes.
    damaged = root / file_name(b"old-b")
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF
    damaged.write_bytes(bytes(data))
    res = h.load(old_keys, [4, 5, 6])
    assert not res.success and res.successful_keys == (b"old-a", long_key)
    assert "checksum" in (res.error or "") and not damaged.exists()
    # Old files are evicted per key, like the others; the disk stays within the capacity.
    h.tier.take_events()
    for i in range(3):
        assert h.store([b"more%d" % i], [i]).success
        assert disk_bytes(root) <= h.tier.capacity_bytes
    assert set(flatten(h.tier.take_events(), removed=True)) >= {b"old-a"}
    assert not (root / file_name(b"old-a")).exists()


def test_restart_with_other_block_size_discards(make, tmp_path: Path) -> None:
    root = tmp_path / "tier"
    h1 = make(root)
    assert h1.store([b"a"], [0]).success
    h1.tier.shutdown()
    h2 = make(root, block=BLOCK * 2)
    assert h2.tier.lookup([b"a"], CTX) == [MISS]
    assert block_files(root) == []


def test_restart_drops_blocks_of_another_size_before_it_evicts_for_capacity(make, tmp_path: Path) -> None:
    """Over capacity only because of a file of another block size: that file goes at attach,
    and no block of the tier's own size is evicted for room it did not need."""
    root, other = tmp_path / "tier", tmp_path / "other"
    h1 = make(root)
    assert h1.store([b"a"], [0]).success and h1.store([b"b"], [1]).success
    h1.tier.shutdown()
    h2 = make(other, block=BLOCK * 2)
    assert h2.store([b"c"], [0]).success
    big = where(h2, b"c")[0]
    h2.tier.shutdown()
    os.replace(big, root / big.name)  # the newest file of the root
    h3 = make(root, capacity_bytes=2 * record_size(b"a"))
    assert h3.tier.lookup([b"a", b"b", b"c"], CTX) == [HIT, HIT, MISS]
    assert disk_bytes(root) == 2 * record_size(b"a") == h3.tier.used_bytes


def _refuse_to_read(monkeypatch: pytest.MonkeyPatch, fname: str, error: OSError) -> None:
    """Make the restart's scan fail to read the group file ``fname`` with ``error``."""
    import kvactors.tiers.disk_read as disk_read

    real = disk_read._open_group

    def refused(path: str, name: str):  # type: ignore[no-untyped-def]
        if name == fname:
            raise error
        return real(path, name)

    monkeypatch.setattr(disk_read, "_open_group", refused)


def test_restart_keeps_a_file_it_cannot_read(make, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """EIO (or EACCES) on a file at a restart says nothing of its content: the file stays on
    disk, unindexed, and a later restart that can read it finds its blocks."""
    root = tmp_path / "tier"
    h1 = make(root)
    assert h1.store([b"a"], [0]).success and h1.store([b"b"], [1]).success
    unreadable = where(h1, b"a")[0]
    h1.tier.shutdown()
    _refuse_to_read(monkeypatch, unreadable.name, OSError(errno.EIO, "Input/output error"))
    h2 = make(root, capacity_bytes=2 * record_size(b"a"))
    assert h2.tier.lookup([b"a", b"b"], CTX) == [MISS, HIT]
    assert unreadable.exists()
    # Its bytes still take room: a new block evicts b rather than pass the capacity.
    assert h2.tier.used_bytes == disk_bytes(root) == 2 * record_size(b"a")
    assert h2.store([b"c"], [2]).success
    assert h2.tier.lookup([b"b", b"c"], CTX) == [MISS, HIT]
    assert disk_bytes(root) == h2.tier.used_bytes <= h2.tier.capacity_bytes
    h2.tier.shutdown()
    monkeypatch.undo()  # the file can be read again
    h3 = make(root)
    assert h3.tier.lookup([b"a", b"c"], CTX) == [HIT, HIT]
    h3.pool[5].zero_()
    assert h3.load([b"a"], [5]).success and torch.equal(h3.pool[5], h1.pool[0])


@pytest.mark.parametrize("kind", ["temporary", "corrupt"])
def test_restart_counts_a_bad_file_it_could_not_remove(make, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       kind: str) -> None:
    """A crash's temporary file, or a file failing its table, whose unlink fails (EPERM):
    it stays on disk, so its bytes count, and the files never pass the capacity."""
    root = tmp_path / "tier"
    root.mkdir()
    size = record_size(b"a")
    name = f"{TMP_PREFIX}left" if kind == "temporary" else f"g-{1:016x}-x-{0:08x}{GROUP_SUFFIX}"
    (root / name).write_bytes(b"\xff" * size)
    real_unlink = os.unlink

    def refused(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        if os.path.basename(path) == name:
            raise OSError(errno.EPERM, "Operation not permitted", path)
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", refused)
    h = make(root, capacity_bytes=2 * size)
    assert h.tier.used_bytes == size
    assert h.store([b"a"], [0]).success and h.store([b"b"], [1]).success
    assert (root / name).exists()
    assert disk_bytes(root) == h.tier.used_bytes <= h.tier.capacity_bytes
    monkeypatch.setattr(os, "unlink", real_unlink)
    assert h.store([b"c"], [2]).success  # the bad file goes first, before a block is evicted
    assert not (root / name).exists() and h.tier.lookup([b"b", b"c"], CTX) == [HIT, HIT]


def test_restart_evicts_nothing_when_files_it_cannot_read_hold_the_room(
    make, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unreadable file larger than the new capacity: evicting every readable block would
    not make room, so none is; they still load, and stores fail until room comes back."""

    root = tmp_path / "tier"
    h1 = make(root)
    assert h1.store([b"b1", b"b2", b"b3", b"b4"], [2, 3, 4, 5]).success
    big = where(h1, b"b1")[0]
    assert h1.store([b"a"], [1]).success
    h1.tier.shutdown()
    _refuse_to_read(monkeypatch, big.name, PermissionError(errno.EACCES, "Permission denied"))
    h2 = make(root, capacity_bytes=2 * record_size(b"a"))
    assert big.stat().st_size > h2.tier.capacity_bytes
    assert h2.tier.lookup([b"a"], CTX) == [HIT]
    h2.pool[7].zero_()
    assert h2.load([b"a"], [7]).success and torch.equal(h2.pool[7], h1.pool[1])
    assert not h2.store([b"c"], [0]).success  # no room: the unreadable file holds it


def test_restart_retries_a_file_it_failed_to_unlink_before_it_evicts_for_capacity(
    make, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy of a key in an older file is superseded at the restart, and its unlink fails
    once (EBUSY). The shrink at attach tries it again before evicting a live block for it."""
    root, other = tmp_path / "tier", tmp_path / "other"
    h1 = make(root)
    assert h1.store([b"a"], [0]).success
    older = where(h1, b"a")[0]
    h1.tier.shutdown()
    h2 = make(other)
    assert h2.store([b"a"], [0]).success and h2.store([b"b"], [1]).success
    h2.tier.shutdown()
    for path in other.iterdir():
        shutil.copy2(path, root / path.name)
    os.utime(older, ns=(1, 1))  # the oldest: its copy of a is superseded
    real_unlink = os.unlink
    failed: list[str] = []

    def busy_once(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        if os.path.basename(path) == older.name and not failed:
            failed.append(path)
            raise OSError(errno.EBUSY, "Device or resource busy", path)
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", busy_once)
    h3 = make(root, capacity_bytes=2 * record_size(b"a"))
    assert failed, "the planted EBUSY was not reached"
    assert h3.tier.lookup([b"a", b"b"], CTX) == [HIT, HIT]
    assert not older.exists() and disk_bytes(root) == h3.tier.used_bytes == 2 * record_size(b"a")


# ---------------------------------------------------------------- corruption


def _corrupt_then_expect_miss(h: Harness, root: Path, key: OffloadKey, damage) -> str:
    assert h.store([key], [0]).success
    h.tier.take_events()
    path, _, _ = where(h, key)
    damage(path)
    h.pool[5].fill_(7)
    res = h.load([key], [5])
    assert not res.success
    assert h.tier.lookup([key], CTX) == [MISS]
    assert not path.exists()  # its only key left: the file went with it
    assert flatten(h.tier.take_events(), removed=True) == [key]
    h.assert_no_more_reports()
    return res.error or ""


def test_flipped_byte_fails_load_then_miss(make, tmp_path: Path) -> None:
    h = make()

    def flip(path: Path) -> None:
        data = bytearray(path.read_bytes())
        data[-100] ^= 0x01
        path.write_bytes(data)

    assert "checksum" in _corrupt_then_expect_miss(h, tmp_path / "tier", b"key", flip)


def test_flipped_table_byte_fails_load(make, tmp_path: Path) -> None:
    h = make()

    def flip(path: Path) -> None:
        data = bytearray(path.read_bytes())
        data[16 + 18] ^= 0x01  # the first byte of the key in the table
        path.write_bytes(data)

    assert "corrupt" in _corrupt_then_expect_miss(h, tmp_path / "tier", b"key", flip)


def test_truncated_file_fails_load_then_miss(make, tmp_path: Path) -> None:
    h = make()

    def truncate(path: Path) -> None:
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size - 1)

    assert "bytes" in _corrupt_then_expect_miss(h, tmp_path / "tier", b"key", truncate)


def test_extended_file_fails_load_then_miss(make, tmp_path: Path) -> None:
    h = make()

    def extend(path: Path) -> None:
        with open(path, "ab") as f:
            f.write(b"\0")

    assert "expected" in _corrupt_then_expect_miss(h, tmp_path / "tier", b"key", extend)


def test_deleted_file_fails_load_then_miss(make, tmp_path: Path) -> None:
    h = make()
    assert "missing" in _corrupt_then_expect_miss(h, tmp_path / "tier", b"key", Path.unlink)


def test_one_bad_block_in_a_group_fails_alone(make, tmp_path: Path) -> None:
    """A flipped payload byte of one key of a file: that key fails and leaves, the others of
    the same file load in the same job, byte-exact, and stay."""
    h = make()
    keys = keys_of(4)
    original = h.pool[:4].clone()
    assert h.store(keys, range(4)).success
    path, offset, length = where(h, keys[2])
    assert {where(h, k)[0] for k in keys} == {path}  # one file
    with open(path, "r+b") as f:
        f.seek(offset + length - 1)
        byte = f.read(1)
        f.seek(offset + length - 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    h.tier.take_events()
    h.pool[4:8].zero_()
    res = h.load(keys, range(4, 8))
    assert not res.success and "checksum" in (res.error or "")
    assert res.successful_keys == (keys[0], keys[1], keys[3])
    for i in (0, 1, 3):
        assert torch.equal(h.pool[4 + i], original[i])
    assert h.tier.lookup(keys, CTX) == [HIT, HIT, MISS, HIT]
    assert flatten(h.tier.take_events(), removed=True) == [keys[2]]
    assert path.exists() and h.tier.used_bytes == disk_bytes(tmp_path / "tier")  # the dead slot still counts
    assert h.load([keys[0], keys[1], keys[3]], range(8, 11)).success


def test_group_cut_in_the_middle_loads_the_keys_before_the_cut(make, tmp_path: Path) -> None:
    h = make()
    keys = keys_of(6)
    original = h.pool[:6].clone()
    assert h.store(keys, range(6)).success
    path, offset, length = where(h, keys[3])
    with open(path, "r+b") as f:
        f.truncate(offset + length // 2)  # in the middle of key 3's payload
    h.pool[8:14].zero_()
    res = h.load(list(reversed(keys)), range(8, 14))
    assert not res.success and "truncated" in (res.error or "")
    assert set(res.successful_keys or ()) == set(keys[:3])
    for i in range(3):
        assert torch.equal(h.pool[13 - i], original[i])
    assert h.tier.lookup(keys, CTX) == [HIT] * 3 + [MISS] * 3
    h.assert_no_more_reports()


def test_file_removed_under_a_group_fails_its_keys_only(make, tmp_path: Path) -> None:
    h = make()
    assert h.store([b"a", b"b"], [0, 1]).success
    assert h.store([b"c"], [2]).success
    where(h, b"a")[0].unlink()
    res = h.load([b"a", b"b", b"c"], [4, 5, 6])
    assert not res.success and "missing" in (res.error or "")
    assert res.successful_keys == (b"c",)
    assert h.tier.lookup([b"a", b"b", b"c"], CTX) == [MISS, MISS, HIT]
    assert h.tier.used_bytes == disk_bytes(tmp_path / "tier") == record_size(b"c")


# ---------------------------------------------------------------- I/O errors


def _assert_failed_once(h: Harness, res: JobResult, caplog: pytest.LogCaptureFixture, needle: str) -> None:
    assert not res.success
    assert needle in (res.error or ""), res.error
    h.assert_no_more_reports()
    warnings = [
        r for r in caplog.records if r.name == "kvactors.tiers.disk" and "job_failed" in r.getMessage()
    ]
    assert warnings and f"job_id={res.job_id}" in warnings[-1].getMessage()


def test_enospc_fails_store_cleanly(make, monkeypatch, caplog, tmp_path: Path) -> None:
    h = make()
    real_writev = os.writev

    def full(fd: int, buffers: Sequence[bytes]) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "writev", full)
    res = h.store([b"a", b"b"], [0, 1])
    monkeypatch.setattr(os, "writev", real_writev)
    _assert_failed_once(h, res, caplog, "ENOSPC")
    assert h.tier.lookup([b"a", b"b"], CTX) == [MISS] * 2
    assert list((tmp_path / "tier").iterdir()) == []  # temp file removed
    assert h.tier.used_bytes == 0
    assert h.store([b"a"], [0]).success  # the reservation was released


def test_enospc_on_open_fails_store(make, monkeypatch, caplog) -> None:
    h = make()
    real_open = os.open

    def fail_create(path, flags, *args, **kwargs):  # type: ignore[no-untyped-def]
        if flags & os.O_CREAT:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", fail_create)
    res = h.store([b"a"], [0])
    _assert_failed_once(h, res, caplog, "No space left")


def test_directory_removed_under_tier(make, caplog, tmp_path: Path) -> None:
    root = tmp_path / "tier"
    h = make(root)
    assert h.store([b"a"], [0]).success
    shutil.rmtree(root)
    root.write_bytes(b"now a regular file")
    _assert_failed_once(h, h.store([b"b"], [1]), caplog, "Error")
    caplog.clear()
    _assert_failed_once(h, h.load([b"a"], [2]), caplog, "missing")
    assert h.tier.lookup([b"a", b"b"], CTX) == [MISS] * 2


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores file permissions")
def test_permission_denied(make, caplog, tmp_path: Path) -> None:
    root = tmp_path / "tier"
    h = make(root)
    os.chmod(root, 0o500)
    try:
        _assert_failed_once(h, h.store([b"a"], [0]), caplog, "EACCES")
    finally:
        os.chmod(root, 0o700)


def test_report_raising_does_not_break_the_worker(make, tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "t", capacity_bytes=1 << 20, io_workers=1)
    seen: list[JobResult] = []

    def report(result: JobResult) -> None:
        seen.append(result)
        raise RuntimeError("manager gone")

    tier.attach(torch.zeros((2, BLOCK), dtype=torch.uint8), report)
    for i in range(3):
        tier.submit_store(TransferJob(i, (bytes([i]),), (0,), CTX, False))
    tier.drain(WAIT)
    tier.shutdown()
    assert sorted(r.job_id for r in seen) == [0, 1, 2]


# ---------------------------------------------------------------- concurrency


def test_many_concurrent_jobs_reported_exactly_once(make) -> None:
    h = make(rows=64, block=1024, io_workers=4)
    keys = keys_of(300)
    stores = [h.job([k], [i % 32], promotion=False) for i, k in enumerate(keys)]
    for job in stores:
        h.tier.submit_store(job)
    got = [h.results.get(timeout=WAIT) for _ in stores]
    assert sorted(r.job_id for r in got) == sorted(j.job_id for j in stores)
    assert all(r.success for r in got)
    loads = [h.job([k], [32 + i % 32], promotion=True) for i, k in enumerate(keys)]
    # Interleave with lookups on this (the actor's) thread while the workers run.
    for job in loads:
        h.tier.submit_load(job)
        assert h.tier.lookup([job.keys[0]], CTX) == [HIT]
    got = [h.results.get(timeout=WAIT) for _ in loads]
    counts = collections.Counter(r.job_id for r in got)
    assert counts == collections.Counter(j.job_id for j in loads)
    assert all(r.success for r in got)
    h.tier.drain(WAIT)
    assert h.results.empty()


def test_large_job_split_across_workers_is_byte_exact(make) -> None:
    h = make(rows=128, block=64 * 1024, io_workers=4)
    keys = keys_of(64)
    original = h.pool[:64].clone()
    assert h.store(keys, range(64)).success
    h.assert_no_more_reports()
    res = h.load(keys, range(64, 128))
    assert res.success
    assert torch.equal(h.pool[64:128], original)
    h.assert_no_more_reports()


def test_shutdown_with_queued_jobs_reports_each_once(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "t", capacity_bytes=1 << 24, io_workers=1)
    results: queue.Queue[JobResult] = queue.Queue()
    entered, release = threading.Event(), threading.Event()

    def report(result: JobResult) -> None:
        if result.job_id == 0:  # hold the only worker inside job 0's report
            entered.set()
            assert release.wait(WAIT)
        results.put(result)

    tier.attach(torch.zeros((4, BLOCK), dtype=torch.uint8), report)
    jobs = [TransferJob(i, (b"k%d" % i,), (i % 4,), CTX, False) for i in range(50)]
    for job in jobs:
        tier.submit_store(job)
    assert entered.wait(WAIT)
    closer = threading.Thread(target=tier.shutdown)  # drains for a second, then cancels the queue
    closer.start()
    cancelled = [results.get(timeout=WAIT) for _ in range(49)]  # reported by the closing thread
    release.set()
    closer.join(WAIT)
    assert not closer.is_alive()
    first = results.get(timeout=WAIT)
    assert first == JobResult(0, True)
    assert sorted(r.job_id for r in cancelled) == list(range(1, 50))
    assert not any(r.success for r in cancelled)
    assert all("shut down" in (r.error or "") for r in cancelled)
    # After shutdown: a submit is reported failed at once, exactly once.
    tier.submit_load(TransferJob(99, (b"k1",), (0,), CTX, True))
    assert results.get(timeout=WAIT) == JobResult(99, False, "tier 'disk' is shut down")
    tier.shutdown()
    assert results.empty()


def test_worker_threads_named(make) -> None:
    h = make(name="d2")
    assert h.store([b"a"], [0]).success
    assert any(t.name == "kvactors-disk-d2-0" for t in threading.enumerate())
    assert all(e.tier == "d2" for e in h.tier.take_events())


def test_short_reads_and_writes_still_byte_exact(make, monkeypatch) -> None:
    h = make()
    keys = keys_of(3)
    original = h.pool[:3].clone()
    real_preadv, real_writev, real_pwritev = os.preadv, os.writev, os.pwritev

    def short_preadv(fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        return real_preadv(fd, [memoryview(buffers[0])[:1000]], offset)

    def short_writev(fd: int, buffers: Sequence[bytes]) -> int:
        return real_writev(fd, [memoryview(buffers[0])[:5]])

    def short_pwritev(fd: int, buffers: Sequence[bytes], offset: int) -> int:
        return real_pwritev(fd, [memoryview(buffers[0])[:777]], offset)

    monkeypatch.setattr(os, "writev", short_writev)
    monkeypatch.setattr(os, "pwritev", short_pwritev)
    assert h.store(keys, range(3)).success
    monkeypatch.setattr(os, "preadv", short_preadv)
    h.pool.zero_()
    assert h.load(keys, range(3, 6)).success
    assert torch.equal(h.pool[3:6], original)
