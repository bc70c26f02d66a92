"""kvactors' offloading events as vLLM's, taken off the scheduler's thread.

Once per step the scheduler side starts a ``take_events`` on a helper thread, unless one is still running.
It may wait for a secondary tier there.
vLLM's ``take_events`` returns what the finished ones brought.

Threading: :meth:`EventPump.kick`, :meth:`~EventPump.take` and :meth:`~EventPump.close`
may be called from any thread, under a lock of the pump's own.
The pump thread runs only ``TieringManager.take_events`` and the conversion.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from vllm.v1.kv_offload.base import Locality, Medium
from vllm.v1.kv_offload.base import OffloadingEvent as VEvent

from kvactors.core.errors import ManagerStoppedError
from kvactors.manager import TieringManager
from kvactors.types import PRIMARY_TIER_NAME, OffloadingEvent


def to_vllm(event: OffloadingEvent, tier_kinds: Mapping[str, str]) -> VEvent:
    """Convert kvactors' events to vLLM's.

    The primary's events are the CPU medium.
    A secondary tier's are storage, and remote for Redis.
    """
    if event.tier == PRIMARY_TIER_NAME:
        return VEvent(keys=list(event.keys), medium=Medium.CPU, removed=event.removed, locality=Locality.LOCAL)
    locality = Locality.REMOTE if tier_kinds.get(event.tier) in ("redis", "mooncake") else Locality.LOCAL
    return VEvent(keys=list(event.keys), medium=Medium.STORAGE, removed=event.removed, locality=locality,
                  ownership=event.tier)


class EventPump:
    """At most one ``take_events`` in flight, and its converted events kept for :meth:`take`.

    With ``enabled=False``, events are still taken from kvactors, so that they do not pile up.
    They are then dropped.
    """

    def __init__(self, tm: TieringManager, *, enabled: bool, tier_kinds: Mapping[str, str], log: Any) -> None:
        self.tm = tm
        self._enabled = enabled
        self._tier_kinds = dict(tier_kinds)
        self._log = log
        self._lock = threading.Lock()
        self._events: list[VEvent] = []
        self._busy = False
        self._closed = False
        self._pump = ThreadPoolExecutor(1, thread_name_prefix="kvactors-vllm-events")

    def kick(self) -> None:
        """Start a ``take_events`` unless one is running (or the pump is closed)."""
        with self._lock:  # the submit too: none can follow close()'s shutdown
            if self._busy or self._closed:
                return
            self._busy = True
            self._pump.submit(self._run)

    def take(self) -> list[VEvent]:
        with self._lock:
            events, self._events = self._events, []
        return events

    def close(self) -> None:
        """Accept no more kicks, and wait for the one in flight."""
        with self._lock:
            self._closed = True
        self._pump.shutdown(wait=True)

    def _run(self) -> None:
        try:
            events = self.tm.take_events()
        except ManagerStoppedError:
            events = []
        except Exception:
            self._log.exception("take_events_failed")
            events = []
        converted = [to_vllm(e, self._tier_kinds) for e in events] if self._enabled else []
        with self._lock:
            self._events.extend(converted)
            self._busy = False
