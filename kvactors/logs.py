"""Structured lifecycle logs: structlog's stdlib integration over the stdlib logger ``kvactors``.

kvactors is a library, so importing it configures nothing.
The stdlib logger ``kvactors`` gets a ``NullHandler``.
structlog's global configuration is never read or touched, because every logger here is built with its own processors.
Each manager builds its own bound logger with :func:`make_event_logger`.
Its events go to two places.

* The stdlib logger ``kvactors``.
  Route them with ``logging`` as for any library.
  Lifecycle transitions are ``DEBUG``, and anomalies ``WARNING``.
  A record's ``msg`` is the event dict, a ``dict`` that prints as ``event k=v ...``.
  The dict is also in ``record.kvactors_event``.
  The record carries what :class:`structlog.stdlib.ProcessorFormatter` reads.
  So a handler with that formatter renders kvactors' events as structured events.
* Optionally, a JSON-lines file with one object per event.
  ``TieringManager.start(event_log=PATH)`` or the ``KVACTORS_EVENT_LOG`` environment variable names it.
  ``kvactors check-log`` replays it to verify the lifecycle contract.

Event names are snake_case verbs in the past tense (``store_prepared``, ``tier_finalized``).
They carry bound context: ``req_id``, ``attempt``, ``tier``, ``job_id``, ``keys`` (a count), pending counts.
Every name, with its levels and required fields, is defined once in :mod:`kvactors.log_schema`.
Strict mode is on when ``KVACTORS_STRICT_EVENTS=1`` is in the environment as a logger is built.
The test suite sets it.
In strict mode, logging a name not in the schema, at another level or without a required field
raises :class:`~kvactors.log_schema.UnknownEventError`.

Stamped fields:

* ``level``.
* ``timestamp``, wall-clock time in UTC, ISO 8601 (``2025-01-31T12:00:00.123456Z``).
* ``thread``, the emitting thread's name.
* ``seq``, for lifecycle events (below).

Nothing in the checker reads a time, as order comes from ``seq``.

The level is the stdlib logger's, asked at each call.
A level set at any time counts from the next event, on every thread.
That covers ``logging.getLogger("kvactors").setLevel(logging.DEBUG)``, a parent's level and ``logging.disable``.
A call below the level returns before any processor runs.
It costs one ``Logger.isEnabledFor``, a cached dict lookup.
A manager with an event log keeps every event (``DEBUG`` and up) for the file, whatever the level.
It hands stdlib those at its level.

Threading: every logger here may be used from any thread.
The file sink serializes writes with a lock and stamps each event with a sequence number ``seq``.
Events of one actor appear in the order that actor emitted them.
An event emitted after another, in real time and across threads, never gets a smaller ``seq``.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import sys
import threading
from typing import IO, Any, Protocol

import structlog
from structlog.stdlib import BoundLogger, ProcessorFormatter, add_log_level
from structlog.typing import EventDict, Processor, WrappedLogger

from kvactors.log_schema import UnknownEventError, problem

LOGGER_NAME = "kvactors"
ENV_EVENT_LOG = "KVACTORS_EVENT_LOG"
ENV_STRICT_EVENTS = "KVACTORS_STRICT_EVENTS"

_stdlib_logger = logging.getLogger(LOGGER_NAME)
_stdlib_logger.addHandler(logging.NullHandler())

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR, "critical": logging.CRITICAL}


class EventLogger(Protocol):
    """What kvactors calls on its loggers (:class:`structlog.stdlib.BoundLogger` and structlog's
    filtering bound loggers have it)."""

    def bind(self, **new_values: Any) -> Any: ...
    def is_enabled_for(self, level: int) -> bool: ...
    def debug(self, event: str, *args: Any, **kw: Any) -> Any: ...
    def info(self, event: str, *args: Any, **kw: Any) -> Any: ...
    def warning(self, event: str, *args: Any, **kw: Any) -> Any: ...
    def error(self, event: str, *args: Any, **kw: Any) -> Any: ...
    def exception(self, event: str, *args: Any, **kw: Any) -> Any: ...
    def critical(self, event: str, *args: Any, **kw: Any) -> Any: ...


class EventMessage(dict[str, Any]):
    """A stdlib record's ``msg``.

    It is the event dict, which plain formatters print as ``event k=v ...``.
    """

    __slots__ = ()

    def __str__(self) -> str:
        rest = " ".join(f"{k}={v}" for k, v in self.items() if k not in ("event", "level", "exc_info"))
        return f"{self.get('event', '')} {rest}"


class _LevelLogger(BoundLogger):
    """A :class:`structlog.stdlib.BoundLogger` that asks the stdlib logger's level at every call.

    It asks before building anything.
    A call below the level costs one ``isEnabledFor``.
    """

    def __init__(self, logger: Any, processors: Any, context: Any) -> None:
        super().__init__(logger, processors, context)
        # The stdlib's own (cached) check, one call away: actors ask it on every hot path.
        self.is_enabled_for = logger.isEnabledFor  # type: ignore[method-assign]

    def is_enabled_for(self, level: int) -> bool:
        return bool(self._logger.isEnabledFor(level))

    def debug(self, event: str | None = None, *args: Any, **kw: Any) -> Any:
        if self._logger.isEnabledFor(logging.DEBUG):
            return self._proxy_to_logger("debug", event, *args, **kw)
        return None

    def info(self, event: str | None = None, *args: Any, **kw: Any) -> Any:
        if self._logger.isEnabledFor(logging.INFO):
            return self._proxy_to_logger("info", event, *args, **kw)
        return None

    def warning(self, event: str | None = None, *args: Any, **kw: Any) -> Any:
        if self._logger.isEnabledFor(logging.WARNING):
            return self._proxy_to_logger("warning", event, *args, **kw)
        return None

    def error(self, event: str | None = None, *args: Any, **kw: Any) -> Any:
        if self._logger.isEnabledFor(logging.ERROR):
            return self._proxy_to_logger("error", event, *args, **kw)
        return None

    def critical(self, event: str | None = None, *args: Any, **kw: Any) -> Any:
        if self._logger.isEnabledFor(logging.CRITICAL):
            return self._proxy_to_logger("critical", event, *args, **kw)
        return None


class _RecordingLogger(BoundLogger):
    """A manager's logger with an event log.

    Every event is built for the file, at any level.
    """

    def is_enabled_for(self, level: int) -> bool:
        return True


class EventSink:
    """The processor that stamps ``seq`` and writes the JSON line, when there is a file.

    Thread-safe.
    ``close()`` flushes and closes the file.
    Events after it go to stdlib only.
    """

    def __init__(self, json_path: str | os.PathLike[str] | None) -> None:
        self._lock = threading.Lock()
        self._seq = itertools.count()
        self._file: IO[str] | None = None
        self.path = os.fspath(json_path) if json_path is not None else None
        if self.path is not None:
            # Line-buffered append: a crash loses at most the line being written.
            self._file = open(self.path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115

    def __call__(self, _: WrappedLogger, __: str, event_dict: EventDict) -> EventDict:
        with self._lock:  # seq and the line under one lock: the file is in seq order
            event_dict["seq"] = next(self._seq)
            if self._file is not None:
                self._file.write(json.dumps(event_dict, default=str, separators=(",", ":")) + "\n")
        return event_dict

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def _add_thread(_: WrappedLogger, __: str, event_dict: EventDict) -> EventDict:
    event_dict["thread"] = threading.current_thread().name
    return event_dict


_add_timestamp = structlog.processors.TimeStamper(fmt="iso", utc=True, key="timestamp")


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


def _to_stdlib(logger: WrappedLogger, method_name: str, event_dict: EventDict) -> tuple[tuple[Any, ...],
                                                                                       dict[str, Any]]:
    """The last processor, which returns the stdlib call's arguments.

    Those are ``ProcessorFormatter.wrap_for_formatter``'s, plus ``kvactors_event`` and a real ``exc_info``.
    It returns nothing when the stdlib logger drops that level.
    """
    if not logger.isEnabledFor(_LEVELS.get(event_dict["level"], logging.INFO)):
        raise structlog.DropEvent  # only a recording logger gets here below the level
    message = EventMessage(event_dict)
    args, wrapped = ProcessorFormatter.wrap_for_formatter(logger, method_name, message)
    kw: dict[str, Any] = {"extra": {**wrapped["extra"], "kvactors_event": message}}
    exc_info = message.get("exc_info")
    if exc_info:  # ``exception()``: the record gets the traceback, as from ``Logger.exception``
        exc_info = sys.exc_info() if exc_info is True else exc_info
        message["exc_info"] = kw["exc_info"] = exc_info
    return args, kw


def _strict() -> bool:
    return os.environ.get(ENV_STRICT_EVENTS, "") not in ("", "0")


def _processors(check: Processor, sink: EventSink | None) -> list[Processor]:
    """The chain: stamp, then the schema check, then the file.

    The schema check is there in strict mode only, which is read when the logger is built.
    """
    chain: list[Processor] = [add_log_level, _add_timestamp, _add_thread]
    if _strict():
        chain.append(check)
    if sink is not None:
        chain.append(sink)
    chain.append(_to_stdlib)
    return chain


def make_event_logger(
    json_path: str | os.PathLike[str] | None = None, **context: Any
) -> tuple[EventLogger, EventSink]:
    """Build one manager's lifecycle logger and its sink.

    Without ``json_path`` (and without ``KVACTORS_EVENT_LOG``), an event is built only if the stdlib logger
    ``kvactors`` is enabled for its level when it is logged.
    With a file, every event (``DEBUG`` and up) is recorded there.
    Those at the stdlib logger's level go to it too.
    """
    if json_path is None:
        json_path = os.environ.get(ENV_EVENT_LOG) or None
    sink = EventSink(json_path)
    cls = _RecordingLogger if sink.path is not None else _LevelLogger
    logger = cls(_stdlib_logger, _processors(_check_lifecycle, sink), context)
    return logger, sink


def null_logger() -> EventLogger:
    """A logger that drops all but ``critical`` (kvactors emits none) for actors used without a manager."""
    logger: EventLogger = structlog.wrap_logger(
        _stdlib_logger, wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL),
        processors=[add_log_level, _add_timestamp, _add_thread, _to_stdlib], context_class=dict,
    ).bind()  # bind(): the filtering logger itself, not structlog's lazy proxy
    return logger


def component_logger(component: str, **context: Any) -> EventLogger:
    """A structured logger for one component's own events (a tier, the transfer engine).

    Events go to the stdlib logger ``kvactors.<component>``.
    It is a child of ``kvactors``, so it is routed like every other kvactors log.
    Each record carries the event dict as ``record.kvactors_event``.
    There is no JSON file and no ``seq``.
    As for :func:`make_event_logger`, the level is the stdlib logger's effective level when an event is logged.
    Thread-safe: any thread may log through it.
    """
    stdlib = logging.getLogger(f"{LOGGER_NAME}.{component}")
    return _LevelLogger(stdlib, _processors(_check_component, None), context)
