"""Completions vLLM will never send: the jobs a ``reset_cache`` dropped, and those open at shutdown.

After a reset, vLLM forgets the jobs in flight.
The workers may still be copying into their rows.
So the rows stay reserved inside kvactors until the workers are done.
vLLM 0.33 says so with ``on_reset_flushed``, and on 0.32 a few steps stand in for it.
Only then are the jobs ended.
A store ends as failed, because it was never known to be complete, so it is never made ready.
A load is unpinned.
Plain code, with no vLLM import.

Threading: none of its own. It is called with the adapter's lock held.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from kvactors.integrations.vllm.requests import Request
from kvactors.manager import TieringManager
from kvactors.types import OffloadKey, ReqContext

Entry = tuple[str, OffloadKey, ReqContext, int]
"""``(kind, key, attempt, row)``: ``kind`` ``"store"`` or ``"load"`` (row -1)."""


def take_owed(req: Request) -> list[Entry]:
    """The stores and loads ``req`` still owes, taken from it (it owes nothing after)."""
    taken = req.take_owed()
    owed: list[Entry] = [("store", k, ctx, row) for k, stores in taken.stores.items() for ctx, row in stores]
    owed += [("load", k, ctx, -1) for k, ctxs in taken.loads.items() for ctx in ctxs]
    return owed


def stores_by_attempt(stores: Iterable[tuple[ReqContext, OffloadKey]]) -> list[tuple[ReqContext, list[OffloadKey]]]:
    """The ``complete_store`` calls that end ``stores``: by attempt, each key once a call.

    An attempt whose store of a key passed kvactors' deadline may store the key again.
    It then owes a completion of each write, and one call may not complete a key twice.
    """
    calls: dict[ReqContext, list[dict[OffloadKey, None]]] = defaultdict(list)
    for ctx, k in stores:
        for keys in calls[ctx]:
            if k not in keys:
                keys[k] = None
                break
        else:
            calls[ctx].append({k: None})
    return [(ctx, list(keys)) for ctx, of_ctx in calls.items() for keys in of_ctx]


class StaleJobs:
    """Owed completions held until the workers are done with their rows."""

    def __init__(self, tm: TieringManager, *, has_reset_fence: bool, flush_steps: int) -> None:
        self.tm = tm
        self._has_reset_fence = has_reset_fence
        self._flush_steps = flush_steps
        self._batches: list[tuple[str, list[Entry]]] = []
        self._steps: int | None = None  # step ends since the last reset, or None when nothing waits

    @property
    def waiting(self) -> bool:
        """Whether a reset's jobs are still held (vLLM's ``has_pending_work``)."""
        return self._steps is not None

    def add(self, label: str, entries: list[Entry]) -> None:
        """Hold ``entries`` until :meth:`release`, counting steps from now.

        ``label`` says what dropped them.
        """
        self._batches.append((label, entries))
        self._steps = 0

    def end_step(self) -> None:
        """Without the reset fence, the workers are taken to have flushed after a few steps."""
        if self._steps is not None:
            self._steps += 1
            if not self._has_reset_fence and self._steps >= self._flush_steps:
                self.release()

    def release(self) -> None:
        """End the held jobs inside kvactors, as the workers are done with them."""
        for _, entries in self._batches:
            loads: dict[ReqContext, list[OffloadKey]] = defaultdict(list)
            for kind, k, ctx, _row in entries:
                if kind == "load":
                    loads[ctx].append(k)
            for ctx, ks in stores_by_attempt((ctx, k) for kind, k, ctx, _row in entries if kind == "store"):
                self.tm.complete_store(ks, ctx, False)  # never known to be complete: not made ready
            for ctx, ks in loads.items():
                self.tm.complete_load(ks, ctx)
        self._batches = []
        self._steps = None
