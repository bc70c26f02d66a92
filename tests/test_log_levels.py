"""Log levels set at any time count from the next event; a call below the level builds nothing; events carry a
wall-clock UTC timestamp; records carry what ``structlog.stdlib.ProcessorFormatter`` renders."""

from __future__ import annotations

import datetime
import io
import json
import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
import torch

from kvactors import ReqContext, TieringManager
from kvactors.logcheck import Verdict, check_events
from kvactors.logs import component_logger, make_event_logger
from kvactors.transfer import TransferEngine
from tests.support import keys, settled


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def events(self) -> list[str]:
        return [record.kvactors_event["event"] for record in self.records]  # type: ignore[attr-defined]


@pytest.fixture
def kvlog() -> Iterator[tuple[logging.Logger, _Records]]:
    """The stdlib logger ``kvactors`` at WARNING with a recording handler; restored afterwards."""
    logger = logging.getLogger("kvactors")
    level, handler = logger.level, _Records()
    logger.setLevel(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield logger, handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _one_request(manager: TieringManager, name: str) -> None:
    ctx = ReqContext(name)
    manager.on_new_request(ctx)
    manager.on_request_finished(ctx)
    settled(manager)


def test_a_level_set_after_the_start_counts_from_the_next_event(kvlog: tuple[logging.Logger, _Records]) -> None:
    logger, records = kvlog
    with TieringManager.start(num_blocks=4, block_bytes=8) as manager:
        _one_request(manager, "quiet")
        assert "request_started" not in records.events()
        # Set from another thread: the actors' threads see it at their next event.
        setter = threading.Thread(target=logger.setLevel, args=(logging.DEBUG,))
        setter.start()
        setter.join(10)
        _one_request(manager, "loud")
        started = [r.kvactors_event for r in records.records if r.kvactors_event["event"] == "request_started"]
        assert [e["req_id"] for e in started] == ["loud"]
        assert "request_finalized" in records.events()
        logger.setLevel(logging.INFO)
        records.records.clear()
        _one_request(manager, "quiet again")
        assert "request_started" not in records.events()
    assert "manager_stopped" in records.events()  # INFO


def test_a_parent_level_and_logging_disable_count_too(kvlog: tuple[logging.Logger, _Records]) -> None:
    logger, records = kvlog
    logger.setLevel(logging.NOTSET)  # the effective level is the root's
    root = logging.getLogger()
    old = root.level
    root.setLevel(logging.WARNING)
    try:
        with TieringManager.start(num_blocks=4, block_bytes=8) as manager:
            _one_request(manager, "a")
            root.setLevel(logging.DEBUG)
            _one_request(manager, "b")
            logging.disable(logging.CRITICAL)
            try:
                _one_request(manager, "c")
            finally:
                logging.disable(logging.NOTSET)
    finally:
        root.setLevel(old)
    started = [r.kvactors_event["req_id"] for r in records.records if r.kvactors_event["event"] == "request_started"]
    assert started == ["b"]


def test_a_level_set_after_a_component_was_built_counts(kvlog: tuple[logging.Logger, _Records]) -> None:
    logger, records = kvlog
    with TieringManager.start(num_blocks=4, block_bytes=8) as manager:
        engine = TransferEngine(manager, torch.zeros((4, 8), dtype=torch.uint8))
        logger.setLevel(logging.DEBUG)
        engine.close()
    assert "engine_closed" in records.events()
    assert any(r.name == "kvactors.transfer" for r in records.records)


def test_a_call_below_the_level_runs_no_processor(kvlog: tuple[logging.Logger, _Records]) -> None:
    logger, _records = kvlog

    def boom(*_: object) -> object:
        raise AssertionError("a processor ran for an event below the level")

    log, sink = make_event_logger(None, manager=0, pid=0)
    comp = component_logger("tiers.test")
    try:
        for each in (log, comp):
            each._processors = [boom]  # type: ignore[attr-defined]
            each.debug("tier_opened")
            assert not each.is_enabled_for(logging.DEBUG) and each.is_enabled_for(logging.WARNING)
            logger.setLevel(logging.DEBUG)
            assert each.is_enabled_for(logging.DEBUG)
            with pytest.raises(AssertionError, match="a processor ran"):
                each.debug("tier_opened")
            logger.setLevel(logging.WARNING)
    finally:
        sink.close()


def test_an_event_log_keeps_every_event_whatever_the_level(tmp_path: Path,
                                                           kvlog: tuple[logging.Logger, _Records]) -> None:
    _logger, records = kvlog
    path = tmp_path / "events.jsonl"
    before = datetime.datetime.now(datetime.UTC)
    with TieringManager.start(num_blocks=4, block_bytes=8, event_log=str(path)) as manager:
        ctx = ReqContext("r")
        manager.on_new_request(ctx)
        manager.complete_store(keys(1), ctx)  # misuse, never prepared: a WARNING, for stdlib too
        manager.on_request_finished(ctx)
        settled(manager)
    after = datetime.datetime.now(datetime.UTC)
    events = [json.loads(line) for line in path.read_text().splitlines()]
    names = [e["event"] for e in events]
    assert "request_started" in names and "request_started" not in records.events()
    assert "manager_stopped" not in records.events()  # INFO, below WARNING
    assert "contract_violation" in records.events()
    for event in events:
        assert "ts" not in event
        stamp = datetime.datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00"))
        assert event["timestamp"].endswith("Z") and stamp.utcoffset() == datetime.timedelta(0)
        assert before - datetime.timedelta(seconds=1) <= stamp <= after + datetime.timedelta(seconds=1)
    assert [e["seq"] for e in events] == list(range(len(events)))
    assert check_events(events).verdict is Verdict.OK


def test_an_old_log_with_monotonic_ts_is_checked_as_before(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    with TieringManager.start(num_blocks=4, block_bytes=8, event_log=str(path)) as manager:
        _one_request(manager, "r")
    events = [json.loads(line) for line in path.read_text().splitlines()]
    old = [{**{k: v for k, v in e.items() if k != "timestamp"}, "ts": 1000.0 + n} for n, e in enumerate(events)]
    new, before = check_events(events), check_events(old)
    assert new.verdict is before.verdict is Verdict.OK
    assert (new.events, new.requests) == (before.events, before.requests)


def test_records_render_with_processor_formatter(kvlog: tuple[logging.Logger, _Records]) -> None:
    logger, _ = kvlog
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(processors=[
        structlog.stdlib.ProcessorFormatter.remove_processors_meta, structlog.processors.format_exc_info,
        structlog.processors.JSONRenderer()]))
    logger.addHandler(handler)
    try:
        comp = component_logger("vllm")
        comp.warning("transfer_failed", req_id="r", keys=2)
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            comp.exception("take_events_failed")
    finally:
        logger.removeHandler(handler)
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["event"] == "transfer_failed" and first["keys"] == 2 and first["level"] == "warning"
    assert second["event"] == "take_events_failed" and "RuntimeError: boom" in second["exception"]


def test_plain_formatters_print_the_event_and_the_traceback(kvlog: tuple[logging.Logger, _Records]) -> None:
    _logger, records = kvlog
    comp = component_logger("vllm")
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        comp.exception("take_events_failed")
    record = records.records[-1]
    assert record.getMessage().startswith("take_events_failed ") and "exc_info" not in record.getMessage()
    assert record.levelno == logging.ERROR and record.exc_info is not None
    assert "RuntimeError: boom" in logging.Formatter().format(record)
