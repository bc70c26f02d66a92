"""The facade's calls, written once: each checks its arguments and builds its message.

Both facades (:class:`~kvactors.TieringManager` and :class:`~kvactors.aio.AsyncTieringManager`)
build every message here.
So a call's checks and its message cannot drift apart between them.
The checks are :mod:`kvactors.core.arguments`'s.
A bad argument is a ``ValueError`` at the caller, and nothing is sent.
A blocking call is an :class:`Ask`.
It holds its message, the reply the primary answers it through,
and how its answer is undone when nobody takes it (an asyncio task cancelled while it waited).
A non-blocking call is its message alone.

Plain functions, with no state, safe from any thread.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

from kvactors.actors import messages as m
from kvactors.actors.reply import Reply
from kvactors.core.arguments import check_ctx, check_flag, check_request
from kvactors.core.counters import MetricsSnapshot
from kvactors.types import LoadStoreSpec, LookupResult, OffloadingEvent, OffloadKey, PrepareStoreOutput, ReqContext

T = TypeVar("T")


class Ask(Generic[T]):
    """A blocking call.

    ``message`` carries ``reply``.
    ``undo(answer)`` is the message that releases what the answer holds, for a caller that never took it.
    It is ``None`` when there is nothing to release.
    ``name`` names the call in errors and logs.
    """

    __slots__ = ("message", "name", "reply", "undo")

    def __init__(self, name: str, message: object, reply: Reply[T],
                 undo: Callable[[T], object | None] | None = None) -> None:
        self.name = name
        self.message = message
        self.reply = reply
        self.undo = undo


def lookup(keys: Iterable[OffloadKey], ctx: ReqContext) -> Ask[list[LookupResult]]:
    reply: Reply[list[LookupResult]] = Reply()
    return Ask("lookup", m.Lookup(*check_request(keys, ctx), reply), reply)


def prepare_load(keys: Iterable[OffloadKey], ctx: ReqContext) -> Ask[LoadStoreSpec]:
    keys_t, ctx = check_request(keys, ctx)
    reply: Reply[LoadStoreSpec] = Reply()
    return Ask("prepare_load", m.PrepareLoad(keys_t, ctx, reply), reply, lambda _: m.CompleteLoad(keys_t, ctx))


def prepare_store(keys: Iterable[OffloadKey], ctx: ReqContext) -> Ask[PrepareStoreOutput | None]:
    keys_t, ctx = check_request(keys, ctx)
    reply: Reply[PrepareStoreOutput | None] = Reply()

    def undo(out: PrepareStoreOutput | None) -> object | None:
        if out is None or not out.keys_to_store:
            return None
        return m.CompleteStore(tuple(out.keys_to_store), ctx, False)

    return Ask("prepare_store", m.PrepareStore(keys_t, ctx, reply), reply, undo)


def reset_cache() -> Ask[None]:
    reply: Reply[None] = Reply()
    return Ask("reset_cache", m.ResetCache(reply), reply)


def take_events() -> Ask[list[OffloadingEvent]]:
    """Its undo is the facade's.

    The events go back to the next call, not to the primary.
    """
    reply: Reply[list[OffloadingEvent]] = Reply()
    return Ask("take_events", m.TakeEvents(reply), reply)


def barrier() -> Ask[bool]:
    reply: Reply[bool] = Reply()
    return Ask("wait_idle", m.Barrier(reply), reply)


def stats() -> Ask[dict[str, int | float]]:
    reply: Reply[dict[str, int | float]] = Reply()
    return Ask("stats", m.QueryStats(reply), reply)


def metrics_snapshot() -> Ask[MetricsSnapshot]:
    reply: Reply[MetricsSnapshot] = Reply()
    return Ask("metrics_snapshot", m.QueryMetrics(reply), reply)


def complete_load(keys: Iterable[OffloadKey], ctx: ReqContext) -> m.CompleteLoad:
    return m.CompleteLoad(*check_request(keys, ctx))


def touch(keys: Iterable[OffloadKey], ctx: ReqContext) -> m.Touch:
    return m.Touch(*check_request(keys, ctx))


def complete_store(keys: Iterable[OffloadKey], ctx: ReqContext, success: bool = True) -> m.CompleteStore:
    return m.CompleteStore(*check_request(keys, ctx), check_flag(success, "success"))


def finish(ctx: ReqContext) -> m.FinishRequest:
    return m.FinishRequest(check_ctx(ctx))
