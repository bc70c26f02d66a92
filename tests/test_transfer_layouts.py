"""kvactors.transfer.layouts: the vLLM worker's page layout under every CPU copier, byte for byte.

A reference copies block by block in plain indexing; each copier (the layout's own torch
copy, the torch copier's thread, the native copier) must move exactly those bytes, for one
and several blocks a chunk, several KV cache groups, and runs that cross rows and groups.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from typing import Any

import pytest
import torch

from kvactors.transfer.cpu import CpuCopier
from kvactors.transfer.cuda import HostRegistration
from kvactors.transfer.jobs import OFFLOAD, ONBOARD, CopyJob, Direction
from kvactors.transfer.layouts import PageLayout, RowLayout, resolve
from kvactors.transfer.native import NativeCopier, native_copy_available
from kvactors.transfer.runs import Run, copy_runs

TIMEOUT = 10.0
POOL_ROWS = 12


class Reports:
    """A copier's ``done`` callback that keeps every report."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.items: list[tuple[CopyJob, BaseException | None]] = []

    def __call__(self, job: CopyJob, error: BaseException | None) -> None:
        with self.cond:
            self.items.append((job, error))
            self.cond.notify_all()

    def wait_for(self, n: int) -> list[tuple[CopyJob, BaseException | None]]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.items) >= n, TIMEOUT), f"{len(self.items)} of {n} reported"
            return list(self.items)


def make_job(job_id: int, direction: Direction, runs: list[Run], deadline: float | None = None) -> CopyJob:
    return CopyJob(job_id=job_id, direction=direction, runs=tuple(runs), nbytes=0, blocks=len(runs),
                   deadline=deadline, timeout_s=None if deadline is None else 60.0)


class Case:
    """Two groups (pages of 64 and 32 bytes; 3 and 2 tensors; 10 and 6 blocks) in a pool whose rows
    hold ``bpc`` slots of the larger group at byte 16 (a rank's part that does not start the row)."""

    def __init__(self, bpc: int, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.bpc = bpc
        self.specs = [(10, 64, 3), (6, 32, 2)]  # (blocks, page, tensors)
        row_bytes = 16 + bpc * max(page * n for _, page, n in self.specs) + 8
        self.pool = torch.randint(0, 256, (POOL_ROWS, row_bytes), dtype=torch.uint8, generator=gen)
        self.groups = [[torch.randint(0, 256, (blocks, page), dtype=torch.uint8, generator=gen) for _ in range(n)]
                       for blocks, page, n in self.specs]
        planes = [[(t, 16 + i * bpc * t.shape[1]) for i, t in enumerate(ts)] for ts in self.groups]
        self.layout = PageLayout(planes, self.pool, bpc)

    def random_job(self, rng: random.Random) -> tuple[list[tuple[int, int, int, int]], list[int], list[int]]:
        """``(group, block, row, slot)`` of distinct blocks and distinct slots, with their run ids. A
        row holds a chunk of one group (the groups' slots share its bytes), as the vLLM worker's jobs."""
        picks: list[tuple[int, int, int, int]] = []
        row_group = [rng.randrange(2) for _ in range(POOL_ROWS)]
        slots = rng.sample(range(POOL_ROWS * self.bpc), rng.randrange(1, 12))
        for i, flat in enumerate(sorted(slots) if rng.random() < 0.5 else slots):
            row, slot = divmod(flat, self.bpc)
            g = row_group[row]
            b = rng.randrange(self.specs[g][0])
            if i and rng.random() < 0.6:  # often the next device block: runs that cross rows and groups
                pg, pb = picks[i - 1][:2]
                nb = pb + 1 if pb + 1 < self.specs[pg][0] else 0
                ng = pg if nb else pg + 1
                if ng == g:
                    b = nb
            picks.append((g, b, row, slot))
        distinct: dict[tuple[int, int], tuple[int, int, int, int]] = {}
        for pick in picks:  # one copy per device block (a load must not write a block twice)
            distinct.setdefault(pick[:2], pick)
        picks = list(distinct.values())
        dev = [self.layout.device_id(g, b) for g, b, _, _ in picks]
        pool = [self.layout.slot_id(r, s) for _, _, r, s in picks]
        return picks, dev, pool

    def expected(self, direction: Direction, picks: list[tuple[int, int, int, int]]) -> tuple[Any, Any]:
        """The tensors after the copy, done block by block."""
        pool = self.pool.clone()
        groups = [[t.clone() for t in ts] for ts in self.groups]
        for g, b, r, s in picks:
            for i, t in enumerate(groups[g]):
                page = t.shape[1]
                at = 16 + i * self.bpc * page + s * page
                if direction == OFFLOAD:
                    pool[r, at:at + page] = t[b]
                else:
                    t[b] = pool[r, at:at + page]
        return pool, groups

    def assert_equal(self, expected: tuple[Any, Any]) -> None:
        pool, groups = expected
        assert torch.equal(self.pool, pool)
        for got, want in zip(self.groups, groups, strict=True):
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def runs_of(direction: Direction, dev: list[int], pool: list[int]) -> list[Run]:
    return copy_runs(dev, pool) if direction == OFFLOAD else copy_runs(pool, dev)


def start_copier(copier: str, case: Case, reports: Reports, fault_injector: Any = None) -> Any:
    if copier.startswith("torch"):
        return CpuCopier(layout=case.layout, workers=1, done=reports, fault_injector=fault_injector)
    return NativeCopier(layout=case.layout, threads=2, done=reports)


COPIERS = ["layout", "torch", pytest.param("native", marks=pytest.mark.skipif(
    not native_copy_available(), reason="the native copy loop is not built"))]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("copier", COPIERS)
@pytest.mark.parametrize("bpc", [1, 2, 3])
def test_every_copier_moves_the_pages_the_reference_moves(copier: str, bpc: int) -> None:
    case = Case(bpc)
    rng = random.Random(bpc)
    reports = Reports()
    running = None if copier == "layout" else start_copier(copier, case, reports)
    try:
        for i in range(60):
            direction: Direction = OFFLOAD if i % 2 == 0 else ONBOARD
            picks, dev, pool = case.random_job(rng)
            expected = case.expected(direction, picks)
            runs = runs_of(direction, dev, pool)
            if running is None:
                case.layout.copy(direction, runs)
            else:
                running.submit(make_job(i, direction, runs))
                _, error = reports.wait_for(i + 1)[i]
                assert error is None, error
            case.assert_equal(expected)
    finally:
        if running is not None:
            running.shutdown()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bpc", [1, 2])
def test_byte_runs_name_the_bytes_the_torch_copy_moves(bpc: int) -> None:
    """Each triple is a contiguous range inside one of the layout's tensors on each side."""
    case = Case(bpc)
    rng = random.Random(7)
    spans = [(t.data_ptr(), t.data_ptr() + t.numel()) for t in case.layout.tensors]
    for _ in range(40):
        _, dev, pool = case.random_job(rng)
        for direction in (OFFLOAD, ONBOARD):
            src_base, dst_base, triples = case.layout.byte_runs(direction, runs_of(direction, dev, pool))
            assert len(triples) % 3 == 0 and triples
            written = []
            for k in range(0, len(triples), 3):
                s, d, n = src_base + triples[k], dst_base + triples[k + 1], triples[k + 2]
                assert n > 0
                assert any(lo <= s and s + n <= hi for lo, hi in spans), "source range outside every tensor"
                assert any(lo <= d and d + n <= hi for lo, hi in spans), "destination range outside every tensor"
                written.append((d, d + n))
            written.sort()  # the native threads copy the ranges in parallel: no byte may be written twice
            assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(written))


@pytest.mark.timeout(60)
def test_runs_outside_the_layout_are_refused_before_any_byte_moves() -> None:
    case = Case(2)
    before = case.pool.clone()
    last_slot = POOL_ROWS * 2 - 1
    for runs in ([(0, last_slot, 2)],  # past the last pool row
                 [(case.layout.device_blocks - 1, 0, 2)],  # past the last device block
                 [(-1, 0, 1)]):
        with pytest.raises(ValueError, match="leaves the layout"):
            case.layout.copy(OFFLOAD, runs)
        with pytest.raises(ValueError, match="leaves the layout"):
            case.layout.byte_runs(OFFLOAD, runs)
    assert torch.equal(case.pool, before)
    with pytest.raises(ValueError, match="out of range"):
        case.layout.device_id(1, 6)
    with pytest.raises(ValueError, match="out of range"):
        case.layout.slot_id(POOL_ROWS, 0)
    with pytest.raises(ValueError, match="out of range"):
        case.layout.slot_id(0, 2)


ALIASED = [
    # (slots a row, direction, runs, the error): device ids 0-9 are group 0's blocks 0-9, 10-15 group 1's 0-5
    (2, OFFLOAD, [(0, 0, 1), (10, 1, 1)], "pool row 0 for KV cache groups 0 and 1"),  # one row, two groups
    (2, ONBOARD, [(6, 0, 1), (7, 10, 1)], "pool row 3 for KV cache groups 0 and 1"),  # a load of it too
    (2, OFFLOAD, [(0, 4, 2), (5, 5, 1)], "writes pool row 2 slot 1 twice"),  # a slot twice, in one row
    (2, OFFLOAD, [(0, 3, 3), (7, 4, 1)], "writes pool row 2 slot 0 twice"),  # across rows, then one of its slots
    (2, ONBOARD, [(0, 2, 2), (6, 3, 1)], "writes device block 3 of KV cache group 0 twice"),
    (2, ONBOARD, [(0, 11, 1), (1, 11, 1)], "writes device block 1 of KV cache group 1 twice"),
    (1, OFFLOAD, [(0, 3, 2), (10, 4, 1)], "names pool row 4 twice"),  # one slot a row: a row twice
    (1, ONBOARD, [(3, 0, 1), (3, 10, 1)], "names pool row 3 twice"),  # read for two groups
]
ALIASED_COPIERS = [*COPIERS, "torch, with a deadline"]  # that copier copies such a job a run at a time


@pytest.mark.timeout(60)
@pytest.mark.parametrize("copier", ALIASED_COPIERS)
@pytest.mark.parametrize(("bpc", "direction", "runs", "error"), ALIASED)
def test_a_job_that_writes_a_place_twice_or_mixes_groups_in_a_row_is_refused_before_any_byte_moves(
        copier: str, bpc: int, direction: Direction, runs: list[Run], error: str) -> None:
    """The groups' slots share a row's bytes, and the native threads copy a job's pieces in
    parallel: a job that writes a place twice would leave bytes no order of its copies gives, and
    one that names a row for two groups would move one group's bytes as the other's."""
    case = Case(bpc)
    before = case.pool.clone(), [[t.clone() for t in ts] for ts in case.groups]
    if copier == "layout":
        for refuse in (case.layout.check, case.layout.copy, case.layout.byte_runs):
            with pytest.raises(ValueError, match=error):
                refuse(direction, runs)
    else:
        reports = Reports()
        running = start_copier(copier, case, reports)
        try:
            deadline = time.monotonic() + 60 if copier.endswith("deadline") else None
            running.submit(make_job(1, direction, runs, deadline))
            (_, got), = reports.wait_for(1)
        finally:
            running.shutdown()
        assert isinstance(got, ValueError) and error in str(got), got
    case.assert_equal(before)


def gated_copier(case: Case, reports: Reports) -> tuple[CpuCopier, threading.Event]:
    """A torch copier whose thread holds job 0 in the fault injector until the gate opens: the
    jobs submitted meanwhile are taken together, as one batch."""
    gate, holding = threading.Event(), threading.Event()

    def hold(job: CopyJob) -> None:
        if job.job_id == 0:
            holding.set()
            assert gate.wait(TIMEOUT)

    copier = start_copier("torch", case, reports, fault_injector=hold)
    copier.submit(make_job(0, OFFLOAD, [(9, 23, 1)]))  # group 0's block 9 to row 11, slot 1
    assert holding.wait(TIMEOUT)
    return copier, gate


@pytest.mark.timeout(60)
def test_a_refused_job_fails_alone_in_the_torch_copiers_batch() -> None:
    """vLLM is told every load succeeded (the worker has no other way): a load the layout refuses
    must not fail the loads batched with it, which would leave their blocks unwritten."""
    case = Case(2)
    reports = Reports()
    copier, gate = gated_copier(case, reports)
    try:
        copier.submit(make_job(1, ONBOARD, [(6, 0, 1), (7, 10, 1)]))  # row 3 for two groups: refused
        copier.submit(make_job(2, ONBOARD, [(0, 2, 2)]))  # row 0 into group 0's blocks 2 and 3
        expected = case.expected(ONBOARD, [(0, 2, 0, 0), (0, 3, 0, 1)])
        gate.set()
        got = {job.job_id: error for job, error in reports.wait_for(3)}
    finally:
        copier.shutdown()
    assert isinstance(got[1], ValueError) and got[0] is None and got[2] is None, got
    for got_t, want_t in zip(case.groups[0], expected[1][0], strict=True):
        assert torch.equal(got_t, want_t)


@pytest.mark.timeout(60)
def test_jobs_that_each_pass_but_write_one_place_are_copied_one_after_another() -> None:
    """Two jobs in flight that write one slot break the caller's contract, not the layout's: the
    torch copier's batch then copies them in queue order, and neither fails for the other."""
    case = Case(2)
    reports = Reports()
    copier, gate = gated_copier(case, reports)
    try:
        copier.submit(make_job(1, OFFLOAD, [(4, 6, 1)]))
        copier.submit(make_job(2, OFFLOAD, [(5, 6, 1)]))  # the same slot: the later job's bytes stay
        expected = case.expected(OFFLOAD, [(0, 9, 11, 1), (0, 5, 3, 0)])
        gate.set()
        got = {job.job_id: error for job, error in reports.wait_for(3)}
    finally:
        copier.shutdown()
    assert got == {0: None, 1: None, 2: None}, got
    assert torch.equal(case.pool, expected[0])


@pytest.mark.timeout(60)
@pytest.mark.skipif(not native_copy_available(), reason="the native copy loop is not built")
def test_the_native_copier_fails_a_job_outside_the_layout_with_the_layouts_error() -> None:
    case = Case(1)
    before = case.pool.clone()
    reports = Reports()
    copier = NativeCopier(layout=case.layout, threads=2, done=reports)
    try:
        copier.submit(make_job(1, OFFLOAD, [(0, POOL_ROWS - 1, 3)]))
        (_, error), = reports.wait_for(1)
    finally:
        copier.shutdown()
    assert isinstance(error, ValueError) and "leaves the layout" in str(error)
    assert torch.equal(case.pool, before)


@pytest.mark.timeout(60)
def test_a_layout_that_does_not_fit_is_a_value_error() -> None:
    pool = torch.zeros(4, 100, dtype=torch.uint8)
    dev = torch.zeros(8, 64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="do not fit"):
        PageLayout([[(dev, 0)]], pool, 2)
    with pytest.raises(ValueError, match="different numbers of blocks"):
        PageLayout([[(dev, 0), (torch.zeros(9, 16, dtype=torch.uint8), 64)]], pool, 1)
    with pytest.raises(ValueError, match="uint8 rows"):
        PageLayout([[(dev.view(torch.int8), 0)]], pool, 1)
    with pytest.raises(ValueError, match="blocks_per_chunk"):
        PageLayout([[(dev, 0)]], pool, 0)
    assert not PageLayout([[(dev[:, :32].t().contiguous().t(), 0)]], pool, 1).native()  # rows not contiguous
    with pytest.raises(RuntimeError, match="rows are contiguous"):
        NativeCopier(layout=PageLayout([[(dev[:, :32].t().contiguous().t(), 0)]], pool, 1), threads=1,
                     done=Reports())


@pytest.mark.timeout(60)
def test_a_copier_takes_a_layout_or_two_tensors_not_both() -> None:
    dev, pool = torch.zeros(2, 8, dtype=torch.uint8), torch.zeros(2, 8, dtype=torch.uint8)
    assert isinstance(resolve(dev, pool, None), RowLayout)
    with pytest.raises(ValueError, match="not both"):
        resolve(dev, pool, RowLayout(dev, pool))
    with pytest.raises(ValueError, match="or a layout"):
        resolve(dev, None, None)


@pytest.mark.timeout(60)
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only path of the registration")
def test_host_registration_without_cuda_is_logged_and_releases_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("WARNING", logger="kvactors")
    registration = HostRegistration(torch.zeros(16, dtype=torch.uint8))
    assert not registration.registered
    assert any("pool_not_pinned" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    registration.release()
    registration.release()
    assert not registration.registered
