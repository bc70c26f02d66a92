"""``TieringManager``: the thread-safe facade over the actors."""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

import torch

from kvactors import calls
from kvactors.actors import messages as m
from kvactors.actors.primary import PrimaryTier
from kvactors.actors.reply import Reply
from kvactors.actors.runtime import Actor, ActorRef, Runtime
from kvactors.actors.secondary import SecondaryTierActor
from kvactors.actors.supervisor import LifecycleSupervisor
from kvactors.core.admission import Admission, parse_admission
from kvactors.core.arguments import check_ctx, check_int, check_timeout
from kvactors.core.backpressure import default_max_queued_bytes
from kvactors.core.counters import MetricsSnapshot
from kvactors.core.policies import POLICIES
from kvactors.core.request_params import LOCALITIES, MEDIA
from kvactors.door import PrimaryDoor
from kvactors.logs import make_event_logger
from kvactors.primary_pool import allocate_pool, check_pool
from kvactors.tiers.base import SecondaryTier, hooks_of, inline_calls_of
from kvactors.types import (
    PRIMARY_TIER_NAME,
    LoadStoreSpec,
    LookupResult,
    OffloadingEvent,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
)

T = TypeVar("T")

_manager_ids = itertools.count()

STOP_GRACE_S = 0.5
"""How far past its budget ``stop()`` may run: the supervisor's last round, then the
actors' own stop (each phase gets at most this much)."""

ANSWER_SLACK_S = 10.0
"""A safety net, not the mechanism: every blocking call is answered by the actors
within its own deadline; a facade still waiting this long past the longest one
raises instead of hanging (the primary's thread is wedged: a bug, or a tier's
inline call that blocks). A caller that runs a tier's inline call itself (a claim)
is held by it as long as it blocks: a tier's inline calls must return at once
(:attr:`~kvactors.tiers.base.SecondaryTier.inline_calls`; one that took longer
than 0.25 s is never run inline again)."""


def _check_controls(tiers: Sequence[SecondaryTier], admission: Mapping[str, Any] | None,
                    max_queued_bytes: Mapping[str, int] | None, eviction: str,
                    pool_bytes: int) -> tuple[dict[str, Admission], dict[str, int]]:
    """``admission`` and ``max_queued_bytes`` checked (``ValueError``/``TypeError`` naming the
    tier), and completed with the defaults for every tier."""
    names = [tier.name for tier in tiers]
    parsed: dict[str, Admission] = {}
    limits: dict[str, int] = {}
    for what, given in (("admission", admission), ("max_queued_bytes", max_queued_bytes)):
        if given is None:
            continue
        if not isinstance(given, Mapping):
            raise TypeError(f"{what} must be a mapping of tier name to value, got {type(given).__name__}")
        unknown = [name for name in given if name not in names]
        if unknown:
            raise ValueError(f"{what}: no secondary tier named {unknown[0]!r} (tiers: {names})")
    for name in names:
        parsed[name] = parse_admission((admission or {}).get(name, "write_through"), f"admission[{name!r}]")
        if parsed[name].mode == "write_back" and eviction != "lru":
            raise ValueError(f"admission[{name!r}]: 'write_back' needs eviction='lru', got {eviction!r}")
        limit = (max_queued_bytes or {}).get(name)
        if limit is None:
            limit = default_max_queued_bytes(pool_bytes)
        elif not isinstance(limit, int) or isinstance(limit, bool):
            raise TypeError(f"max_queued_bytes[{name!r}] must be an int, got {type(limit).__name__}")
        elif limit < 0:
            raise ValueError(f"max_queued_bytes[{name!r}] must be >= 0, got {limit}")
        limits[name] = limit
    return parsed, limits


def _check_start(num_blocks: int, block_bytes: int, secondary_tiers: Sequence[SecondaryTier], eviction: str,
                 transfer_timeout_s: float, lookup_timeout_s: float, event_log: str | os.PathLike[str] | None,
                 pool: torch.Tensor | None) -> list[SecondaryTier]:
    """Check :meth:`TieringManager.start`'s arguments (``ValueError``, nothing built).

    Returns the tiers as a list.
    """
    check_int(num_blocks, "num_blocks")
    check_int(block_bytes, "block_bytes")
    if not isinstance(eviction, str) or eviction not in POLICIES:
        raise ValueError(f"unknown eviction policy {eviction!r}; choose one of {POLICIES}")
    check_timeout(transfer_timeout_s, "transfer_timeout_s", allow_none=False, allow_zero=False)
    check_timeout(lookup_timeout_s, "lookup_timeout_s", allow_none=False, allow_zero=False)
    if event_log is not None and (not isinstance(event_log, str | os.PathLike) or not os.fspath(event_log)):
        raise ValueError(f"event_log must be a path or None, got {event_log!r}")
    if isinstance(secondary_tiers, str | bytes) or not isinstance(secondary_tiers, Iterable):
        raise ValueError(f"secondary_tiers must be a sequence of SecondaryTier, "
                         f"got {type(secondary_tiers).__name__}")
    tiers = list(secondary_tiers)
    names = [PRIMARY_TIER_NAME]
    for tier in tiers:
        if not isinstance(tier, SecondaryTier):
            raise ValueError(f"secondary tiers must be SecondaryTier instances, got {type(tier).__name__}")
        if tier.name in names:
            raise ValueError(f"tier name {tier.name!r} is used twice (or is the primary's)")
        check_int(tier.max_inflight_jobs, f"tier {tier.name!r}: max_inflight_jobs")
        if tier.medium not in MEDIA or tier.locality not in LOCALITIES:
            raise ValueError(f"tier {tier.name!r}: medium must be one of {MEDIA} and locality one of "
                             f"{LOCALITIES}, got {tier.medium!r}, {tier.locality!r}")
        hooks_of(tier)
        inline_calls_of(tier)  # both raise ValueError here, before any tier is attached
        names.append(tier.name)
    if len(set(map(id, tiers))) != len(tiers):
        raise ValueError("a tier instance is given twice")
    if pool is not None:
        check_pool(pool, num_blocks, block_bytes)
    return tiers


class TieringManager:
    """Tiered KV-cache offloading: a primary CPU pool and secondary tiers.

    Threading: any number of threads may call any method at once.
    Calls from one thread take effect in the order they were made.
    A blocking call sees the effect of every earlier call from the same thread.
    Non-blocking calls (``complete_store``, ``complete_load``, ``touch``, ``on_request_finished``)
    return once their message is queued.
    Misuse found there is logged as a ``contract_violation`` event and counted in ``stats()``, never raised.

    Every call goes to the primary tier's actor first, as one message, whatever the number of keys.
    When the primary is idle (no handler running, nothing queued to it), the calling thread claims it
    and runs the handler itself.
    It then runs what was told to the primary's mailbox meanwhile, up to its own reply or 16 messages.
    That is what its call caused (the supervisor's part, the tiers' inline calls) and other senders' messages.
    It is still one handler at a time and in order, but with no thread hand-off.
    A lookup then waits only for the tiers that answer on their own threads.
    On the main thread a claim runs the call's own handler alone.
    Otherwise the message is queued to the primary's thread, with at most one round trip per blocking call.

    Every method (non-blocking ones too) checks its arguments at the caller, before anything is queued.
    A bad one is a ``ValueError`` and changes nothing.
    ``keys`` is an iterable of non-empty ``bytes`` (``b""`` is not a key).
    ``ctx`` is a :class:`ReqContext`, ``success`` a ``bool``, a timeout ``None`` or finite seconds ``>= 0``.

    Use :meth:`start` to create one.
    It is a context manager that stops on exit.
    """

    def __init__(self, *, runtime: Runtime, pool: torch.Tensor, door: PrimaryDoor, actors: Sequence[ActorRef],
                 sink: Any, tier_names: Sequence[str], transfer_timeout_s: float = 30.0) -> None:
        self._runtime = runtime
        self._transfer_timeout_s = float(transfer_timeout_s)
        self._pool = pool
        self._door = door
        self._log = door.log
        self._actors = list(actors)
        self._sink = sink
        self.tier_names = (PRIMARY_TIER_NAME, *tier_names)
        self._stopped = threading.Event()

    @classmethod
    def start(
        cls,
        *,
        num_blocks: int,
        block_bytes: int,
        secondary_tiers: Sequence[SecondaryTier] = (),
        eviction: str = "lru",
        transfer_timeout_s: float = 30.0,
        lookup_timeout_s: float = 5.0,
        event_log: str | os.PathLike[str] | None = None,
        runtime: Runtime | None = None,
        pool: torch.Tensor | None = None,
        admission: Mapping[str, Any] | None = None,
        max_queued_bytes: Mapping[str, int] | None = None,
    ) -> TieringManager:
        """Allocate the primary pool and start the actors.

        The pool has ``num_blocks`` rows of ``block_bytes`` bytes (pinned memory when CUDA is available).
        ``transfer_timeout_s`` is the deadline of every transfer.
        A primary store not completed, or a tier job not reported, in that time fails.
        ``lookup_timeout_s`` bounds how long a lookup waits for the secondary tiers.
        Keys they did not answer for are ``RETRY``.

        ``event_log`` is a file to append the lifecycle events to, as JSON lines.
        It defaults to the ``KVACTORS_EVENT_LOG`` environment variable, if set.

        ``runtime`` is where the actors run (default: pykka threads).

        ``pool`` is a caller-provided primary pool, e.g. a view of shared memory that another process copies into.
        It must be a contiguous CPU ``uint8`` tensor of shape ``(num_blocks, block_bytes)``.
        It is used as is, neither zeroed nor pinned.
        The caller keeps it alive and releases it after :meth:`stop`.
        The default is a new zeroed tensor.

        ``admission`` says, per secondary tier (by name), which ready blocks go to it.
        It is ``"write_through"`` (the default), ``{"min_seen": N}`` or ``"write_back"``.
        ``"write_back"`` needs ``eviction="lru"``.

        ``max_queued_bytes`` is, per tier, the bytes of cascades accepted and not yet reported,
        past which new cascades to it are dropped.
        The default is half the pool's bytes, at least 256 MiB.
        ``0`` drops every cascade.
        See docs/controls.md.

        Bad arguments raise ``ValueError``.
        Sizes must be ints ``> 0``, not ``True``, and timeouts finite numbers ``> 0``.
        A pool that cannot be allocated raises ``MemoryError`` naming ``num_blocks`` and ``block_bytes``.
        That is a pool larger than the machine's memory, or one the allocator refuses.
        Either way nothing is left running.
        """
        tiers = _check_start(num_blocks, block_bytes, secondary_tiers, eviction, transfer_timeout_s,
                             lookup_timeout_s, event_log, pool)
        admissions, limits = _check_controls(tiers, admission, max_queued_bytes, eviction, num_blocks * block_bytes)
        names = [PRIMARY_TIER_NAME, *(tier.name for tier in tiers)]

        manager_id = next(_manager_ids)
        if pool is None:
            pool = allocate_pool(num_blocks, block_bytes)
        log, sink = make_event_logger(event_log, manager=manager_id, pid=os.getpid())
        work_ids = itertools.count(1)

        # Refs come first, then the actors, each built whole with its peers' refs (the actors
        # refer to each other: primary and supervisor, supervisor and tiers), then the starts.
        if runtime is None:
            from kvactors.actors.threads import ThreadRuntime  # pykka only where threads run

            runtime = ThreadRuntime(f"kvactors-{manager_id}")  # its threads start with the first actor
        primary_ref = runtime.new_ref("primary")
        # One thread for both: the finalize path (completion -> primary -> supervisor -> tiers)
        # then waits for the GIL once less; the supervisor stays an actor of its own.
        supervisor_ref = runtime.new_ref("supervisor", colocate_with=primary_ref)
        tier_refs = [runtime.new_ref(f"tier-{tier.name}") for tier in tiers]
        door = PrimaryDoor(primary_ref, log=log,
                           answer_bound_s=max(float(transfer_timeout_s), float(lookup_timeout_s)) + ANSWER_SLACK_S)
        try:
            primary = PrimaryTier(supervisor=supervisor_ref, num_blocks=num_blocks, eviction=eviction,
                                  tier_names=names[1:], transfer_timeout_s=float(transfer_timeout_s),
                                  work_ids=work_ids, forget=door.forget, reserve_s=float(lookup_timeout_s),
                                  announce_starts=any("on_new_request" in hooks_of(tier) for tier in tiers),
                                  log=log, block_bytes=block_bytes, admission=admissions, max_queued_bytes=limits)
            # Last: attach() runs in here, once everything that could fail to allocate has been built.
            tier_actors = [SecondaryTierActor(tier, supervisor=supervisor_ref, pool=pool, log=log) for tier in tiers]
            supervisor = LifecycleSupervisor(
                primary=primary_ref,
                tiers=[actor.address(ref) for actor, ref in zip(tier_actors, tier_refs, strict=True)],
                transfer_timeout_s=float(transfer_timeout_s),
                lookup_timeout_s=float(lookup_timeout_s),
                log=log,
            )
        except BaseException:
            sink.close()
            raise
        # Threads start only now: nothing is told to an actor before every actor has started
        # (the manager is returned last).
        actors: list[tuple[ActorRef, Actor]] = [(primary_ref, primary), (supervisor_ref, supervisor),
                                                *zip(tier_refs, tier_actors, strict=True)]
        started: list[ActorRef] = []
        try:
            for ref, actor in actors:
                runtime.start(ref, actor)
                started.append(ref)
        except BaseException:
            runtime.stop(started, 5.0)
            sink.close()
            raise
        log.info("manager_started", num_blocks=num_blocks, block_bytes=block_bytes, tiers=",".join(names),
                 eviction=eviction, transfer_timeout_s=transfer_timeout_s)
        return cls(runtime=runtime, pool=pool, door=door, actors=started,
                   sink=sink, tier_names=names[1:], transfer_timeout_s=transfer_timeout_s)

    # ------------------------------------------------------------ plumbing

    @property
    def door(self) -> PrimaryDoor:
        """The door every call of this manager goes through (:class:`~kvactors.door.PrimaryDoor`):
        another facade over the same runtime (:class:`~kvactors.aio.AsyncTieringManager`) sends
        its calls through it too."""
        return self._door

    def _ask(self, ask: calls.Ask[T]) -> T:
        """Send a blocking call (following its handlers while claimed, up to its reply) and wait,
        at most ``answer_bound_s``, for the answer."""
        self._door.send(ask.message, until=ask.reply.done)
        bound = self._door.answer_bound_s
        if not self._runtime.wait(ask.reply, bound):
            self._log.error("call_unanswered", call=ask.name, waited_s=bound)
            raise TimeoutError(f"{ask.name}: no answer from the primary tier's actor in {bound:.1f} s "
                               "(its thread is wedged: a tier's inline call blocking?)")
        return ask.reply.result()

    # ------------------------------------------------------------ the API

    @property
    def pool(self) -> torch.Tensor:
        """The primary pool: ``uint8`` rows ``(num_blocks, block_bytes)``."""
        return self._pool

    def on_new_request(self, ctx: ReqContext) -> None:
        """First sight of a request attempt. ``LifecycleError`` if it is active
        (or finished and not yet finalized).

        Returns once the request is registered and its message queued, without
        a round trip to the primary: every later call, from any thread, is
        queued behind it and sees it.
        """
        self._door.register(check_ctx(ctx))

    def lookup(self, keys: Iterable[OffloadKey], ctx: ReqContext) -> list[LookupResult]:
        """One result per key. A key found only in a secondary tier starts its
        promotion (at most one per key, on behalf of ``ctx``) and answers
        ``HIT_PENDING``. A promotion the pool has no row for now (every row pending,
        pinned, held or reserved) is not started: its key and the keys after it are
        ``MISS`` (the request computes them). Promoted blocks, and the ready ones
        before them, are reserved for ``ctx`` until its ``prepare_load`` of the key,
        its finish, a reset, or ``lookup_timeout_s`` (``kvactors.core.reservations``).
        ``LifecycleError`` if the request is unknown or finished."""
        return self._ask(calls.lookup(keys, ctx))

    def prepare_load(self, keys: Iterable[OffloadKey], ctx: ReqContext) -> LoadStoreSpec:
        """Pin the rows of ready ``keys`` until :meth:`complete_load`.

        ``LifecycleError`` (nothing pinned) if a key is not ready or the request
        is unknown or finished."""
        return self._ask(calls.prepare_load(keys, ctx))

    def complete_load(self, keys: Iterable[OffloadKey], ctx: ReqContext) -> None:
        """Unpin what :meth:`prepare_load` pinned: one pin per key given, each
        released once, on the row it was taken on. Non-blocking.

        A request whose pins of one key lie on two rows (it pinned the key, a
        :meth:`reset_cache` detached that row, and it pinned the key's new row)
        cannot say which copy ended: both rows stay pinned until its last
        ``complete_load`` of that key, so no row is reused while a copy may
        still read it. A release with no pin left is a ``contract_violation``
        (counted, nothing changes)."""
        self._door.send(calls.complete_load(keys, ctx))

    def touch(self, keys: Iterable[OffloadKey], ctx: ReqContext) -> None:
        """Recency hint, passed on to every tier. Non-blocking."""
        self._door.send(calls.touch(keys, ctx))

    def prepare_store(self, keys: Iterable[OffloadKey], ctx: ReqContext) -> PrepareStoreOutput | None:
        """Allocate not-ready rows for the keys not present (evicting if needed).

        Duplicates are stored once.
        The keys left out as present are never evicted by this call.
        Returns ``None`` (nothing changes) if there is no room without evicting them.
        The rows are protected until :meth:`complete_store`, or until ``transfer_timeout_s`` passes.
        Raises ``LifecycleError`` if the request is unknown or finished.
        """
        return self._ask(calls.prepare_store(keys, ctx))

    def complete_store(self, keys: Iterable[OffloadKey], ctx: ReqContext, success: bool = True) -> None:
        """The copy into the prepared rows ended.

        Success makes the blocks ready and cascades them to every secondary tier.
        Failure removes them.
        Either way the store is no longer pending.
        Non-blocking.
        """
        self._door.send(calls.complete_store(keys, ctx, success))

    def on_request_finished(self, ctx: ReqContext) -> None:
        """No more submit calls for this attempt. Idempotent. Non-blocking.

        The primary tier is told at once.
        Each secondary tier is told once nothing can still submit to it for this request.
        A finish for a request the runtime does not know (never started, or finalized already)
        does nothing and is not a contract violation.
        After finalize nothing of a request is kept, so it cannot be told from a repeated finish,
        which is legal.
        """
        self._door.send(calls.finish(ctx))

    def reset_cache(self) -> None:
        """Drain in-flight jobs, zero every request's pending counts, finalize
        the finished requests, keep the active ones, clear the primary pool.
        Secondary tiers keep their data."""
        self._ask(calls.reset_cache())

    def take_events(self) -> list[OffloadingEvent]:
        """Blocks stored or removed since the last call: the primary's, then each tier's."""
        return self._ask(calls.take_events())

    def wait_idle(self, timeout: float | None = None) -> bool:
        """True once every call made before it, every job those calls started and
        every tier hook they caused has been processed and reported. Stores
        prepared but not completed by the caller do not hold it. ``timeout``:
        ``None`` or finite seconds ``>= 0`` (else ``ValueError``). A tier stuck in a
        call holds it until the tier moves again: with ``timeout=None`` that may be
        for ever, so callers that must not wait unboundedly pass a timeout."""
        timeout = check_timeout(timeout, "timeout")
        ask = calls.barrier()
        self._door.send(ask.message)
        return self._runtime.wait(ask.reply, timeout) and ask.reply.result()

    def stats(self) -> dict[str, int | float]:
        """Counters: ``active_requests``, ``blocks_ready``, ``blocks_pending``,
        ``blocks_pinned``, ``jobs_in_flight``, ``contract_violations`` and more.

        The dict of a :class:`~kvactors.core.snapshot.StatsSnapshot` (docs/metrics.md lists every key).
        :meth:`metrics_snapshot` carries the snapshot itself, typed, as ``figures``."""
        return self._ask(calls.stats())

    def metrics_snapshot(self) -> MetricsSnapshot:
        """Every counter and gauge :mod:`kvactors.metrics` shows, ``stats()`` included,
        in one round trip (a :class:`~kvactors.core.counters.MetricsSnapshot`)."""
        return self._ask(calls.metrics_snapshot())

    def stop(self, timeout: float | None = None) -> None:
        """Drain in-flight jobs (each ends by its deadline at the latest), finalize
        nothing that is not finished, shut the tiers down and stop every actor.

        Returns within its budget, ``timeout`` or else ``transfer_timeout_s``, plus
        at most ``2 * STOP_GRACE_S``: jobs still in flight then fail, and a tier
        stuck in a call is not waited for. An actor that did not stop is left
        behind (its thread is a daemon: it never holds up the interpreter's exit)
        and named in an ``actor_abandoned`` warning. Safe to call twice, and from
        several threads. Later calls of any other method raise
        :class:`ManagerStoppedError`.
        """
        timeout = check_timeout(timeout, "timeout")
        budget = self._transfer_timeout_s if timeout is None else float(timeout)
        reply: Reply[None] = Reply()
        if not self._door.close(m.Shutdown(reply, budget)):
            self._stopped.wait(None if timeout is None else timeout + 2 * STOP_GRACE_S)
            return
        started = time.monotonic()
        if not self._runtime.wait(reply, budget + STOP_GRACE_S):
            self._log.warning("stop_timed_out", waited_s=round(time.monotonic() - started, 3), budget_s=budget)
        left = self._runtime.stop(self._actors, STOP_GRACE_S)
        for name in left:
            self._log.warning("actor_abandoned", actor=name)
        # The last event: a log checker knows every actor's events are in before it
        # (but those of an actor left behind).
        self._log.info("manager_stopped", abandoned=",".join(left))
        self._sink.close()
        self._stopped.set()

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    def __enter__(self) -> TieringManager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "stopped" if self._door.closed else "running"
        return f"TieringManager(tiers={self.tier_names}, blocks={self._pool.shape[0]}, {state})"
