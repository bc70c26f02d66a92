"""Where the rows a copy job names lie: what a copier moves for a job's runs.

A :class:`~kvactors.transfer.jobs.CopyJob` names its rows as runs
``(src, dst, n)`` (:mod:`kvactors.transfer.runs`); a layout says which bytes
they are, for each copier: the slice copies of the torch and CUDA copiers
(:meth:`Layout.copy`) and the byte ranges of the native one
(:meth:`Layout.byte_runs`).

* :class:`RowLayout`: the :class:`~kvactors.transfer.engine.TransferEngine`'s,
  a device cache and a pool of equal rows; a run is one slice copy.
* :class:`PageLayout`: the vLLM worker's, one KV tensor per layer on the device
  side and each block's page of every layer side by side in a pool row.

Threading: a layout is immutable once built; any thread may use it.
"""

from __future__ import annotations

import array
import bisect
import itertools
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from kvactors.transfer.jobs import OFFLOAD, Direction
from kvactors.transfer.runs import Run
from kvactors.transfer.views import copy_all, widest_views


class Layout(Protocol):
    """How a copier maps a job's runs to bytes. Offload runs go device -> pool, onboard runs
    pool -> device; a run's ids are device rows on the device side and pool rows (or slots:
    :class:`PageLayout`) on the pool side."""

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor the copies read or write (the native copier checks that none moved)."""

    def copy(self, direction: Direction, runs: Sequence[Run], *, non_blocking: bool = False) -> None:
        """Copy ``runs`` with torch (on the current CUDA stream where the tensors are on one)."""

    def check(self, direction: Direction, runs: Sequence[Run]) -> None:
        """``ValueError`` if :meth:`copy` or :meth:`byte_runs` would refuse ``runs``; moves nothing."""

    def native(self) -> bool:
        """Whether :meth:`byte_runs` can describe the copies: host tensors whose rows are contiguous."""

    def byte_runs(self, direction: Direction, runs: Sequence[Run]) -> tuple[int, int, array.array[int]]:
        """``(src_base, dst_base, triples)`` for the native copier: ``(src offset, dst offset, bytes)``
        triples from the two base addresses. Only where :meth:`native` is true."""


class RowLayout:
    """A ``device_cache`` and a ``pool`` of rows of equal bytes; a run copies ``n`` whole rows."""

    def __init__(self, device_cache: torch.Tensor, pool: torch.Tensor) -> None:
        self._pairs: dict[Direction, tuple[torch.Tensor, torch.Tensor]] = {
            "offload": (device_cache, pool),
            "onboard": (pool, device_cache),
        }
        self._tensors = (device_cache, pool)
        self._row_bytes = int(pool.shape[1]) * pool.element_size()

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self._tensors

    def copy(self, direction: Direction, runs: Sequence[Run], *, non_blocking: bool = False) -> None:
        src, dst = self._pairs[direction]
        for s, d, n in runs:
            dst[d : d + n].copy_(src[s : s + n], non_blocking=non_blocking)

    def check(self, direction: Direction, runs: Sequence[Run]) -> None:
        pass  # the engine checks the rows before it makes a job

    def native(self) -> bool:
        device_cache, pool = self._tensors
        return (device_cache.device.type == "cpu" and pool.device.type == "cpu"
                and device_cache.is_contiguous() and pool.is_contiguous())

    def byte_runs(self, direction: Direction, runs: Sequence[Run]) -> tuple[int, int, array.array[int]]:
        src, dst = self._pairs[direction]
        row = self._row_bytes
        out = array.array("Q")
        for s, d, n in runs:
            out.extend((s * row, d * row, n * row))
        return src.data_ptr(), dst.data_ptr(), out


# One tensor of a page layout: the device tensor as rows (num_blocks, page) and its part of the
# pool, (rows, blocks_per_chunk * page), both of the widest integer type they allow.
_Plane = tuple[torch.Tensor, torch.Tensor]


class PageLayout:
    """The vLLM worker's layout: per KV cache group, its device tensors, each ``(num_blocks, page)``
    ``uint8`` rows, and the part of each pool row that holds them.

    A pool row holds ``blocks_per_chunk`` *slots* of every tensor of every group: tensor ``t`` of
    a group at byte ``offsets[t]`` of the row, its slots one page after another. Pool-side ids of
    a run are slots, ``row * blocks_per_chunk + slot``; device-side ids number the groups' blocks
    one group after another (:meth:`device_id`). A run may cross a row or a group boundary: the
    layout splits it there.

    The groups' slots share the row's bytes (a row holds a chunk of one group at a time), so a
    job may name a pool row's slots of one group only (with one slot a row: a row once), and
    write no place (slot or device block) twice: ``ValueError`` otherwise (:meth:`check`),
    from every copier, before any of the job's bytes move. A job's copies run in parallel (the
    native copier's threads), so aliased writes would leave bytes that no order of the copies
    gives; a load of one row for two groups would read one group's bytes as the other's.
    Device blocks are told apart by group and block, not by address: groups that share a
    tensor are not checked against each other. Jobs in flight together must not alias either;
    that is the caller's to keep (the pool's pins, vLLM's block tables), not checked here.

    ``ValueError`` if a group's tensors differ in block count, a tensor is not 2-d ``uint8``,
    or a tensor's slots do not fit in the row.
    """

    def __init__(self, groups: Sequence[Sequence[tuple[torch.Tensor, int]]], pool: torch.Tensor,
                 blocks_per_chunk: int) -> None:
        if blocks_per_chunk < 1:
            raise ValueError(f"blocks_per_chunk must be >= 1, got {blocks_per_chunk}")
        if pool.dtype != torch.uint8 or pool.dim() != 2:
            raise ValueError(f"the pool must be uint8 rows, got {pool.dtype} of shape {tuple(pool.shape)}")
        self.bpc = blocks_per_chunk
        self.pool_rows = int(pool.shape[0])
        row_bytes = int(pool.shape[1])
        self._groups: list[list[_Plane]] = []
        self._raw: list[list[tuple[torch.Tensor, torch.Tensor]]] = []  # the uint8 tensors
        self._first: list[int] = []  # device id of each group's block 0
        self._blocks: list[int] = []
        self.slot_bytes: list[int] = []  # per group: one slot of every tensor
        tensors: list[torch.Tensor] = [pool]
        first = 0
        for g, planes in enumerate(groups):
            blocks = {int(dev.shape[0]) for dev, _ in planes}
            if len(blocks) > 1:
                raise ValueError(f"group {g}: its tensors hold different numbers of blocks {sorted(blocks)}")
            group: list[_Plane] = []
            raw: list[_Plane] = []
            slot_bytes = 0
            for dev, offset in planes:
                if dev.dtype != torch.uint8 or dev.dim() != 2:
                    raise ValueError(f"group {g}: a device tensor must be uint8 rows, got {dev.dtype} of shape "
                                     f"{tuple(dev.shape)}")
                page = int(dev.shape[1])
                width = blocks_per_chunk * page
                if offset < 0 or offset + width > row_bytes:
                    raise ValueError(f"group {g}: {width} bytes at offset {offset} do not fit a pool row of "
                                     f"{row_bytes} bytes")
                part = pool[:, offset:offset + width]
                raw.append((dev, part))
                wide_dev, wide_part = widest_views(dev, part)
                group.append((wide_dev, wide_part))
                tensors.append(dev)
                slot_bytes += page
            self._groups.append(group)
            self._raw.append(raw)

            self._first.append(first)
            count = blocks.pop() if blocks else 0
            self._blocks.append(count)
            self.slot_bytes.append(slot_bytes)
            first += count
        self.device_blocks = first
        self._tensors = tuple(tensors)
        # For byte_runs: addresses as offsets from the lowest device tensor's and the pool's, taken
        # now (the native copier refuses a job once a tensor has moved), per group and tensor:
        # (device offset, page bytes, pool part offset, pool row stride).
        self._dev_base = min((dev.data_ptr() for group in self._raw for dev, _ in group), default=0)
        self._pool_base = pool.data_ptr()
        self._offsets = [[(dev.data_ptr() - self._dev_base, int(dev.shape[1]), part.data_ptr() - self._pool_base,
                           int(part.stride(0))) for dev, part in group] for group in self._raw]

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self._tensors

    @property
    def device(self) -> torch.device:
        """The device tensors' device (the CPU for a layout without tensors)."""
        return self._tensors[1].device if len(self._tensors) > 1 else torch.device("cpu")

    def device_id(self, group: int, block: int) -> int:
        """The run id of device block ``block`` of ``group``; ``ValueError`` if out of range."""
        if not 0 <= group < len(self._groups):
            raise ValueError(f"KV cache group {group} out of range [0, {len(self._groups)})")
        if not 0 <= block < self._blocks[group]:
            raise ValueError(f"device block {block} of group {group} out of range [0, {self._blocks[group]})")
        return self._first[group] + block

    def slot_id(self, row: int, slot: int) -> int:
        """The run id of ``slot`` of pool row ``row``; ``ValueError`` if out of range."""
        if not 0 <= row < self.pool_rows:
            raise ValueError(f"pool row {row} out of range [0, {self.pool_rows})")
        if not 0 <= slot < self.bpc:
            raise ValueError(f"slot {slot} out of range [0, {self.bpc})")
        return row * self.bpc + slot

    def _pieces(self, direction: Direction, runs: Sequence[Run]) -> list[tuple[int, int, int, int, int]]:
        """``(group, device block, row, slot, n)``: the runs split where a group or a pool row ends;
        ``ValueError`` for runs outside the layout or that alias (the class docstring)."""
        out = []
        offload = direction == OFFLOAD
        bpc, firsts, counts = self.bpc, self._first, self._blocks
        written: list[tuple[int, int]] = []  # the destination id ranges, (start, n)
        pool_side: list[tuple[int, int]] = []  # one slot a row: the pool rows named, (start, n)
        row_group: dict[int, int] = {}  # several slots a row: the group each row holds
        if runs and not self.device_blocks:
            raise ValueError("a run leaves the layout: it has no device blocks")
        for s, d, n in runs:
            dev_id, slot_id = (s, d) if offload else (d, s)
            while n > 0:
                # The last group starting at or before dev_id (an empty group never: the next starts there too).
                g = max(bisect.bisect_right(firsts, dev_id) - 1, 0)
                block = dev_id - firsts[g]
                row, slot = divmod(slot_id, bpc)
                # One block a chunk: rows are pool_part[row:row + take] (a strided view), not split.
                take = min(n, counts[g] - block, bpc - slot if bpc > 1 else n)
                # Checked here, for every copier: the native one writes through raw addresses.
                if dev_id < 0 or take < 1 or slot_id < 0 or row + (take if bpc == 1 else 1) > self.pool_rows:
                    raise ValueError(f"run {(s, d, n)} leaves the layout ({self.device_blocks} device blocks, "
                                     f"{self.pool_rows} pool rows of {bpc} slots)")
                out.append((g, block, row, slot, take))
                if bpc > 1:
                    if row_group.setdefault(row, g) != g:
                        raise ValueError(f"the job names pool row {row} for KV cache groups {row_group[row]} "
                                         f"and {g}: their slots share the row's bytes")
                    if offload:
                        written.append((slot_id, take))
                else:
                    pool_side.append((slot_id, take))
                if not offload:
                    written.append((dev_id, take))
                dev_id += take
                slot_id += take
                n -= take
        if len(pool_side) > 1:  # a row is a slot: naming it twice writes it twice, or reads it for two blocks
            _check_disjoint(pool_side, self._describe_slot, "names")
        if len(written) > 1:
            _check_disjoint(written, self._describe_slot if offload else self._describe_device, "writes")
        return out

    def _describe_slot(self, slot_id: int) -> str:
        row, slot = divmod(slot_id, self.bpc)
        return f"pool row {row}" if self.bpc == 1 else f"pool row {row} slot {slot}"

    def _describe_device(self, dev_id: int) -> str:
        g = max(bisect.bisect_right(self._first, dev_id) - 1, 0)
        return f"device block {dev_id - self._first[g]} of KV cache group {g}"

    def check(self, direction: Direction, runs: Sequence[Run]) -> None:
        self._pieces(direction, runs)

    def copy(self, direction: Direction, runs: Sequence[Run], *, non_blocking: bool = False) -> None:
        """One ``_foreach_copy_`` of every piece of every tensor (:func:`~kvactors.transfer.views.copy_all`)."""
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        offload = direction == OFFLOAD
        bpc = self.bpc
        for g, block, row, slot, take in self._pieces(direction, runs):
            for dev, part in self._groups[g]:
                dev_part = dev[block:block + take]
                if bpc == 1:
                    pool_part = part[row:row + take]
                else:
                    width = part.shape[1] // bpc
                    pool_part = part[row, slot * width:(slot + take) * width].view(take, width)
                dsts.append(pool_part if offload else dev_part)
                srcs.append(dev_part if offload else pool_part)
        copy_all(dsts, srcs, non_blocking=non_blocking)

    def native(self) -> bool:
        return all(t.device.type == "cpu" for t in self._tensors) and all(
            dev.stride() == (dev.shape[1], 1) and part.stride(1) == 1
            for group in self._raw for dev, part in group)

    def byte_runs(self, direction: Direction, runs: Sequence[Run]) -> tuple[int, int, array.array[int]]:
        """One range per piece of each tensor where the piece is contiguous in the pool (a slot
        range of one row), else (one block a chunk, several rows) one range per row; offsets
        from the lowest device tensor's address and the pool's. A tensor's ranges of a piece
        are arithmetic progressions, built at C speed (``array`` from ``range``), so a job of
        many layers and blocks costs a few microseconds a tensor, not a Python step a range."""
        devs, pools, sizes = array.array("Q"), array.array("Q"), array.array("Q")
        bpc = self.bpc
        for g, block, row, slot, take in self._pieces(direction, runs):
            for dev_off, page, part_off, row_stride in self._offsets[g]:
                d0 = dev_off + block * page
                p0 = part_off + row * row_stride + slot * page
                if bpc > 1 or take == 1 or row_stride == page:
                    devs.append(d0)
                    pools.append(p0)
                    sizes.append(take * page)
                else:
                    devs.extend(range(d0, d0 + take * page, page))
                    pools.extend(range(p0, p0 + take * row_stride, row_stride))
                    sizes.extend(itertools.repeat(page, take))
        out = array.array("Q", bytes(24 * len(devs)))
        if direction == OFFLOAD:
            out[0::3], out[1::3], out[2::3] = devs, pools, sizes
            return self._dev_base, self._pool_base, out
        out[0::3], out[1::3], out[2::3] = pools, devs, sizes
        return self._pool_base, self._dev_base, out


def _check_disjoint(ranges: list[tuple[int, int]], describe: Callable[[int], str], verb: str) -> None:
    """``ValueError`` naming the first id that two of the ``(start, n)`` id ranges share."""
    ranges.sort()
    end = ranges[0][0]
    for start, n in ranges:
        if start < end:
            raise ValueError(f"the job {verb} {describe(start)} twice")
        end = start + n


def resolve(device_cache: torch.Tensor | None, pool: torch.Tensor | None, layout: Layout | None) -> Layout:
    """A copier's layout: ``layout``, or a :class:`RowLayout` of ``device_cache`` and ``pool``
    (``ValueError`` unless exactly one of the two ways is given)."""
    if layout is not None:
        if device_cache is not None or pool is not None:
            raise ValueError("give a copier a layout or a device_cache and a pool, not both")
        return layout
    if device_cache is None or pool is None:
        raise ValueError("a copier needs a device_cache and a pool, or a layout")
    return RowLayout(device_cache, pool)
