"""The transfer engine's structured logger: structlog over stdlib ``kvactors.transfer``.

Built the way :mod:`kvactors.logs` builds the manager's: a filtering bound
logger wrapped around our own final logger, and never ``structlog.configure``
(kvactors is a library). ``kvactors.transfer`` is a child of the stdlib
logger ``kvactors``, which has a ``NullHandler``: applications route it with
``logging`` as for any library. Each record carries the structured event as
``record.kvactors_event`` (a dict), and reads ``"<event> key=value ..."``.

The level is fixed when an engine is built (the effective level of
``kvactors.transfer`` then), so a filtered-out event costs a no-op call.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import structlog
from structlog.typing import EventDict, FilteringBoundLogger, WrappedLogger

LOGGER_NAME = "kvactors.transfer"

_stdlib_logger = logging.getLogger(LOGGER_NAME)

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR, "critical": logging.CRITICAL}


class _StdlibForwarder:
    """The final structlog logger: one stdlib record per event, with the dict attached."""

    def _emit(self, level: str, event_dict: EventDict) -> None:
        numeric = _LEVELS.get(level, logging.INFO)
        if not _stdlib_logger.isEnabledFor(numeric):
            return
        event = event_dict.get("event", "")
        rest = " ".join(f"{k}={v}" for k, v in event_dict.items() if k not in ("event", "level"))
        _stdlib_logger.log(numeric, "%s %s", event, rest, extra={"kvactors_event": dict(event_dict)})

    def debug(self, event_dict: EventDict) -> None:
        self._emit("debug", event_dict)

    def info(self, event_dict: EventDict) -> None:
        self._emit("info", event_dict)

    def warning(self, event_dict: EventDict) -> None:
        self._emit("warning", event_dict)

    def error(self, event_dict: EventDict) -> None:
        self._emit("error", event_dict)

    def critical(self, event_dict: EventDict) -> None:
        self._emit("critical", event_dict)

    msg = info
    exception = error


def _stamp(_: WrappedLogger, method_name: str, event_dict: EventDict) -> EventDict:
    event_dict["level"] = "warning" if method_name == "warn" else method_name
    event_dict["thread"] = threading.current_thread().name
    return event_dict


def _hand_over(_: WrappedLogger, __: str, event_dict: EventDict) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (event_dict,), {}


def make_transfer_logger(**context: Any) -> FilteringBoundLogger:
    """A bound logger for one engine; ``context`` is bound to every event."""
    logger = structlog.wrap_logger(
        _StdlibForwarder(),
        wrapper_class=structlog.make_filtering_bound_logger(_stdlib_logger.getEffectiveLevel()),
        processors=[_stamp, _hand_over],
        cache_logger_on_first_use=True,
    )
    return logger.bind(**context) if context else logger
