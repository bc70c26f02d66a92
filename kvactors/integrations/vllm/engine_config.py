"""What kvactors reads of vLLM's engine config (``VllmConfig``), which the offloading spec is not given.

vLLM hands an offloading spec its ``OffloadingConfig`` only.
That holds no shutdown timeout, no model revision and no download folder.
The ``OffloadingConnector`` that builds the spec holds the engine's ``VllmConfig``.
It is its ``__init__``'s ``vllm_config`` argument, in vLLM 0.32 and 0.33 alike.
vLLM publishes no accessor for it there.
``vllm.config.get_current_vllm_config_or_none()`` is set only while the model is built, not when the connector is.
So :func:`find_vllm_config` tries two places, in order.

* The current config, if vLLM has one set.
* The ``vllm_config`` local of the nearest caller frame that holds a ``VllmConfig``,
  at most :data:`MAX_FRAMES` up.

When nothing is found it returns None.
That happens for a spec built by hand, a test, or a vLLM that builds the spec elsewhere.
The callers then do without and never fail.
There is no warning then, and the hub snapshot is not resolved.

:func:`check_shutdown_timeout` is the start-up warning of issue 34.
With vLLM's default ``--shutdown-timeout 0``, a SIGTERM kills the engine core at once,
before kvactors' manager stops.
vLLM's ``shutdown()`` in ``vllm/v1/utils.py`` sends SIGTERM, joins for 0 s, then calls ``kill_process_tree``.
So every stop's lifecycle log ends unproven (check-log INCONCLUSIVE), and the copies in flight are lost.
The warning says so once at engine start, in two places.
One is vLLM's log, under the logger ``vllm.kvactors``.
That logger is a child of vLLM's, so it is under vLLM's own handler and format.
The other is the lifecycle log, as the event ``shutdown_timeout_zero``.

Threading: called on the thread that builds the connector (vLLM's engine start).
"""

from __future__ import annotations

import logging
import sys
from types import FrameType
from typing import Any

MAX_FRAMES = 8
"""How many caller frames :func:`find_vllm_config` looks through (the connector is 2-3 up)."""

SHUTDOWN_TIMEOUT_HINT_S = 10
"""The ``--shutdown-timeout`` the warning recommends (vLLM's own stop takes 8-10 s on a CPU engine)."""

VLLM_LOGGER = "vllm.kvactors"


def _is_vllm_config(obj: object) -> bool:
    return any(cls.__name__ == "VllmConfig" and cls.__module__.startswith("vllm.") for cls in type(obj).__mro__)


def find_vllm_config(max_frames: int = MAX_FRAMES) -> Any | None:
    """The engine's ``VllmConfig`` (see the module docstring), or None."""
    current = None
    vllm_config_module = sys.modules.get("vllm.config")
    getter = getattr(vllm_config_module, "get_current_vllm_config_or_none", None)
    if getter is not None:
        try:
            current = getter()
        except Exception:  # a vLLM whose getter misbehaves: look at the frames
            current = None
    if current is not None and _is_vllm_config(current):
        return current
    frame: FrameType | None = sys._getframe(1)
    for _ in range(max_frames):
        if frame is None:
            break
        candidate = frame.f_locals.get("vllm_config")
        if candidate is not None and _is_vllm_config(candidate):
            return candidate
        frame = frame.f_back
    return None


def shutdown_timeout(vllm_config: Any | None) -> int | None:
    """``vllm_config.shutdown_timeout`` (``--shutdown-timeout``, seconds), or None if not known."""
    value = getattr(vllm_config, "shutdown_timeout", None)
    if type(value) is bool or not isinstance(value, int | float):
        return None
    return int(value)


def shutdown_timeout_message(timeout: int) -> str:
    return (f"kvactors: vLLM runs with --shutdown-timeout {timeout} (vLLM's default): on SIGTERM vLLM kills "
            "the engine core at once, before kvactors' manager can stop, so the offloads in flight are lost and "
            "the lifecycle log of every stop ends without manager_stopped (kvactors check-log: INCONCLUSIVE). "
            f"Run vllm serve with --shutdown-timeout {SHUTDOWN_TIMEOUT_HINT_S} or more.")


def check_shutdown_timeout(vllm_config: Any | None, log: Any | None) -> bool:
    """Warn once, on vLLM's log and in ``log`` (a manager's lifecycle event logger, or None), if
    ``vllm_config`` stops the engine core without waiting (``shutdown_timeout == 0``). True if it warned."""
    timeout = shutdown_timeout(vllm_config)
    if timeout is None or timeout > 0:
        return False
    logging.getLogger(VLLM_LOGGER).warning(shutdown_timeout_message(timeout))
    if log is not None:
        log.warning("shutdown_timeout_zero", shutdown_timeout_s=timeout,
                    recommended_s=SHUTDOWN_TIMEOUT_HINT_S)
    return True
