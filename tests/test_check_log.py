"""``kvactors check-log``: real logs pass; a log with one event moved, duplicated or dropped is caught."""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path

import pytest

from kvactors.commands import check_log, stress
from kvactors.commands.check_log import Event, Verdict, check_events
from kvactors.testing.explore import explore_one

Mutation = Callable[[list[Event]], list[Event] | None]


@pytest.fixture(scope="module")
def sim_events(tmp_path_factory: pytest.TempPathFactory) -> list[Event]:
    path = tmp_path_factory.mktemp("logs") / "sim.jsonl"
    for seed in range(60):
        assert explore_one(seed, event_log=str(path)).ok
    return _read(path)


@pytest.fixture(scope="module")
def thread_events(tmp_path_factory: pytest.TempPathFactory) -> list[Event]:
    path = tmp_path_factory.mktemp("logs") / "threads.jsonl"
    parser = argparse.ArgumentParser()
    stress.add_arguments(parser)
    args = parser.parse_args(["--no-progress", "--threads", "4", "--requests", "40", "--seed", "11",
                              "--event-log", str(path), "--switch-interval", "1e-5", "--hang-after", "60"])
    summary = stress.run_stress(args)
    assert summary["violations"] == 0, summary["violation_list"]
    return _read(path)


def _read(path: Path) -> list[Event]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _ordered(events: list[Event]) -> list[Event]:
    return sorted(events, key=lambda e: (str(e.get("manager")), e["seq"]))


def _renumber(events: list[Event]) -> list[Event]:
    """Make ``seq`` follow list order within each manager (a moved event really moved)."""
    counters: dict[object, int] = {}
    out = []
    for event in events:
        manager = event.get("manager")
        counters[manager] = counters.get(manager, -1) + 1
        out.append({**event, "seq": counters[manager]})
    return out


def _same_request(a: Event, b: Event) -> bool:
    return (a.get("manager"), a.get("req_id"), a.get("attempt")) == (b.get("manager"), b.get("req_id"),
                                                                    b.get("attempt"))


def _finalized(events: list[Event], e: Event) -> bool:
    return any(x["event"] == "request_finalized" and _same_request(x, e) for x in events)


# --------------------------------------------------------------------- mutations


def move_finish_before_submit(events: list[Event]) -> list[Event] | None:
    """A tier's on_request_finished moved before one of that request's submits at that tier."""
    for i, submit in enumerate(events):
        if submit["event"] != "tier_submit_received":
            continue
        for j in range(i + 1, len(events)):
            finish = events[j]
            if finish["event"] == "tier_finish_received" and finish["tier"] == submit["tier"] and \
                    _same_request(finish, submit):
                moved = [*events[:i], finish, *events[i:j], *events[j + 1:]]
                return _renumber(moved)
    return None


def move_store_completion_after_finalize(events: list[Event]) -> list[Event] | None:
    """A live store completion moved after the request's finalize."""
    for i, done in enumerate(events):
        if done["event"] != "store_completed" or not done.get("live"):
            continue
        for j in range(i + 1, len(events)):
            if events[j]["event"] == "request_finalized" and _same_request(events[j], done):
                moved = events[:i] + events[i + 1:j + 1] + [done] + events[j + 1:]
                return _renumber(moved)
    return None


def _duplicate(kind: str) -> Mutation:
    def mutate(events: list[Event]) -> list[Event] | None:
        for i, event in enumerate(events):
            if event["event"] == kind:
                return _renumber([*events[:i + 1], dict(event), *events[i + 1:]])
        return None

    mutate.__name__ = f"duplicate_{kind}"
    return mutate


def _drop(kind: str, where: Callable[[list[Event], Event], bool] = lambda events, e: True) -> Mutation:
    def mutate(events: list[Event]) -> list[Event] | None:
        for i, event in enumerate(events):
            if event["event"] == kind and where(events, event):
                return events[:i] + events[i + 1:]
        return None

    mutate.__name__ = f"drop_{kind}"
    return mutate


def _relabel(kind: str, field: str) -> Mutation:
    """The first ``kind`` event of a job names another request (``req_id``) or tier than its job's others."""
    def mutate(events: list[Event]) -> list[Event] | None:
        for i, event in enumerate(events):
            if event["event"] != kind or field not in event or "job_id" not in event:
                continue
            others = [e[field] for e in events if field in e and e[field] != event[field]
                      and e.get("manager") == event.get("manager")]
            forged = others[0] if others else f"forged-{event[field]}"
            return [*events[:i], {**event, field: forged}, *events[i + 1:]]
        return None

    mutate.__name__ = f"relabel_{kind}_{field}"
    return mutate


def _store_outcome(*, success: bool = True, extra: int = 0) -> Mutation:
    """The first store_completed that made blocks ready says ``success`` / ``extra`` more blocks stored."""
    def mutate(events: list[Event]) -> list[Event] | None:
        for i, event in enumerate(events):
            if event["event"] == "store_completed" and event.get("stored"):
                forged = {**event, "success": success, "stored": event["stored"] + extra}
                return [*events[:i], forged, *events[i + 1:]]
        return None

    mutate.__name__ = "store_outcome"
    return mutate


MUTATIONS: dict[str, tuple[Mutation, str | None]] = {
    # Caught as "one-job", or by the rule the forged name breaks first (None: any rule).
    **{f"relabel {kind} {field}": (_relabel(kind, field), None)
       for kind in ("cascade_submitted", "tier_submit_received", "cascade_completed", "promotion_submitted",
                    "promotion_completed", "job_queued")
       for field in ("tier", "req_id", "keys")
       if not (field == "keys" and kind in ("tier_submit_received", "job_queued"))},  # these carry no keys
    "relabel tier_submit_received promotion": (_relabel("tier_submit_received", "promotion"), "one-job"),
    **{f"relabel {kind} {field}": (_relabel(kind, field), "one-job")
       for kind, field in (("job_timed_out", "tier"), ("job_timed_out", "req_id"), ("late_report_ignored", "tier"))},
    "a failed store that made blocks ready": (_store_outcome(success=False), None),
    "a store that made more blocks ready than it wrote": (_store_outcome(extra=1), "failure-not-success"),
    "move tier finish before a submit": (move_finish_before_submit, "no-submit-after-finish"),
    "move store completion after finalize": (move_store_completion_after_finalize, "finalize-after-stores"),
    "duplicate tier_finish_received": (_duplicate("tier_finish_received"), "one-finish"),
    "duplicate tier_finalized": (_duplicate("tier_finalized"), "one-finish"),
    "duplicate request_finished": (_duplicate("request_finished"), "one-finish"),
    "duplicate cascade_completed": (_duplicate("cascade_completed"), "pin-released-once"),
    "duplicate load_completed": (_duplicate("load_completed"), "pin-released-once"),
    "drop tier_finish_received": (_drop("tier_finish_received"), "one-finish"),
    "drop request_finished": (_drop("request_finished", _finalized), "finalize-after-finish"),
    "drop store_completed": (_drop("store_completed", lambda ev, e: bool(e.get("live")) and _finalized(ev, e)),
                             "finalize-after-stores"),
    "drop load_completed": (_drop("load_completed"), "pin-released-once"),
    "drop cascade_completed": (_drop("cascade_completed"), "pin-released-once"),
    "drop tier_finalized": (_drop("tier_finalized"), "one-finish"),
}


def test_real_logs_pass(sim_events: list[Event], thread_events: list[Event]) -> None:
    for events in (sim_events, thread_events):
        result = check_events(events)
        assert result.requests > 100
        assert not result.violations, "\n".join(v.format() for v in result.violations[:5])


@pytest.mark.parametrize("name", sorted(MUTATIONS))
@pytest.mark.parametrize("source", ["sim", "thread"])
def test_a_mutated_log_is_caught(name: str, source: str, request: pytest.FixtureRequest) -> None:
    events = _ordered(request.getfixturevalue(f"{source}_events"))
    mutation, rule = MUTATIONS[name]
    mutated = mutation(events)
    if mutated is None:
        pytest.skip(f"the {source} log has no event for '{name}'")
    result = check_events(mutated)
    assert any(rule in (None, v.rule) for v in result.violations), [v.format() for v in result.violations[:3]]
    assert all(v.events for v in result.violations)  # each names the events involved


def test_every_mutation_applies_to_a_real_log(sim_events: list[Event], thread_events: list[Event]) -> None:
    """A mutation that finds no event to change in either log would only ever skip: a check of nothing."""
    sources = (_ordered(sim_events), _ordered(thread_events))
    idle = [name for name, (mutation, _) in MUTATIONS.items() if all(mutation(events) is None for events in sources)]
    assert not idle, idle


def test_random_mutations_detection_rate(sim_events: list[Event]) -> None:
    """Random single mutations of contract events: report how many are caught."""
    events = _ordered(sim_events)
    contract = {"request_finished", "store_prepared", "store_completed", "tier_finalized", "request_finalized",
                "tier_finish_received", "tier_submit_received", "cascade_submitted", "cascade_completed",
                "load_prepared", "load_completed", "job_timed_out", "job_dropped"}
    rng = random.Random(5)
    caught = tried = 0
    candidates = [i for i, e in enumerate(events) if e["event"] in contract]
    for _ in range(200):
        i = rng.choice(candidates)
        kind = rng.choice(("duplicate", "drop"))
        mutated = events[:i] + ([dict(events[i])] if kind == "duplicate" else []) + events[i:]
        mutated = mutated if kind == "duplicate" else events[:i] + events[i + 1:]
        tried += 1
        caught += bool(check_events(_renumber(mutated)).violations)
    print(f"\nrandom duplicate/drop of a contract event: {caught}/{tried} caught ({caught / tried:.0%})")
    assert caught / tried > 0.5


def test_cli_exit_status_and_message(tmp_path: Path, sim_events: list[Event],
                                     capsys: pytest.CaptureFixture[str]) -> None:
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    ordered = _ordered(sim_events)
    good.write_text("".join(json.dumps(e) + "\n" for e in ordered))
    mutated = move_finish_before_submit(ordered)
    assert mutated is not None
    bad.write_text("".join(json.dumps(e) + "\n" for e in mutated))
    parser = argparse.ArgumentParser()
    check_log.add_arguments(parser)
    assert check_log.run(parser.parse_args([str(good)])) == 0
    assert check_log.run(parser.parse_args([str(bad), "--json"])) == 1
    captured = capsys.readouterr()
    assert "VIOLATION no-submit-after-finish" in captured.err  # --json: the report on stderr
    assert "tier_submit_received" in captured.err and "tier_finish_received" in captured.err
    assert json.loads(captured.out.strip().splitlines()[-1])["violations"] >= 1
    assert check_log.run(parser.parse_args([str(tmp_path / "missing.jsonl")])) == 2


def test_a_promotion_allocated_just_before_a_reset_may_still_be_submitted() -> None:
    """Found by the 1M-operation stress log: the primary allocates, then resets; the supervisor
    sees the allocation before the reset, so the submit is legal (not a stale promotion)."""
    base = {"manager": 0, "req_id": "r", "attempt": 0}
    names = [("manager_started", {"tiers": "cpu,t"}), ("request_started", {}),
             ("promotion_allocated", {"job_id": 5, "tier": "t", "keys": 1, "epoch": 0}),
             ("cache_reset", {"tier": "cpu"}),
             ("promotion_submitted", {"job_id": 5, "tier": "t"}), ("cache_reset_draining", {"epoch": 1}),
             ("tier_submit_received", {"job_id": 5, "tier": "t", "promotion": True}),
             ("promotion_completed", {"job_id": 5, "tier": "t", "success": True}),
             ("request_finished", {"tier": "cpu", "pending_stores": 0}), ("request_finish_seen", {}),
             ("tier_finalized", {"tier": "t"}),
             ("tier_finish_received", {"tier": "t"}), ("request_finalized", {}), ("manager_stopped", {})]
    events = [{**base, **fields, "event": name, "seq": seq} for seq, (name, fields) in enumerate(names)]
    assert check_events(events).verdict is Verdict.OK
    # The same promotion allocated after the reset for a decision of the old epoch is stale: never submitted.
    stale = [dict(e) for e in events]
    stale[2], stale[3] = {**stale[3], "seq": 2}, {**stale[2], "seq": 3}
    assert any(v.rule == "one-job-end" for v in check_events(stale).violations)
