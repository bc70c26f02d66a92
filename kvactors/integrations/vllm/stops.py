"""Stopping the scheduler side's kvactors manager however the engine process ends.

vLLM stops its engine core on SIGTERM/SIGINT through its own handler.
The handler sets a flag, and the busy loop ends.
``EngineCore.shutdown`` then reaches the connector, and so
:meth:`KvactorsOffloadingManager.shutdown <kvactors.integrations.vllm.manager.KvactorsOffloadingManager.shutdown>`.
That path has a deadline.
vLLM's frontend kills the engine core with SIGKILL once its ``--shutdown-timeout`` has passed,
after a grace of several seconds in which the workers exit.
With the default of 0 that happens at once, as vllm 0.32 sends SIGTERM and SIGKILL back to back.
So this module does two things.

* :func:`register` chains a handler in front of the process's SIGTERM and SIGINT handlers (main thread only).

  - The handler records that a stop signal came (:func:`signalled`).
    The manager then stops within :data:`SIGNAL_STOP_BUDGET_S` instead of its full
    ``transfer_timeout_s``-scale budget.
  - It then calls the handler that was there, vLLM's or Python's ``KeyboardInterrupt``.
    So the signal is never swallowed.
  - Nothing is raised into kvactors' actors.
    They run on their own threads, and a handler runs on the main thread.
  - Where no handler was installed (``SIG_DFL``), the process was about to die.
    An in-process engine in a script is such a case.
    The handler then puts ``SIG_DFL`` back at once, so that a second signal kills the process there and then.
    It wakes a helper thread that :func:`register` started.
    A handler starts and joins no thread, because the thread it interrupted may hold threading's own locks.
    It waits for the helper at most :data:`SIGNAL_STOP_BUDGET_S` plus a margin.
    The helper stops the managers, and then the process dies of the same signal.
  - A handler installed from C (``signal.getsignal`` answers ``None``) is left alone.

* It also stops every registered manager at the process's exit.
  That covers the case where the engine's own shutdown path did not get to it, because it raised before.
  It uses a ``multiprocessing`` finalizer with an ``exitpriority``.
  The finalizer runs in vLLM's engine core and worker processes, forked or spawned.
  It also runs in a plain interpreter, through the ``atexit`` hook that ``multiprocessing.util`` registers.

SIGKILL cannot be handled.
The shared pool's file is gone by then anyway (:mod:`kvactors.integrations.vllm.shm`).
The event log of a killed manager ends without ``manager_stopped``.
``kvactors check-log`` then says INCONCLUSIVE, which is the truth.
"""

from __future__ import annotations

import contextlib
import multiprocessing.util
import os
import signal
import threading
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any, Protocol

#: How long a manager's stop may take once a stop signal came (its jobs in flight then fail).
SIGNAL_STOP_BUDGET_S = 2.0
#: The margin on top for the actors to stop after the budget (``TieringManager.stop``'s grace).
_MARGIN_S = 2.0

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class _Stoppable(Protocol):
    def shutdown(self) -> None: ...


_managers: weakref.WeakSet[Any] = weakref.WeakSet()
_previous: dict[int, Any] = {}
_lock = threading.Lock()
_signalled = False
_exit_hooked_pid: int | None = None
# The helper that stops the managers when a stop signal nobody handles came: its process, the event
# that wakes it, the event it sets once they stopped, and the signal to die of.
_helper_pid: int | None = None
_wake = threading.Event()
_stopped = threading.Event()
_signum: int | None = None


def signalled() -> bool:
    """Whether this process got SIGTERM or SIGINT since :func:`register` hooked it."""
    return _signalled


def stop_all() -> None:
    """Stop every registered manager. Idempotent.

    A manager's own failure is not raised.
    """
    with _lock:
        managers = list(_managers)
    for manager in managers:
        with contextlib.suppress(Exception):
            manager.shutdown()


def _stop_then_die(wake: threading.Event, stopped: threading.Event) -> None:
    wake.wait()
    try:
        stop_all()  # each manager within stop_budget(): SIGNAL_STOP_BUDGET_S, signalled() being true
    finally:
        stopped.set()
        if _signum is not None:
            os.kill(os.getpid(), _signum)  # SIG_DFL again (the handler put it back): the process dies of it


def _start_helper() -> None:
    """The helper thread of this process.

    It is started once per process, and a forked child has none.
    """
    global _helper_pid, _wake, _stopped
    if _helper_pid == os.getpid():
        return
    wake, stopped = threading.Event(), threading.Event()  # fresh ones: a forked child's may be in any state
    threading.Thread(target=_stop_then_die, args=(wake, stopped), name="kvactors-vllm-stop", daemon=True).start()
    _wake, _stopped, _helper_pid = wake, stopped, os.getpid()


def _handler(signum: int, frame: FrameType | None) -> None:
    global _signalled, _signum
    _signalled = True
    previous = _previous.get(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)  # vLLM's own (sets its flag), or Python's KeyboardInterrupt
        return
    if previous == signal.SIG_IGN:
        return
    # Nobody handles it: the process dies of it now. A second one kills it at once.
    signal.signal(signum, signal.SIG_DFL)
    if _helper_pid == os.getpid():
        # The managers stop first, bounded, on the helper (this thread may have been interrupted
        # inside a manager's call, holding its lock, or inside threading's own: no thread starts here).
        _signum = signum
        _wake.set()
        _stopped.wait(SIGNAL_STOP_BUDGET_S + _MARGIN_S)
    os.kill(os.getpid(), signum)


def _hook_signals() -> None:
    if threading.current_thread() is not threading.main_thread():
        return  # only the main thread may set handlers; vLLM's engine core builds the manager there
    _start_helper()
    for sig in STOP_SIGNALS:
        with contextlib.suppress(ValueError, OSError):
            current = signal.getsignal(sig)
            if current is _handler or current is None:
                continue  # hooked already, or a handler installed from C: not ours to wrap
            _previous[sig] = current
            signal.signal(sig, _handler)


def register(manager: _Stoppable, *, hook_signals: bool = True) -> None:
    """Stop ``manager`` at this process's exit.

    With ``hook_signals``, also hook SIGTERM/SIGINT as the module docstring says.
    The spec calls it for each manager it builds, any number of times.
    """
    global _exit_hooked_pid
    with _lock:
        _managers.add(manager)
        if _exit_hooked_pid != os.getpid():  # once per process (a forked child registers again)
            _exit_hooked_pid = os.getpid()
            # Runs at the interpreter's exit too: multiprocessing.util's atexit hook (_exit_function)
            # runs every finalizer with an exitpriority >= 0.
            multiprocessing.util.Finalize(None, stop_all, exitpriority=100)
    if hook_signals:
        _hook_signals()


def stop_budget(full_budget_s: float) -> float:
    """The budget of a manager's stop.

    It is ``full_budget_s``, or at most :data:`SIGNAL_STOP_BUDGET_S` once a stop signal came.
    """
    return min(full_budget_s, SIGNAL_STOP_BUDGET_S) if signalled() else full_budget_s


def previous_handler(sig: int) -> Callable[..., Any] | int | None:
    """The handler :func:`register` chained to for ``sig`` (for tests)."""
    return _previous.get(sig)
