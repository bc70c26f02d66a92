"""DiskTier with ``O_DIRECT``: a page-aligned pool (as vLLM's, mapped from a file) skips the page cache.

The tier's guarantees do not change with it.
Bytes come back exact, a corrupt or cut file is a failed key and never data, and a file system that refuses
``O_DIRECT`` gets the same bytes through the page cache.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import mmap
import os
import queue
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvactors.tiers.disk import DiskTier
from kvactors.tiers.disk_files import O_DIRECT
from kvactors.types import JobResult, LookupResult, OffloadKey, ReqContext, TransferJob

pytestmark = pytest.mark.skipif(not O_DIRECT, reason="no O_DIRECT on this platform")

BLOCK = 8192
ROWS = 16
CTX = ReqContext("direct")
WAIT = 10.0
_ids = itertools.count(1)


class Opens:
    """Counts the ``os.open`` calls (stores) and ``F_SETFL`` calls (loads) that ask for ``O_DIRECT``.

    ``refuse`` makes an ``O_DIRECT`` open fail with ``EINVAL``.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, refuse: bool = False) -> None:
        self.direct = 0
        self.plain = 0
        self.direct_reads = 0
        real = os.open
        real_fcntl = fcntl.fcntl

        def spy_fcntl(fd: int, cmd: int, arg: int = 0) -> int:
            if cmd == fcntl.F_SETFL and arg & O_DIRECT:
                self.direct_reads += 1
            return real_fcntl(fd, cmd, arg)

        monkeypatch.setattr(fcntl, "fcntl", spy_fcntl)

        def spy(path: str, flags: int, mode: int = 0o777, *args: object, **kwargs: object) -> int:
            if flags & O_DIRECT:
                self.direct += 1
                if refuse:
                    raise OSError(errno.EINVAL, "Invalid argument", path)
            else:
                self.plain += 1
            return real(path, flags, mode, *args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(os, "open", spy)


class Harness:
    """A tier on a pool that is page-aligned (``aligned=True``, an anonymous mapping) or deliberately not."""

    def __init__(self, root: Path, *, aligned: bool = True, **kwargs: object) -> None:
        self._map = mmap.mmap(-1, (ROWS + 1) * BLOCK)
        flat = torch.frombuffer(self._map, dtype=torch.uint8)
        start = 0 if aligned else 64
        self.pool = flat[start : start + ROWS * BLOCK].view(ROWS, BLOCK)
        self.pool[: ROWS // 2] = torch.randint(0, 256, (ROWS // 2, BLOCK), dtype=torch.uint8,
                                               generator=torch.Generator().manual_seed(5))
        self.root = root
        kwargs.setdefault("direct_io", True)
        self.tier = DiskTier(root, capacity_bytes=1 << 30, **kwargs)  # type: ignore[arg-type]
        self.results: queue.Queue[JobResult] = queue.Queue()
        self.tier.attach(self.pool, self.results.put)

    def run(self, keys: list[OffloadKey], rows: list[int], promotion: bool) -> JobResult:
        job = TransferJob(next(_ids), tuple(keys), tuple(rows), CTX, promotion)
        (self.tier.submit_load if promotion else self.tier.submit_store)(job)
        result = self.results.get(timeout=WAIT)
        assert result.job_id == job.job_id
        return result


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[type[Harness]]:
    made: list[Harness] = []

    def make(**kwargs: object) -> Harness:
        h = Harness(tmp_path / "tier", **kwargs)  # type: ignore[arg-type]
        made.append(h)
        return h

    yield make  # type: ignore[misc]
    for h in made:
        h.tier.shutdown()


KEYS = [b"a", b"b", b"c", b"d"]


def _store_and_load(h: Harness) -> JobResult:
    assert h.run(KEYS, [0, 1, 2, 3], False).success
    h.pool[8:12].zero_()
    return h.run(KEYS, [8, 9, 10, 11], True)


def test_an_aligned_pool_stores_and_loads_with_o_direct_byte_exact(harness, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    opens = Opens(monkeypatch)
    h = harness()
    result = _store_and_load(h)
    assert result.success
    assert torch.equal(h.pool[8:12], h.pool[0:4])
    assert opens.direct == 1 and opens.direct_reads == 1  # the store's file, then the load's payloads


@pytest.mark.parametrize("kwargs", [{"aligned": False}, {"direct_io": False}])
def test_an_unaligned_pool_or_direct_io_off_uses_the_page_cache(harness, monkeypatch, kwargs) -> None:  # type: ignore[no-untyped-def]
    opens = Opens(monkeypatch)
    h = harness(**kwargs)
    result = _store_and_load(h)
    assert result.success and torch.equal(h.pool[8:12], h.pool[0:4])
    assert opens.direct == 0 and opens.direct_reads == 0


def test_a_file_system_that_refuses_o_direct_gets_the_page_cache(harness, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    opens = Opens(monkeypatch, refuse=True)
    h = harness()
    result = _store_and_load(h)
    assert result.success and torch.equal(h.pool[8:12], h.pool[0:4])
    assert opens.direct == 1 and opens.direct_reads == 0  # refused once: later stores and loads do not try again


def test_a_write_refused_under_o_direct_is_rewritten_through_the_page_cache(harness, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    real = os.writev
    refused = []

    def refuse_direct(fd: int, buffers: list[memoryview]) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & O_DIRECT:
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, buffers)

    monkeypatch.setattr(os, "writev", refuse_direct)
    h = harness()
    assert h.run(KEYS, [0, 1, 2, 3], False).success
    monkeypatch.undo()
    assert refused
    h.pool[8:12].zero_()
    assert h.run(KEYS, [8, 9, 10, 11], True).success
    assert torch.equal(h.pool[8:12], h.pool[0:4])


def test_a_corrupt_payload_read_with_o_direct_fails_its_key_alone(harness) -> None:  # type: ignore[no-untyped-def]
    h = harness()
    assert h.run(KEYS, [0, 1, 2, 3], False).success
    path, offset, _ = h.tier.locate(b"c")  # type: ignore[misc]
    with open(path, "r+b") as f:
        f.seek(offset + 100)
        byte = f.read(1)
        f.seek(offset + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    result = h.run(KEYS, [8, 9, 10, 11], True)
    assert not result.success
    assert set(result.successful_keys or ()) == {b"a", b"b", b"d"}
    assert "checksum mismatch" in (result.error or "")
    assert h.tier.lookup([b"c"], CTX) == [LookupResult.MISS]
    assert torch.equal(h.pool[8:10], h.pool[0:2]) and torch.equal(h.pool[11], h.pool[3])


@pytest.mark.parametrize("cut", [0, BLOCK // 2 + 1, 4096])
def test_a_file_cut_short_fails_the_keys_past_the_cut(harness, cut) -> None:  # type: ignore[no-untyped-def]
    h = harness()
    assert h.run(KEYS, [0, 1, 2, 3], False).success
    path, offset, _ = h.tier.locate(b"c")  # type: ignore[misc]
    os.truncate(path, offset + cut)  # mid-page or on a page boundary, inside the block of c
    result = h.run(KEYS, [8, 9, 10, 11], True)
    assert not result.success
    assert set(result.successful_keys or ()) == {b"a", b"b"}
    assert torch.equal(h.pool[8:10], h.pool[0:2])
    assert h.tier.lookup([b"c", b"d"], CTX) == [LookupResult.MISS, LookupResult.MISS]


def test_a_changed_table_is_seen_through_o_direct(harness) -> None:  # type: ignore[no-untyped-def]
    h = harness()
    assert h.run(KEYS, [0, 1, 2, 3], False).success
    path, _, _ = h.tier.locate(b"a")  # type: ignore[misc]
    with open(path, "r+b") as f:
        f.seek(20)
        byte = f.read(1)
        f.seek(20)
        f.write(bytes([byte[0] ^ 0xFF]))
    result = h.run(KEYS, [8, 9, 10, 11], True)
    assert not result.success and not result.successful_keys
    assert "its table changed" in (result.error or "")


def test_files_written_with_o_direct_survive_a_restart(harness, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    h = harness()
    assert h.run(KEYS, [0, 1, 2, 3], False).success
    h.tier.shutdown()
    h2 = harness()
    h2.pool[0:4] = h.pool[0:4]
    assert h2.tier.lookup(KEYS, CTX) == [LookupResult.HIT] * 4
    assert h2.run(KEYS, [8, 9, 10, 11], True).success
    assert torch.equal(h2.pool[8:12], h.pool[0:4])


def test_a_read_refused_under_o_direct_is_read_through_the_page_cache(harness, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    h = harness()
    assert h.run(KEYS, [0, 1, 2, 3], False).success
    real = os.preadv
    refused = []

    def refuse_direct(fd: int, buffers: list[memoryview], offset: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & O_DIRECT:
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", refuse_direct)
    h.pool[8:12].zero_()
    assert h.run(KEYS, [8, 9, 10, 11], True).success
    assert refused
    assert torch.equal(h.pool[8:12], h.pool[0:4])


def test_the_default_keeps_the_page_cache_even_for_an_aligned_pool(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    opens = Opens(monkeypatch)
    mapped = mmap.mmap(-1, ROWS * BLOCK)
    pool = torch.frombuffer(mapped, dtype=torch.uint8).view(ROWS, BLOCK)
    pool[:4] = 7
    tier = DiskTier(tmp_path / "tier", capacity_bytes=1 << 30)
    results: queue.Queue[JobResult] = queue.Queue()
    tier.attach(pool, results.put)
    try:
        tier.submit_store(TransferJob(next(_ids), tuple(KEYS), (0, 1, 2, 3), CTX, False))
        assert results.get(timeout=WAIT).success
        tier.submit_load(TransferJob(next(_ids), tuple(KEYS), (8, 9, 10, 11), CTX, True))
        assert results.get(timeout=WAIT).success
        assert torch.equal(pool[8:12], pool[0:4])
        assert opens.direct == 0 and opens.direct_reads == 0
    finally:
        tier.shutdown()
