"""vLLM's requests as kvactors attempts: each ``req_id``'s current :class:`ReqContext`, its answers and pins.

Plain code over a :class:`~kvactors.TieringManager`, with no vLLM import.
A preempted or re-announced request finishes its attempt and starts the next one.
Each store or load remembers the attempt that prepared it.
So a completion that arrives late, even after the finish, completes the right one.

Threading: none of its own.
Every method is called with the adapter's lock held
(:class:`~kvactors.integrations.vllm.manager.KvactorsOffloadingManager`).
"""

from __future__ import annotations

import threading
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any

from kvactors.core.errors import LifecycleError
from kvactors.manager import TieringManager
from kvactors.types import LookupResult, OffloadKey, ReqContext

MAX_ATTEMPT_BUMPS = 64
"""How many identities a new attempt may skip that are still finishing inside kvactors."""


@dataclass
class LookupJob:
    """One batch lookup on the helper thread.

    It holds the keys asked, then its answers and the rows it pinned.
    """

    keys: tuple[OffloadKey, ...]
    ctx: ReqContext
    done: threading.Event = field(default_factory=threading.Event)
    answers: dict[OffloadKey, LookupResult] = field(default_factory=dict)
    pinned: dict[OffloadKey, int] = field(default_factory=dict)
    stale: bool = False


@dataclass
class Request:
    """One vLLM request: its current attempt and what that attempt (or an earlier one) still owes."""

    req_id: str
    ctx: ReqContext
    finished: bool = False
    answers: dict[OffloadKey, LookupResult] = field(default_factory=dict)
    pinned: dict[OffloadKey, int] = field(default_factory=dict)  # for ctx, not yet handed to vLLM
    pinned_since: float = 0.0  # when the oldest of those pins was taken
    job: LookupJob | None = None
    read: bool = False  # answers were read this step
    age: int = 0  # step ends since the answers arrived unread
    promoted: set[OffloadKey] = field(default_factory=set)  # keys that were HIT_PENDING for it
    unsure_since: float | None = None  # first not-final answer (HIT_PENDING / RETRY) since the last final one
    unsure_step: int = 0  # the scheduler step of unsure_since
    stores: dict[OffloadKey, tuple[ReqContext, int]] = field(default_factory=dict)  # key -> (attempt, row)
    loads: dict[OffloadKey, list[ReqContext]] = field(default_factory=dict)
    calls: int = 0  # prepare_load / prepare_store calls in the TieringManager (outside the lock) for it


class Requests:
    """The live requests by ``req_id``, and the attempt numbers of those still owing completions."""

    def __init__(self, tm: TieringManager, counters: MutableMapping[str, int]) -> None:
        self.tm = tm
        self.counters = counters
        self.by_id: dict[str, Request] = {}
        self.attempts: dict[str, int] = {}
        self.with_answers: set[str] = set()  # req_ids whose answers wait for the step's end

    def get(self, req_id: str) -> Request | None:
        return self.by_id.get(req_id)

    def start_attempt(self, req_id: str, params: Any) -> Request:
        """Register the next attempt of ``req_id`` with kvactors."""
        attempt = self.attempts.get(req_id, -1) + 1
        for _ in range(MAX_ATTEMPT_BUMPS):
            ctx = ReqContext(req_id, attempt, params if isinstance(params, dict) else None)
            try:
                self.tm.on_new_request(ctx)
                break
            except LifecycleError:
                attempt += 1  # that identity is still finishing inside kvactors
        else:
            raise LifecycleError(f"could not start a new attempt of request {req_id!r}")
        self.attempts[req_id] = attempt
        old = self.by_id.get(req_id)
        req = Request(req_id, ctx)
        if old is not None:  # completions still owed to the old attempt stay with it
            req.stores, req.loads = old.stores, old.loads
        self.by_id[req_id] = req
        return req

    def current(self, req_id: str, params: Any) -> Request:
        """The live attempt of ``req_id``, started now for a request vLLM never announced
        (or one used again after its finish)."""
        req = self.by_id.get(req_id)
        if req is None or req.finished:
            self.counters["untracked_requests"] += 1
            req = self.start_attempt(req_id, params)
        return req

    def finish_attempt(self, req: Request) -> None:
        """vLLM will submit nothing more for this attempt."""
        if req.finished:
            return
        req.finished = True
        self.drop_answers(req)
        if req.job is not None:
            req.job.stale = True
            req.job = None
        self.tm.on_request_finished(req.ctx)

    def forget_if_done(self, req: Request) -> None:
        """Forget a finished request that owes nothing (its attempt number too), unless a
        ``prepare_*`` call for it is still in the TieringManager (it records what it owes after)."""
        if (req.finished and not req.stores and not req.loads and not req.calls
                and self.by_id.get(req.req_id) is req):
            del self.by_id[req.req_id]
            self.attempts.pop(req.req_id, None)

    def restore_pins(self, req: Request, pins: dict[OffloadKey, int]) -> list[OffloadKey]:
        """Give ``req`` back the pins taken from it for a ``prepare_load`` that failed.

        Returns the keys whose pins to release instead.
        A pin is released instead when ``req`` finished or was replaced meanwhile.
        It is also released when the lookup thread posted a pin of the same key meanwhile.
        """
        live = not req.finished and self.by_id.get(req.req_id) is req
        release = [k for k in pins if not live or k in req.pinned]
        if live and len(release) < len(pins):
            req.pinned.update((k, row) for k, row in pins.items() if k not in req.pinned)
            self.with_answers.add(req.req_id)  # its pins are looked at again at the step's end
        return release

    def drop_answers(self, req: Request) -> None:
        """Release the request's unused pins and forget its answers."""
        if req.pinned:
            self.tm.complete_load(list(req.pinned), req.ctx)
            req.pinned = {}
        req.answers = {}
        req.read = False
        req.age = 0
        self.with_answers.discard(req.req_id)

    def end_step(self, now: float, hold_s: float) -> None:
        """Drop the answers read this step, at the step's end.

        Answers kept unread for one step already are dropped too.
        Their pins are kept, for ``hold_s`` at most.
        A request that vLLM could not schedule this step (no device blocks yet) still finds its blocks
        in the pool on the next one.
        It does not lose them to other requests' stores and have to promote them again.
        """
        for req_id in list(self.with_answers):
            req = self.by_id.get(req_id)
            if req is None:
                self.with_answers.discard(req_id)
                continue
            if req.pinned and now - req.pinned_since > hold_s:
                self.drop_answers(req)
            elif req.read or req.age >= 1:
                if req.pinned:
                    req.answers = {}
                    req.age = 0  # kept in with_answers: its pins are looked at again next step
                else:
                    self.drop_answers(req)
            else:
                req.age += 1  # arrived after this step's lookups: kept for the next step
            req.read = False
