"""Per-request lifecycle state and the one finalize decision.

This module keeps the rule kvactors exists to keep (``docs/contract.md``).
A secondary tier may be told that a request is finished only when the request is finished
**and** nothing can still submit to that tier for it.
What can still submit, per request attempt, is counted here.

* ``pending_primary_stores`` counts the keys the request prepared in the primary pool
  and has not completed yet.
  Each successful completion cascades to the tiers.
* ``pending_lookups`` counts the secondary lookups in progress.
  Each of them may start promotions (``submit_load``) on the request's behalf.
* ``unsent_promotions`` counts the promotions decided or queued, not yet submitted.
* ``parked_cascades`` counts the cascades waiting for a tier slot, not yet submitted.

:meth:`LifecycleTable.maybe_finalize` is the only place that decides.
No threads, no I/O.
The supervisor actor owns one table and is its only caller.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvactors.core.errors import LifecycleError
from kvactors.types import ReqContext


class Pending(enum.StrEnum):
    """What a request attempt counts that can still submit to a tier (a ``str``: logged as its value)."""

    PRIMARY_STORES = "pending_primary_stores"
    LOOKUPS = "pending_lookups"
    UNSENT_PROMOTIONS = "unsent_promotions"
    PARKED_CASCADES = "parked_cascades"


COUNTERS: tuple[Pending, ...] = tuple(Pending)


class InvariantError(AssertionError):
    """The runtime's own bookkeeping went wrong (a counter below zero): a kvactors bug."""


@dataclass(slots=True)
class RequestState:
    """One request attempt, from ``on_new_request`` until it is finalized."""

    req_context: ReqContext
    pending: dict[Pending, int] = field(default_factory=lambda: dict.fromkeys(Pending, 0))
    """Each count, by what it counts; never below zero."""
    is_finished: bool = False

    @property
    def may_submit(self) -> bool:
        """Whether anything counted here can still submit to a tier for this request."""
        return any(self.pending.values())

    def counts(self) -> dict[str, int]:
        """The counts by their names (the log's fields)."""
        return {str(name): count for name, count in self.pending.items()}


class LifecycleTable:
    """Every live request attempt's :class:`RequestState`, keyed by ``(req_id, attempt)``."""

    __slots__ = ("_states",)

    def __init__(self) -> None:
        self._states: dict[tuple[str, int], RequestState] = {}

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, ctx: object) -> bool:
        return isinstance(ctx, ReqContext) and ctx.identity in self._states

    def get(self, ctx: ReqContext) -> RequestState | None:
        return self._states.get(ctx.identity)

    def states(self) -> list[RequestState]:
        return list(self._states.values())

    def start(self, ctx: ReqContext) -> RequestState:
        """A new request attempt. ``LifecycleError`` if that identity is live."""
        if ctx.identity in self._states:
            raise LifecycleError(f"request {ctx} is already active")
        state = RequestState(ctx)
        self._states[ctx.identity] = state
        return state

    def add(self, ctx: ReqContext, counter: Pending, delta: int) -> RequestState | None:
        """Change one count of a live request.

        Returns ``None`` if the request is not live.
        A counter never goes below zero, as that would mean an event was counted twice.
        Such a change raises :class:`InvariantError` without changing anything.
        """
        state = self._states.get(ctx.identity)
        if state is None:
            return None
        value = state.pending[counter] + delta
        if value < 0:
            raise InvariantError(f"{counter} of {ctx} would go to {value}")
        state.pending[counter] = value
        return state

    def finish(self, ctx: ReqContext) -> RequestState | None:
        """Mark finished (idempotent).

        Returns ``None`` if the request is not live.
        """
        state = self._states.get(ctx.identity)
        if state is not None:
            state.is_finished = True
        return state

    def maybe_finalize(self, ctx: ReqContext) -> RequestState | None:
        """The finalize decision: if the request is finished and nothing can still
        submit for it, forget it and return its last state (the caller then tells
        every secondary tier, once). Otherwise ``None`` and nothing changes."""
        state = self._states.get(ctx.identity)
        if state is None or not state.is_finished or state.may_submit:
            return None
        del self._states[ctx.identity]
        return state

    def reset(self) -> list[RequestState]:
        """Zero every request's counts and finalize the finished ones, for ``reset_cache``.

        Active requests keep their (zeroed) state and can go on.
        Returns the states finalized, in start order.
        """
        finalized = []
        for identity, state in list(self._states.items()):
            state.pending = dict.fromkeys(Pending, 0)
            if state.is_finished:
                del self._states[identity]
                finalized.append(state)
        return finalized

