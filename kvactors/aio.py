"""``AsyncTieringManager``: a :class:`~kvactors.TieringManager` for asyncio frontends.

It has a coroutine per blocking call, and a plain method per non-blocking one.
There is no thread per call and no thread pool.
A call puts its message exactly as the blocking manager does,
claiming the idle primary or queueing to its thread.
Its answer comes back to the loop through the loop's ``call_soon_threadsafe``.
The actor that sets the call's :class:`~kvactors.actors.reply.Reply` calls it
(:meth:`Reply.add_done_callback`).
A call the primary answers on the spot returns without suspending.
That is a claim that needed no other actor.

Every call is the blocking manager's (:mod:`kvactors.calls`), with the same checks, errors and message.
It is sent through the same door (:class:`~kvactors.door.PrimaryDoor`).
A coroutine then awaits its reply instead of waiting for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from kvactors import calls
from kvactors.actors.reply import Reply
from kvactors.actors.runtime import alone
from kvactors.core.arguments import check_ctx, check_flag, check_timeout
from kvactors.core.counters import MetricsSnapshot
from kvactors.core.errors import ManagerStoppedError
from kvactors.manager import STOP_GRACE_S, TieringManager
from kvactors.types import (
    LoadStoreSpec,
    LookupResult,
    OffloadingEvent,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
)

T = TypeVar("T")

__all__ = ["AsyncTieringManager"]


_Undo = Callable[[Any], None] | None


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    """Set ``future``'s result, on its loop.

    Nothing is set if its awaiting task gave up on it.
    """
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(None)


class _Inbox:
    """Answers on their way to one loop, from any thread.

    There is one ``call_soon_threadsafe`` per burst, as a drain already scheduled takes what arrives meanwhile.
    At most :attr:`CHUNK` answers are handed to their coroutines per turn of the loop.
    The primary answers a whole batch at once.
    Without the bound, such a burst would wake every waiting coroutine in one turn.
    The loop's timers and other tasks would then wait for all of them.
    """

    CHUNK = 16

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._items: deque[tuple[asyncio.Future[Any], Reply[Any], _Undo]] = deque()
        self._lock = threading.Lock()
        self._scheduled = False

    def post(self, future: asyncio.Future[Any], reply: Reply[Any], undo: _Undo) -> None:
        """Called on the thread that set ``reply``."""
        with self._lock:
            self._items.append((future, reply, undo))
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed: nobody will take the answers
            with self._lock:
                items, self._items = list(self._items), deque()
            for _, done, undo_it in items:
                if undo_it is not None and done.exception() is None:
                    self._undo(undo_it, done.result(), report=False)

    def _drain(self) -> None:
        """Hand over up to CHUNK answers, and the rest on the next turn. Runs on the loop's thread."""
        items = self._items
        for _ in range(self.CHUNK):
            try:
                future, done, undo = items.popleft()
            except IndexError:
                break
            error = done.exception()
            if future.cancelled():
                if error is None and undo is not None:
                    self._undo(undo, done.result())
            elif error is not None:
                future.set_exception(error)
            else:
                future.set_result(done.result())
        with self._lock:
            if not items:
                self._scheduled = False
                return
        self.loop.call_soon(self._drain)

    def _undo(self, undo: Callable[[Any], None], value: Any, *, report: bool = True) -> None:
        """Undo a cancelled call's answer.

        It never raises, so that the answers behind it are still handed over.
        After a stop there is nothing left to undo, as the stop released it.
        """
        try:
            undo(value)
        except ManagerStoppedError:
            pass
        except Exception as exc:
            if report:
                self.loop.call_exception_handler({"message": "kvactors: undoing a cancelled call failed",
                                                  "exception": exc})


class AsyncTieringManager:
    """A started :class:`~kvactors.TieringManager`, for code on an asyncio event loop.

    The coroutines have the same names, arguments, results and errors as the blocking methods.
    They are :meth:`on_new_request`, :meth:`lookup`, :meth:`prepare_load`, :meth:`prepare_store`,
    :meth:`reset_cache`, :meth:`take_events`, :meth:`wait_idle`, :meth:`stats`, :meth:`metrics_snapshot`
    and :meth:`stop`.
    The plain methods are :meth:`complete_load`, :meth:`complete_store`, :meth:`touch` and
    :meth:`on_request_finished`.

    Threading: the coroutines never block the loop's thread, whatever the tiers do.
    What runs on it is the put of the call's message.
    While the primary tier's actor is idle, the primary's handler for the message runs there too.
    That is a claim, as with the blocking manager: bounded work on the pool, never a tier call.
    ``claims=False`` queues every message to the primary's thread instead.
    Calls from one task take effect in the order they were made.
    Each is put before the coroutine first suspends.
    The manager may be built outside a running loop.
    It serves one loop at a time, as each call answers on the loop it was awaited on.
    The blocking manager stays usable from other threads meanwhile.

    Cancellation: a task cancelled while it awaits a call leaves nothing behind.
    The call's message is already sent, so its answer is undone when it arrives.

    * ``prepare_load``'s pins are released (``complete_load``).
    * ``prepare_store``'s rows are completed with ``success=False``.
    * The events ``take_events`` took are returned by the next ``take_events``.

    The request itself is untouched, and it can go on or be finished.

    ``TransferEngine``'s futures are ``concurrent.futures.Future``.
    Await them with ``asyncio.wrap_future(engine.offload(...))``.
    Note that ``offload`` and ``onboard`` make their ``prepare_*`` call on the calling thread.
    """

    def __init__(self, manager: TieringManager, *, claims: bool = True) -> None:
        if not isinstance(manager, TieringManager):
            raise ValueError(f"expected a TieringManager, got {type(manager).__name__}")
        self.manager = manager
        self._claims = check_flag(claims, "claims")
        self._orphan_events: list[OffloadingEvent] = []
        self._inbox: _Inbox | None = None
        self._stop_lock = threading.Lock()
        self._stop_thread: threading.Thread | None = None
        self._stop_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._stop_ended = False

    # ------------------------------------------------------------ the bridge

    def _send(self, message: object) -> None:
        """Put ``message`` as the blocking manager does, claiming the idle primary unless ``claims=False``.

        But a claim runs this message's handler only.
        What it causes (the supervisor's part, the tiers' calls) goes to the primary's thread, never to the loop's.
        """
        self.manager.door.send(message, claim=self._claims, until=alone)

    async def _call(self, ask: calls.Ask[T]) -> T:
        """Send ``ask`` and await its answer.

        A cancelled caller's answer is undone (``ask.undo``).
        """
        self._send(ask.message)
        undo = ask.undo
        if undo is None:
            return await self._await(ask.reply, call=ask.name)

        def release(answer: T) -> None:
            message = undo(answer)
            if message is not None:
                with contextlib.suppress(ManagerStoppedError):  # stopped: the stop released it
                    self._send(message)

        return await self._await(ask.reply, release, call=ask.name)

    def _inbox_of(self, loop: asyncio.AbstractEventLoop) -> _Inbox:
        inbox = self._inbox
        if inbox is None or inbox.loop is not loop:
            inbox = self._inbox = _Inbox(loop)
        return inbox

    async def _await(self, reply: Reply[T], undo: Callable[[T], None] | None = None, *,
                     call: str | None = None) -> T:
        """The answer of ``reply``, awaited on the running loop.

        ``undo(answer)`` runs, on the loop's thread, if the awaiting task was cancelled before it got the answer.
        With ``call``, the wait is bounded as the blocking manager's calls are.
        No answer long past every deadline (a wedged primary thread) is a ``TimeoutError``.
        An answer that comes after that is undone, as for a cancelled task.
        """
        if reply.done():
            return reply.result()
        inbox = self._inbox_of(asyncio.get_running_loop())
        future: asyncio.Future[T] = inbox.loop.create_future()
        reply.add_done_callback(lambda done: inbox.post(future, done, undo))
        try:
            if call is None:
                return await future
            bound = self.manager.door.answer_bound_s
            try:
                return await asyncio.wait_for(future, bound)
            except TimeoutError:
                self.manager.door.log.error("call_unanswered", call=call, waited_s=bound)
                raise TimeoutError(f"{call}: no answer from the primary tier's actor in {bound:.1f} s") from None
        except asyncio.CancelledError:
            # Cancelled after the answer was delivered but before this task resumed.
            if undo is not None and future.done() and not future.cancelled() and future.exception() is None:
                undo(future.result())
            raise

    # ------------------------------------------------------------ coroutines

    async def on_new_request(self, ctx: ReqContext) -> None:
        """As :meth:`TieringManager.on_new_request`.

        It never suspends, and returns once queued.
        """
        self.manager.door.register(check_ctx(ctx), claim=self._claims, until=alone)

    async def lookup(self, keys: Iterable[OffloadKey], ctx: ReqContext) -> list[LookupResult]:
        """As :meth:`TieringManager.lookup`."""
        return await self._call(calls.lookup(keys, ctx))

    async def prepare_load(self, keys: Iterable[OffloadKey], ctx: ReqContext) -> LoadStoreSpec:
        """As :meth:`TieringManager.prepare_load`.

        If it is cancelled, its pins are released.
        """
        return await self._call(calls.prepare_load(keys, ctx))

    async def prepare_store(self, keys: Iterable[OffloadKey], ctx: ReqContext) -> PrepareStoreOutput | None:
        """As :meth:`TieringManager.prepare_store`.

        If it is cancelled, its rows are completed as failed.
        """
        return await self._call(calls.prepare_store(keys, ctx))

    async def reset_cache(self) -> None:
        """As :meth:`TieringManager.reset_cache` (a cancelled reset still happens)."""
        await self._call(calls.reset_cache())

    async def take_events(self) -> list[OffloadingEvent]:
        """As :meth:`TieringManager.take_events`.

        Events taken by a cancelled call come first.
        """
        ask = calls.take_events()
        self._send(ask.message)
        # The undo keeps a cancelled call's events in the one list, for the next call.
        orphans = self._orphan_events
        events = await self._await(ask.reply, orphans.extend, call=ask.name)
        if orphans:
            events = [*orphans, *events]
            orphans.clear()
        return events

    async def wait_idle(self, timeout: float | None = None) -> bool:
        """As :meth:`TieringManager.wait_idle`.

        Returns False if ``timeout`` passed first.
        """
        timeout = check_timeout(timeout, "timeout")
        ask = calls.barrier()
        self._send(ask.message)
        try:
            return await asyncio.wait_for(self._await(ask.reply), timeout)
        except TimeoutError:
            return False

    async def stats(self) -> dict[str, int | float]:
        """As :meth:`TieringManager.stats`."""
        return await self._call(calls.stats())

    async def metrics_snapshot(self) -> MetricsSnapshot:
        """As :meth:`TieringManager.metrics_snapshot`."""
        return await self._call(calls.metrics_snapshot())

    async def stop(self, timeout: float | None = None) -> None:
        """As :meth:`TieringManager.stop`.

        Its last step joins the actors' threads.
        A tier stuck in a call may hold that up to ``timeout``.
        So the stop runs on one thread of its own, never on the loop's.
        The first call starts it.
        Every call, concurrent or later, awaits its end.
        That is one thread per wrapper, not per call.
        A later call with a ``timeout`` returns once that stop ended or ``timeout + 2 * STOP_GRACE_S`` passed,
        as the blocking one does.
        A cancelled stop still completes.
        """
        timeout = check_timeout(timeout, "timeout")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self._stop_lock:
            if self._stop_ended:
                return
            self._stop_waiters.append((loop, future))
            first = self._stop_thread is None
            if first:
                self._stop_thread = threading.Thread(target=self._run_stop, args=(timeout,),
                                                     name="kvactors-async-stop", daemon=True)
                self._stop_thread.start()
        if first or timeout is None:
            await future
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(future), timeout + 2 * STOP_GRACE_S)

    def _run_stop(self, timeout: float | None) -> None:
        """The stop thread.

        It runs the blocking stop, then sets every waiting call's future, on its loop.
        """
        error: BaseException | None = None
        try:
            self.manager.stop(timeout)
        except BaseException as exc:
            error = exc
        with self._stop_lock:
            self._stop_ended = True
            waiters, self._stop_waiters = self._stop_waiters, []
        for loop, future in waiters:
            with contextlib.suppress(RuntimeError):  # that loop is closed
                loop.call_soon_threadsafe(_settle, future, error)

    # ------------------------------------------------------------ non-blocking calls

    def complete_load(self, keys: Iterable[OffloadKey], ctx: ReqContext) -> None:
        """As :meth:`TieringManager.complete_load`."""
        self._send(calls.complete_load(keys, ctx))

    def touch(self, keys: Iterable[OffloadKey], ctx: ReqContext) -> None:
        """As :meth:`TieringManager.touch`."""
        self._send(calls.touch(keys, ctx))

    def complete_store(self, keys: Iterable[OffloadKey], ctx: ReqContext, success: bool = True) -> None:
        """As :meth:`TieringManager.complete_store`."""
        self._send(calls.complete_store(keys, ctx, success))

    def on_request_finished(self, ctx: ReqContext) -> None:
        """As :meth:`TieringManager.on_request_finished`."""
        self._send(calls.finish(ctx))

    def __repr__(self) -> str:
        return f"AsyncTieringManager({self.manager!r})"
