"""The simulated serving frontend: threads driving a real ``TieringManager`` + ``TransferEngine``.

Each frontend thread serves one turn (a request) at a time, as a serving engine's scheduler and workers would.

1. ``on_new_request(ctx)``, then ``lookup`` of the prompt's keys.
   Some keys answer ``HIT_PENDING``, because they are being promoted from disk/Redis or stored by another request.
   They are looked up again every 2 ms until they are ready or ``pending_wait_s`` passes.
   The request is deferred meanwhile, as vLLM defers it.
   The prefix is the leading run of ``HIT`` keys.
2. ``onboard`` the prefix into the thread's device rows.
   Every onboarded row is checked byte for byte against what its key must hold.
   A key may be evicted between the lookup and ``prepare_load``.
   That raises ``LifecycleError``, the contract's answer to a load of a key not ready.
   It is a *load race*, and the thread looks up again.
3. "Compute" the rest, by writing the key's deterministic bytes into the device rows.
   Then ``offload`` it in chunks, with several copies in flight at once.
4. ``on_request_finished(ctx)`` right after the last offload is submitted,
   while copies are still in flight, as the contract allows.
   Then wait for the offload futures before the rows are reused.

Some attempts are preempted.
Such an attempt finishes with offloads in flight.
Then the same ``req_id`` comes back with ``attempt + 1`` and does the turn again.
Some attempts are aborted.
Such an attempt finishes right after the first lookup, with promotions possibly in flight.
Or it finishes after the compute, without offloading anything.

The device cache holds only the rows of the requests being served, one slab of rows per thread.
There is no device-side prefix cache.
So every reused block comes back from the CPU pool or a secondary tier.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future

import torch

from kvactors.commands.scratch import drop_redis_namespace, run_namespace
from kvactors.commands.simulate.config import SimConfig
from kvactors.commands.simulate.instrument import finalize_latencies, observe, unfinalized
from kvactors.commands.simulate.results import SimResult
from kvactors.commands.simulate.run_metrics import CPU, CPU_IN_FLIGHT, Metrics, Sampler
from kvactors.commands.simulate.traffic import BlockBytes, Turn, Workload
from kvactors.core.errors import LifecycleError, TransferError
from kvactors.manager import TieringManager
from kvactors.testing.recorder import TierRecord
from kvactors.tiers.base import SecondaryTier
from kvactors.tiers.disk import DiskTier
from kvactors.transfer import TransferEngine
from kvactors.types import LookupResult, OffloadKey, ReqContext

WAIT_S = 60.0
"""Longest wait for one future or for the runtime to become idle (a hang fails the run, it does not hang it)."""
POLL_S = 0.002

__all__ = ["POLL_S", "WAIT_S", "SimConfig", "SimResult", "Simulation"]


class Simulation:
    """One run: build the tiers, the manager and the engine, then serve, check and tear down.

    ``run()`` blocks until the run ends.
    ``tick``, if given, is called on the calling thread about every 0.1 s with the simulation, for a progress bar.
    ``stop()`` may be called from any thread, and ends the run early.
    No new turns start, and the turns in progress finish.
    """

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.metrics = Metrics()
        self.record = TierRecord()
        self.workload = Workload(seed=config.seed, block_bytes=config.block_bytes, shape=config.shape)
        self.blocks = BlockBytes(config.block_bytes, config.seed, config.device)
        self._stop = threading.Event()
        self._budget_lock = threading.Lock()
        self._turns_started = 0
        self._computed: dict[OffloadKey, float] = {}
        self._computed_lock = threading.Lock()
        self._t0 = 0.0
        self.interrupted = False
        self.redis_namespace = run_namespace("simulate")

    # ------------------------------------------------------------ set-up

    def _tiers(self) -> list[SecondaryTier]:
        cfg = self.config
        tiers: list[SecondaryTier] = [DiskTier(cfg.disk_dir, capacity_bytes=cfg.disk_bytes)]
        if cfg.redis_url:
            from kvactors.tiers.redis import RedisTier

            tiers.append(RedisTier(cfg.redis_url, namespace=self.redis_namespace, capacity_bytes=cfg.redis_bytes))
        return tiers

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self._t0 if self._t0 else 0.0

    def stop(self) -> None:
        self._stop.set()

    def run(self, tick: Callable[[Simulation], None] | None = None) -> SimResult:
        cfg = self.config
        inner = self._tiers()
        tiers = observe(inner, self.record)
        tier_names = [t.name for t in tiers]
        rows = cfg.shape.max_request_blocks
        device_cache = torch.zeros((cfg.threads * rows, cfg.block_bytes), dtype=torch.uint8, device=cfg.device)
        manager = TieringManager.start(num_blocks=cfg.cpu_blocks, block_bytes=cfg.block_bytes, secondary_tiers=tiers,
                                       transfer_timeout_s=cfg.transfer_timeout_s, event_log=cfg.event_log)
        try:
            engine = TransferEngine(manager, device_cache)
            self.manager, self.engine = manager, engine
            sampler = Sampler(self.metrics, cfg.sample_interval_s)
            workers = [threading.Thread(target=self._worker, args=(i, list(range(i * rows, (i + 1) * rows))),
                                        name=f"kvactors-simulate-frontend-{i}", daemon=True)
                       for i in range(cfg.threads)]
            self._t0 = time.monotonic()
            sampler.start()
            for w in workers:
                w.start()
            try:
                for w in workers:
                    while w.is_alive():
                        w.join(0.1)
                        if tick is not None:
                            tick(self)
            except KeyboardInterrupt:  # Ctrl-C: let the turns in progress finish (bounded), then stop cleanly
                self._stop.set()
                self.interrupted = True
                deadline = time.monotonic() + WAIT_S
                for w in workers:
                    w.join(max(deadline - time.monotonic(), 0.0))
            seconds = time.monotonic() - self._t0
            sampler.stop()
            engine.close()
            idle = manager.wait_idle(WAIT_S)
            stats = manager.stats()
        finally:
            manager.stop(WAIT_S)
            if cfg.redis_url:
                drop_redis_namespace(cfg.redis_url, self.redis_namespace)
        found = self.record.violations
        violations = int(stats["contract_violations"]) + int(stats["internal_errors"]) + len(found)
        leaks, leak_notes = self._leaks(stats, tier_names, idle)
        finalize_ms = finalize_latencies(self.record, self.metrics.frontend_done, tier_names)
        return SimResult(
            config=cfg, tiers=tier_names, seconds=seconds, counts=self.metrics.counts, hits=self.metrics.hits,
            finalize_ms=finalize_ms, violations=violations, violation_notes=found[:10],
            leaks=leaks, leak_notes=leak_notes, stats=stats, promotions=dict(self.record.promotions),
            cascaded=dict(self.record.cascaded_blocks),
            samples=sampler.samples, errors=self.metrics.errors, mismatch_notes=self.metrics.mismatch_notes,
            conversations=self.workload.conversations_started, interrupted=self.interrupted,
        )

    # ------------------------------------------------------------ checks

    def _leaks(self, stats: dict[str, int | float], tiers: list[str], idle: bool) -> tuple[int, list[str]]:
        notes = []
        leaks = 0
        if not idle:
            notes.append(f"the runtime was not idle {WAIT_S:.0f} s after the last request")
        for name in ("active_requests", "requests_finished_pending", "blocks_pending", "blocks_pinned",
                     "jobs_in_flight", "jobs_queued", "lookups_in_flight"):
            value = int(stats.get(name, 0))
            if value:
                leaks += value
                notes.append(f"{name} = {value}")
        missing = unfinalized(self.record, list(self.metrics.frontend_done), tiers)
        if missing:
            leaks += missing
            notes.append(f"{missing} (request, tier) pairs never got on_request_finished")
        return leaks, notes

    # ------------------------------------------------------------ the frontend

    def _claim_turn(self) -> bool:
        cfg = self.config
        with self._budget_lock:
            if self._stop.is_set():
                return False
            if cfg.seconds is not None and self.elapsed >= cfg.seconds:
                self._stop.set()
                return False
            if cfg.requests is not None and self._turns_started >= cfg.requests:
                return False
            self._turns_started += 1
            return True

    def _unclaim_turn(self) -> None:
        with self._budget_lock:
            self._turns_started -= 1

    def _worker(self, index: int, rows: list[int]) -> None:
        while self._claim_turn():
            got = self.workload.next_turn()
            if got is None:
                self._unclaim_turn()
                time.sleep(POLL_S)
                continue
            conv, turn = got
            completed = False
            try:
                completed = self._serve(turn, rows)
            except Exception as exc:
                self.metrics.error(f"{turn.req_id}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            finally:
                self.metrics.add(turns=1, completed=int(completed))
                self.workload.turn_done(conv, turn, completed=completed)

    def _choose(self, attempt: int) -> str:
        cfg = self.config
        r = self.workload.random()
        if r < cfg.abort_p / 2:
            return "abort_early"
        if r < cfg.abort_p:
            return "abort_late"
        if r < cfg.abort_p + cfg.preempt_p and attempt < 2:
            return "preempt"
        return "finish"

    def _serve(self, turn: Turn, rows: list[int]) -> bool:
        """Serve one turn, with its preempted attempts. True if it completed (not aborted)."""
        attempt = 0
        carried: tuple[ReqContext, float, list[Future[list[OffloadKey]]]] | None = None
        keys = turn.keys
        loaded: list[tuple[list[OffloadKey], list[LookupResult]]] = []
        try:
            while True:
                ctx = ReqContext(turn.req_id, attempt)
                self.manager.on_new_request(ctx)
                self.metrics.add(attempts=1)
                action = self._choose(attempt)
                first = self.manager.lookup(turn.prompt_keys, ctx)
                if action == "abort_early":  # promotions this lookup started may still be in flight
                    self._finish(ctx, [])
                    self.metrics.add(aborts=1)
                    return False
                self.metrics.add(keys_looked_up=len(turn.prompt_keys))
                # The rows are the previous attempt's until its offloads resolved.
                if carried:
                    self._settle(*carried)
                    carried = None
                n = self._onboard_prefix(ctx, turn.prompt_keys, first, rows)
                loaded.append((turn.prompt_keys[:n], first))
                for i in range(n, len(keys)):
                    self.blocks.write(self.engine.device_cache[rows[i]], keys[i])
                if action == "abort_late":
                    self._finish(ctx, [])
                    self.metrics.add(aborts=1)
                    return False
                step = self.config.offload_chunk
                chunks = [(keys[i:i + step], rows[i:min(i + step, len(keys))]) for i in range(n, len(keys), step)]
                if action == "preempt":
                    chunks = chunks[: len(chunks) // 2]
                t0 = time.monotonic()
                futures = []
                for k, r in chunks:
                    fut = self.engine.offload(ctx, k, r)
                    fut.add_done_callback(self._note_stored(t0))
                    futures.append(fut)
                finish_time = self._finish(ctx, futures)
                if action == "preempt":
                    self.metrics.add(preemptions=1)
                    carried = (ctx, finish_time, futures)
                    attempt += 1
                    continue
                self._settle(ctx, finish_time, futures)
                return True
        finally:
            if carried:
                self._settle(*carried)
            # Attributed last, so that concurrent stores have been noted (see _attribute).
            for prefix, first in loaded:
                self._attribute(prefix, first)

    def _finish(self, ctx: ReqContext, futures: list[Future[list[OffloadKey]]]) -> float:
        now = time.monotonic()
        self.manager.on_request_finished(ctx)
        if not futures:
            self.metrics.done(ctx, now)
        return now

    def _settle(self, ctx: ReqContext, finish_time: float, futures: list[Future[list[OffloadKey]]]) -> None:
        """Wait for an attempt's offloads.

        Note when the frontend was done with it.
        """
        resolved = [finish_time]
        stored = 0
        for fut in futures:
            try:
                stored += len(fut.result(WAIT_S))
            except TransferError as exc:
                self.metrics.add(transfer_errors=1)
                self.metrics.error(f"{ctx}: offload failed: {exc}")
            # The done callback stamps the moment the future resolved; it runs just after
            # waiters wake, so if it has not run yet, that moment is now.
            resolved.append(getattr(fut, "resolved_at", time.monotonic()))
        self.metrics.done(ctx, max(resolved))
        self.metrics.add(bytes_offloaded=stored * self.config.block_bytes, blocks_offloaded=stored)

    def _settled_lookup(self, ctx: ReqContext, keys: list[OffloadKey], results: list[LookupResult]) -> int:
        """Look up again while the first non-HIT key is HIT_PENDING.

        Returns the length of the HIT prefix.
        """
        deadline = time.monotonic() + self.config.pending_wait_s
        n = base = 0  # results[j] answers keys[base + j]
        while True:
            while n < len(keys) and results[n - base] == LookupResult.HIT:
                n += 1
            if n == len(keys):
                return n
            state = results[n - base]
            if state == LookupResult.RETRY:
                self.metrics.add(lookup_retries=1)
                return n
            if state != LookupResult.HIT_PENDING:
                return n
            if time.monotonic() > deadline:
                self.metrics.add(pending_timeouts=1)
                return n
            time.sleep(POLL_S)
            base = n
            results = self.manager.lookup(keys[n:], ctx)

    def _onboard_prefix(self, ctx: ReqContext, keys: list[OffloadKey], first: list[LookupResult],
                        rows: list[int]) -> int:
        """Onboard the ready prefix into ``rows``, and check it.

        Returns its length, 0 if there is none.
        """
        results = first
        for _ in range(3):
            n = self._settled_lookup(ctx, keys, results)
            if n == 0:
                return 0
            try:
                self.engine.onboard(ctx, keys[:n], rows[:n]).result(WAIT_S)
            except LifecycleError:  # a key was evicted after the lookup: not ready any more
                self.metrics.add(load_races=1)
                results = self.manager.lookup(keys, ctx)
                continue
            except TransferError as exc:
                self.metrics.add(transfer_errors=1)
                self.metrics.error(f"{ctx}: onboard failed: {exc}")
                return 0
            cache = self.engine.device_cache
            for i in range(n):
                if not self.blocks.matches(cache[rows[i]], keys[i]):
                    self.metrics.mismatch(f"{ctx}: block {i} ({keys[i].hex()}) onboarded into device row "
                                          f"{rows[i]} does not hold its key's bytes")
            self.metrics.add(bytes_onboarded=n * self.config.block_bytes, blocks_onboarded=n)
            return n
        return 0

    def _attribute(self, keys: list[OffloadKey], first: list[LookupResult]) -> None:
        """Count each loaded key under the tier it came from (see ``kvactors.commands.simulate.run_metrics``)."""
        by: Counter[str] = Counter()
        for key, state in zip(keys, first, strict=False):
            if state == LookupResult.HIT:
                by[CPU] += 1
                continue
            promo = self.record.promotion_of(key)
            with self._computed_lock:
                computed = self._computed.get(key, -1.0)
            by[promo[0] if promo is not None and promo[1] > computed else CPU_IN_FLIGHT] += 1
        self.metrics.add_hits(by)

    def _note_stored(self, t0: float) -> Callable[[Future[list[OffloadKey]]], None]:
        def callback(fut: Future[list[OffloadKey]]) -> None:
            fut.resolved_at = time.monotonic()  # type: ignore[attr-defined]
            if fut.exception() is None and fut.result():
                with self._computed_lock:
                    for key in fut.result():
                        self._computed[key] = t0
        return callback
