"""Structured lifecycle logs: structlog over the stdlib logger ``kvactors``.

kvactors is a library, so importing it configures nothing: the stdlib logger
``kvactors`` gets a ``NullHandler`` and structlog's global configuration is
never touched. Each manager builds its own bound logger with
:func:`make_event_logger`; events go to

* the stdlib logger ``kvactors`` (route them with ``logging`` as for any
  library; lifecycle transitions are ``DEBUG``, anomalies ``WARNING``), and
* optionally a JSON-lines file (``TieringManager.start(event_log=PATH)`` or the
  ``KVACTORS_EVENT_LOG`` environment variable), one object per event, which
  ``kvactors check-log`` replays to verify the lifecycle contract.

Event names are snake_case verbs in the past tense (``store_prepared``,
``tier_finalized``) with bound context: ``req_id``, ``attempt``, ``tier``,
``job_id``, ``keys`` (a count), pending counts. Every name, with its levels and
required fields, is defined once in :mod:`kvactors.log_schema`; with
``KVACTORS_STRICT_EVENTS=1`` in the environment when a logger is built (the test
suite sets it), logging a name not there, at another level or without a
required field raises :class:`~kvactors.log_schema.UnknownEventError`.

Cost: the level is fixed when the logger is built (structlog's filtering bound
logger), so a filtered-out event is a no-op method call, well under a
microsecond. Call sites on hot paths pass plain ints and strings only.

Threading: the file sink serializes writes with a lock and stamps each event
with a sequence number ``seq``; events of one actor appear in the order that
actor emitted them, and an event emitted after another (in real time, across
threads) never gets a smaller ``seq``.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import threading
import time
from typing import IO, Any

import structlog
from structlog.typing import EventDict, FilteringBoundLogger, Processor, WrappedLogger

from kvactors.log_schema import UnknownEventError, problem

LOGGER_NAME = "kvactors"
ENV_EVENT_LOG = "KVACTORS_EVENT_LOG"
ENV_STRICT_EVENTS = "KVACTORS_STRICT_EVENTS"

_stdlib_logger = logging.getLogger(LOGGER_NAME)
_stdlib_logger.addHandler(logging.NullHandler())

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR, "critical": logging.CRITICAL}


class EventSink:
    """The final structlog "logger": writes JSON lines and forwards to stdlib.

    Thread-safe. ``close()`` flushes and closes the file; events after it go to
    stdlib only.
    """

    def __init__(
        self, json_path: str | os.PathLike[str] | None, stdlib_logger: logging.Logger | None = None
    ) -> None:
        self._lock = threading.Lock()
        self._stdlib = stdlib_logger if stdlib_logger is not None else _stdlib_logger
        self._seq = itertools.count()
        self._file: IO[str] | None = None
        self.path = os.fspath(json_path) if json_path is not None else None
        if self.path is not None:
            # Line-buffered append: a crash loses at most the line being written.
            self._file = open(self.path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115

    def _emit(self, level: str, event_dict: EventDict) -> None:
        numeric = _LEVELS.get(level, logging.INFO)
        with self._lock:
            event_dict["seq"] = next(self._seq)
            if self._file is not None:
                self._file.write(json.dumps(event_dict, default=str, separators=(",", ":")) + "\n")
        if self._stdlib.isEnabledFor(numeric):
            event = event_dict.get("event", "")
            rest = " ".join(f"{k}={v}" for k, v in event_dict.items() if k not in ("event", "level"))
            self._stdlib.log(numeric, "%s %s", event, rest, extra={"kvactors_event": dict(event_dict)})

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    # structlog calls the method named after the level with our processor's output.
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
    event_dict["ts"] = time.monotonic()
    event_dict["thread"] = threading.current_thread().name
    return event_dict


def _check_lifecycle(_: WrappedLogger, __: str, event_dict: EventDict) -> EventDict:
    reason = problem(event_dict, lifecycle=True)
    if reason is not None:
        raise UnknownEventError(reason)
    return event_dict


def _check_component(_: WrappedLogger, __: str, event_dict: EventDict) -> EventDict:
    reason = problem(event_dict, lifecycle=False)
    if reason is not None:
        raise UnknownEventError(reason)
    return event_dict


def _processors(check: Processor) -> list[Processor]:
    """The chain: stamp, then (strict mode, read when the logger is built) the schema check."""
    strict = os.environ.get(ENV_STRICT_EVENTS, "") not in ("", "0")
    return [_stamp, check, _hand_to_sink] if strict else [_stamp, _hand_to_sink]


def _hand_to_sink(_: WrappedLogger, __: str, event_dict: EventDict) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (event_dict,), {}


def make_event_logger(
    json_path: str | os.PathLike[str] | None = None, **context: Any
) -> tuple[FilteringBoundLogger, EventSink]:
    """Build one manager's lifecycle logger and its sink.

    Without ``json_path`` (and without ``KVACTORS_EVENT_LOG``) the level is the
    effective level of the stdlib logger ``kvactors`` at this moment; with a
    file, every event (``DEBUG`` and up) is recorded.
    """
    if json_path is None:
        json_path = os.environ.get(ENV_EVENT_LOG) or None
    sink = EventSink(json_path)
    level = logging.DEBUG if sink.path is not None else _stdlib_logger.getEffectiveLevel()
    logger = structlog.wrap_logger(
        sink,
        wrapper_class=structlog.make_filtering_bound_logger(level),
        processors=_processors(_check_lifecycle),
    )
    # bind() turns structlog's lazy proxy into the filtering logger itself: no proxy hop per call.
    return logger.bind(**context), sink


def null_logger() -> FilteringBoundLogger:
    """A logger that drops all but ``critical`` (kvactors emits none) for actors used without a manager."""
    return structlog.wrap_logger(
        EventSink(None),
        wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL),
        processors=[_hand_to_sink],
    ).bind()


def component_logger(component: str, **context: Any) -> FilteringBoundLogger:
    """A structured logger for one component's own events (a tier, the transfer engine).

    Events go to the stdlib logger ``kvactors.<component>`` (a child of
    ``kvactors``, so routed like every other kvactors log; each record carries
    the event dict as ``record.kvactors_event``); there is no JSON file. As with
    :func:`make_event_logger`, the level is the stdlib logger's effective level
    when this is called, so build it when the component is built.
    Thread-safe: any thread may log through it.
    """
    stdlib = logging.getLogger(f"{LOGGER_NAME}.{component}")
    logger = structlog.wrap_logger(
        EventSink(None, stdlib),
        wrapper_class=structlog.make_filtering_bound_logger(stdlib.getEffectiveLevel()),
        processors=_processors(_check_component),
    )
    return logger.bind(**context)
