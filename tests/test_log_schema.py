"""Every event name in kvactors' source is a literal of kvactors.log_schema, logged at a level the schema allows;
every schema name is emitted somewhere; the checker replays exactly the lifecycle names."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvactors import log_schema
from kvactors.log_schema import COMPONENT_EVENTS, EVENTS, JOB_COMPLETED, JOB_SUBMITTED, LIFECYCLE_EVENTS
from kvactors.logcheck import ManagerReplay

PACKAGE = Path(__file__).resolve().parents[1] / "kvactors"
LEVELS = {"debug": "debug", "info": "info", "warning": "warning", "error": "error", "exception": "error",
          "critical": "critical"}
#: Schema mappings an emitter may index with a run-time key (each of their values is a name).
LOOKUPS = {"JOB_SUBMITTED": JOB_SUBMITTED, "JOB_COMPLETED": JOB_COMPLETED}


@dataclass(frozen=True)
class Emit:
    where: str
    names: frozenset[str]  # empty: the name is not a literal of the schema
    levels: frozenset[str]


def _is_logger(node: ast.expr) -> bool:
    """``log``, ``self.log``, ``self._log``, ``self.manager._log``: the project's loggers are named so."""
    text = ast.unparse(node)
    return text.split(".")[-1].lstrip("_") == "log"


def _level_of(node: ast.expr) -> frozenset[str]:
    """The levels of ``log.debug`` or ``log.debug if c else log.warning`` (empty: not a logger method)."""
    if isinstance(node, ast.Attribute) and node.attr in LEVELS and _is_logger(node.value):
        return frozenset({LEVELS[node.attr]})
    if isinstance(node, ast.IfExp):
        body, orelse = _level_of(node.body), _level_of(node.orelse)
        return body | orelse if body and orelse else frozenset()
    return frozenset()


def _names_of(arg: ast.expr) -> frozenset[str]:
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return frozenset({arg.value})
    if isinstance(arg, ast.Subscript) and isinstance(arg.value, ast.Name) and arg.value.id in LOOKUPS:
        return frozenset(LOOKUPS[arg.value.id].values())
    return frozenset()  # an f-string, a variable, a call: not checkable against the schema


def emits(source: str, where: str) -> list[Emit]:
    """The log calls in ``source``: ``<logger>.<level>(name, ...)`` and calls of a local bound to a logger's
    method (``log = self.log.debug if ok else self.log.warning``; ``log(name, ...)``)."""
    tree = ast.parse(source)
    aliases: dict[str, frozenset[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            levels = _level_of(node.value)
            if levels:
                aliases[node.targets[0].id] = levels
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        levels = _level_of(node.func)
        if not levels and isinstance(node.func, ast.Name):
            levels = aliases.get(node.func.id, frozenset())
        if not levels:
            continue
        name = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "event"), None)
        names = _names_of(name) if name is not None else frozenset()
        found.append(Emit(f"{where}:{node.lineno}", names, levels))
    return found


def _package_emits() -> list[Emit]:
    return [emit for path in sorted(PACKAGE.rglob("*.py"))
            for emit in emits(path.read_text(), str(path.relative_to(PACKAGE.parent)))]


def _problems(found: list[Emit]) -> list[str]:
    problems = []
    for emit in found:
        if not emit.names:
            problems.append(f"{emit.where}: the event name is not a literal (or a lookup into log_schema)")
        for name in sorted(emit.names):
            spec = EVENTS.get(name)
            if spec is None:
                problems.append(f"{emit.where}: {name!r} is not in kvactors.log_schema")
            elif not emit.levels <= spec.levels:
                problems.append(f"{emit.where}: {name!r} logged at {sorted(emit.levels)}, the schema allows "
                                f"{sorted(spec.levels)}")
    return problems


def test_every_emitted_name_is_a_schema_literal_at_a_schema_level() -> None:
    found = _package_emits()
    assert len(found) > 60, "the scan finds the package's log calls"
    assert _problems(found) == []


def test_every_schema_name_is_emitted_somewhere() -> None:
    emitted = set().union(*(emit.names for emit in _package_emits()))
    assert emitted == set(EVENTS), ("in the schema, emitted nowhere:", set(EVENTS) - emitted)


@pytest.mark.parametrize(("line", "why"), [
    ('self.log.debug(f"{kind}_submitted", job_id=1)', "not a literal"),
    ('self._log.warning(name, job_id=1)', "not a literal"),
    ('log.info("tier_finalised", tier="t")', "not in kvactors.log_schema"),
    ('self.log.info("request_started", req_id="r", attempt=0)', "the schema allows"),
    ('log = self.log.debug if ok else self.log.error\nlog(JOB_COMPLETED[kind], job_id=1)', "the schema allows"),
    ('log = self.log.debug if ok else self.log.warning\nlog(f"{kind}_completed", job_id=1)', "not a literal"),
])
def test_the_scan_catches_what_the_schema_cannot_vouch_for(line: str, why: str) -> None:
    problems = _problems(emits(line, "x.py"))
    assert problems and all(why in p for p in problems), problems


def test_the_scan_accepts_literals_and_schema_lookups() -> None:
    ok = ('self.log.debug("request_started", req_id="r", attempt=0)\n'
          'log = self.log.debug if ok else self.log.warning\nlog(JOB_COMPLETED[kind], job_id=1)\n'
          'self.metrics.error(f"{ctx}: failed")\n')  # not a logger
    found = emits(ok, "x.py")
    assert len(found) == 2 and _problems(found) == []


def test_the_schema_is_consistent() -> None:
    assert set(EVENTS) == LIFECYCLE_EVENTS | COMPONENT_EVENTS and not LIFECYCLE_EVENTS & COMPONENT_EVENTS
    assert set(JOB_SUBMITTED.values()) | set(JOB_COMPLETED.values()) <= LIFECYCLE_EVENTS
    assert tuple(JOB_SUBMITTED) == tuple(JOB_COMPLETED) == log_schema.JOB_KINDS
    for name, spec in EVENTS.items():
        assert name == spec.name and name.islower() and " " not in name
        assert spec.levels and spec.levels <= {"debug", "info", "warning", "error", "critical"}


def test_the_checker_replays_exactly_the_lifecycle_names() -> None:
    handled = set(ManagerReplay(lambda violation: None).handlers)
    assert handled == set(LIFECYCLE_EVENTS), (handled ^ set(LIFECYCLE_EVENTS))
