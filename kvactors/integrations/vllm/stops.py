"""Stopping the scheduler side's kvactors manager however the engine process ends.

vLLM stops its engine core on SIGTERM/SIGINT through its own handler: it sets
a flag, the busy loop ends, and ``EngineCore.shutdown`` reaches the connector
and so :meth:`KvactorsOffloadingManager.shutdown
<kvactors.integrations.vllm.manager.KvactorsOffloadingManager.shutdown>`. That
path has a deadline: vLLM's frontend kills the engine core with SIGKILL once
its ``--shutdown-timeout`` has passed (at once with the default 0: vllm 0.32
sends SIGTERM and SIGKILL back to back), after a grace of several seconds in
which the workers exit. So:

* :func:`register` chains a handler in front of the process's SIGTERM and
  SIGINT handlers (main thread only). It records that a stop signal came
  (:func:`signalled`: the manager then stops within :data:`SIGNAL_STOP_BUDGET_S`
  instead of its full ``transfer_timeout_s``-scale budget), then calls the
  handler that was there (vLLM's, or Python's ``KeyboardInterrupt``): the
  signal is never swallowed, and nothing is raised into kvactors' actors (they
  run on their own threads; a handler runs on the main thread). Where no
  handler was installed (``SIG_DFL``: an in-process engine in a script), the
  process was about to die: it stops the managers first (on a helper thread,
  at most :data:`SIGNAL_STOP_BUDGET_S` plus a margin), then dies of the same
  signal.
* It also stops every registered manager at the process's exit (a
  ``multiprocessing`` finalizer, which runs in vLLM's engine core and worker
  processes, forked or spawned, and ``atexit`` in a plain interpreter), in case
  the engine's own shutdown path did not get to it (it raised before).

SIGKILL cannot be handled: the shared pool's file is gone by then anyway
(:mod:`kvactors.integrations.vllm.shm`); the event log of a killed manager
ends without ``manager_stopped``, and ``kvactors check-log`` says
INCONCLUSIVE, which is the truth.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing.util
import os
import signal
import threading
import time
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
_signalled_at: float | None = None
_exit_hooked_pid: int | None = None


def signalled() -> bool:
    """Whether this process got SIGTERM or SIGINT since :func:`register` hooked it."""
    return _signalled_at is not None


def stop_all() -> None:
    """Stop every registered manager (idempotent; a manager's own failure is not raised)."""
    with _lock:
        managers = list(_managers)
    for manager in managers:
        with contextlib.suppress(Exception):
            manager.shutdown()


def _handler(signum: int, frame: FrameType | None) -> None:
    global _signalled_at
    if _signalled_at is None:
        _signalled_at = time.monotonic()
    previous = _previous.get(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)  # vLLM's own (sets its flag), or Python's KeyboardInterrupt
        return
    if previous == signal.SIG_IGN:
        return
    # Nobody handles it: the process dies of it now. The managers stop first, bounded, off this
    # thread (this one may have been interrupted inside a manager's call, holding its lock).
    stopper = threading.Thread(target=stop_all, name="kvactors-vllm-stop", daemon=True)
    stopper.start()
    stopper.join(SIGNAL_STOP_BUDGET_S + _MARGIN_S)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _hook_signals() -> None:
    if threading.current_thread() is not threading.main_thread():
        return  # only the main thread may set handlers; vLLM's engine core builds the manager there
    for sig in STOP_SIGNALS:
        with contextlib.suppress(ValueError, OSError):
            current = signal.getsignal(sig)
            if current is _handler:
                continue
            _previous[sig] = current
            signal.signal(sig, _handler)


def register(manager: _Stoppable, *, hook_signals: bool = True) -> None:
    """Stop ``manager`` at this process's exit, and (``hook_signals``) hook SIGTERM/SIGINT as the
    module docstring says. Called by the spec for each manager it builds; any number of times."""
    global _exit_hooked_pid
    with _lock:
        _managers.add(manager)
        if _exit_hooked_pid != os.getpid():  # once per process (a forked child registers again)
            _exit_hooked_pid = os.getpid()
            multiprocessing.util.Finalize(None, stop_all, exitpriority=100)
            atexit.register(stop_all)
    if hook_signals:
        _hook_signals()


def stop_budget(full_budget_s: float) -> float:
    """The budget of a manager's stop: ``full_budget_s``, or at most :data:`SIGNAL_STOP_BUDGET_S`
    once a stop signal came."""
    return min(full_budget_s, SIGNAL_STOP_BUDGET_S) if signalled() else full_budget_s


def previous_handler(sig: int) -> Callable[..., Any] | int | None:
    """The handler :func:`register` chained to for ``sig`` (for tests)."""
    return _previous.get(sig)
