"""check-log's verdicts: a log that proves nothing is not OK; bad input is one line, exit 2; finishes lost at
the stop are caught; memory does not grow with the log; the mutation score."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

from kvactors.cli import main
from kvactors.commands import check_log
from kvactors.log_schema import LIFECYCLE_EVENTS
from kvactors.logcheck import LogChecker, ManagerReplay, Verdict, check_events, check_stream
from kvactors.logcheck.mutations import score
from kvactors.logcheck.samples import big_log, by_manager, read_log, sim_log, thread_log

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    tmp = tmp_path_factory.mktemp("verdicts")
    return {"sim": read_log(sim_log(tmp / "sim.jsonl", range(12))),
            "threads": read_log(thread_log(tmp / "threads.jsonl", threads=3, requests=12))}


def _run(path: Path, *extra: str) -> tuple[int, str, str]:
    """``kvactors check-log`` in this process (``kvactors.cli.main``): exit status, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(["check-log", str(path), *extra])
        except SystemExit as exc:
            rc = int(exc.code or 0)
    return rc, out.getvalue(), err.getvalue()


def _write(path: Path, events: list[dict]) -> Path:
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    return path


# ------------------------------------------------------------------ item 6: finishes at the stop

FINISHES = {"request_finished", "request_finish_seen", "tier_finalized", "tier_finish_received", "request_finalized"}


@pytest.mark.parametrize("source", ["sim", "threads"])
def test_deleting_every_finish_of_a_request_is_caught(logs: dict[str, list[dict]], source: str) -> None:
    managers = by_manager(logs[source])
    tried = 0
    for events in managers:
        finalized = {(e["req_id"], e["attempt"]) for e in events if e["event"] == "request_finalized"}
        for identity in sorted(finalized)[:5]:
            mutated = [e for e in events if not (e["event"] in FINISHES and (e.get("req_id"), e.get("attempt"))
                                                 == identity)]
            mutated = [{**e, "seq": n} for n, e in enumerate(mutated)]
            result = check_events(mutated)
            assert result.verdict is Verdict.VIOLATION, identity
            assert any("finish events are missing" in v.message for v in result.violations)
            tried += 1
    assert tried >= 5


def test_the_roll_call_names_requests_left_live(logs: dict[str, list[dict]]) -> None:
    calls = [e for e in logs["threads"] if e["event"] == "request_active_at_stop"]
    assert calls, "the workload leaves some requests unfinished"
    assert check_events(logs["threads"]).verdict is Verdict.OK
    # Deleting the roll call of one of them is caught; so is claiming a finish the log does not have.
    gone = [e for e in logs["threads"] if e is not calls[0]]
    assert check_events(gone).verdict is Verdict.VIOLATION
    lie = [{**e, "finished": not e["finished"]} if e is calls[0] else e for e in logs["threads"]]
    assert check_events(lie).verdict is Verdict.VIOLATION


# ------------------------------------------------------------------ item 7: verdicts and bad input

def test_a_log_that_proves_nothing_is_inconclusive(tmp_path: Path, logs: dict[str, list[dict]]) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_text("not json\n{\"no\": \"event\"}\n[1, 2]\n")
    foreign = _write(tmp_path / "foreign.jsonl", [{"event": "request_started", "seq": 0}])
    one = by_manager(logs["sim"])[0]
    running = _write(tmp_path / "running.jsonl", one[:-1])  # manager_stopped missing: never stopped
    renamed = _write(tmp_path / "renamed.jsonl",
                     [{**e, "event": "tier_finalised"} if e["event"] == "tier_finalized" else e for e in one])
    for path, words in ((empty, "no event"), (garbage, "unreadable"), (foreign, "no event of any manager"),
                        (running, "never stopped")):
        rc, out, err = _run(path)
        assert rc == 3, (path.name, rc, out, err)
        assert "INCONCLUSIVE" in out and words in out, (path.name, out)
    # A renamed event is reported by name; the rules it fed now fail their obligations too.
    rc, out, err = _run(renamed)
    assert rc in (1, 3) and "not in kvactors.log_schema: tier_finalised" in out, out


def test_lines_no_log_holds_are_not_checked_and_never_a_traceback(tmp_path: Path,
                                                                 logs: dict[str, list[dict]]) -> None:
    """Nested past the parser's recursion limit, or a pid/manager that is a list or an object:
    counted, reported, INCONCLUSIVE (3), not exit 1 (a violation) with a traceback."""
    one = by_manager(logs["sim"])[0]
    good = "".join(json.dumps(e) + "\n" for e in one)
    cases = {
        "deep_line": "[" * 100_000 + "\n",
        "deep_field": json.dumps({**one[1], "extra": 0}).replace('"extra": 0', '"extra": ' + "[" * 3000 + "]" * 3000)
                      + "\n",
        "list_manager": json.dumps({**one[1], "manager": [0]}) + "\n",
        "dict_pid": json.dumps({**one[1], "pid": {"a": 1}}) + "\n",
    }
    for name, line in cases.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_text(good + line)
        rc, out, err = _run(path)
        assert rc == 3 and "INCONCLUSIVE" in out and "Traceback" not in err, (name, rc, out, err)
    for name in ("list_manager", "dict_pid"):  # parsed events, as check_events takes them
        result = check_events([*one, json.loads(cases[name])])
        assert result.verdict is Verdict.INCONCLUSIVE and "not an int or a str" in " ".join(result.inconclusive)


def test_finishes_a_tier_left_behind_at_the_stop_never_received_are_not_proven_either_way(
        logs: dict[str, list[dict]]) -> None:
    """Found with a stuck tier under vLLM: its actor, abandoned at the stop, logged no receipt."""
    one = next(m for m in by_manager(logs["sim"]) if any(e["event"] == "tier_finish_received" for e in m))
    tier = next(e["tier"] for e in one if e["event"] == "tier_finish_received")
    lost = [e for e in one if not (e["event"] == "tier_finish_received" and e["tier"] == tier)]
    renumbered = [{**e, "seq": i} for i, e in enumerate(lost)]
    assert check_events(renumbered).verdict is Verdict.VIOLATION  # a tier that simply never received them
    abandoned = [{**e, "abandoned": f"tier-{tier}"} if e["event"] == "manager_stopped" else e for e in renumbered]
    result = check_events(abandoned)
    assert result.verdict is Verdict.INCONCLUSIVE and not result.violations
    assert any(f"tier {tier}'s actor was left behind" in note for note in result.inconclusive)


def test_the_cli_in_a_fresh_process(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"\x00\x01garbage\n")
    proc = subprocess.run([sys.executable, "-m", "kvactors.cli", "check-log", str(bad)], capture_output=True,
                          text=True, cwd=ROOT, timeout=120, check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path) -> None:
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(bytes(range(256)) * 40)
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"event": "caf\xe9"}\n')
    huge = tmp_path / "huge.jsonl"
    huge.write_bytes(b"x" * (2 << 20))
    for path in (binary, latin, huge, tmp_path, tmp_path / "missing.jsonl"):
        rc, out, err = _run(path)
        assert rc == 2, (path, rc, err)
        assert err.count("\n") == 1 and err.startswith("kvactors check-log: error: "), err
        assert "Traceback" not in err and out == ""
    rc, out, err = _run(binary, "--max", "-1")
    assert rc == 2 and err.count("\n") == 1 and err.startswith("kvactors check-log: error: "), err


def test_a_truncated_last_line_is_normal(logs: dict[str, list[dict]]) -> None:
    one = by_manager(logs["sim"])[0]
    text = "".join(json.dumps(e) + "\n" for e in one) + '{"event": "request_sta'
    result = check_stream(io.BytesIO(text.encode()))
    assert result.verdict is Verdict.OK and result.unreadable == 0
    mid = "".join(json.dumps(e) + "\n" for e in one[:3]) + "{oops\n" + "".join(json.dumps(e) + "\n" for e in one[3:])
    assert check_stream(io.BytesIO(mid.encode())).verdict is Verdict.INCONCLUSIVE


def test_json_prints_only_json_and_help_shows_defaults(tmp_path: Path, logs: dict[str, list[dict]]) -> None:
    path = _write(tmp_path / "good.jsonl", logs["sim"])
    rc, out, _err = _run(path, "--json")
    assert rc == 0 and json.loads(out)["verdict"] == "OK"
    parser = argparse.ArgumentParser(prog="kvactors check-log")
    check_log.add_arguments(parser)
    assert "default: 50" in parser.format_help()


# ------------------------------------------------------------------ item 8: the schema

def test_the_emitted_names_and_the_checker_agree(logs: dict[str, list[dict]]) -> None:
    # The source's names against the schema: tests/test_log_schema.py (an ast scan of the package).
    handled = set(ManagerReplay(lambda v: None).handlers)
    assert handled == set(LIFECYCLE_EVENTS)
    emitted = {e["event"] for source in logs.values() for e in source}
    assert emitted <= LIFECYCLE_EVENTS
    # Not every name is emitted by these small runs (alarms, a stuck tier's reports); the core ones are:
    assert {"request_active_at_stop", "tier_finish_received", "promotion_submitted", "late_report_ignored"} <= emitted


def test_strict_mode_refuses_an_unknown_name(tmp_path: Path) -> None:
    from kvactors.log_schema import UnknownEventError
    from kvactors.logs import make_event_logger

    log, sink = make_event_logger(tmp_path / "x.jsonl", manager=0, pid=0)
    try:
        with pytest.raises(UnknownEventError):
            log.debug("tier_finalised", req_id="r", attempt=0, tier="t")
        with pytest.raises(UnknownEventError):
            log.debug("tier_finalized", req_id="r", attempt=0)  # a required field missing
    finally:
        sink.close()


# ------------------------------------------------------------------ item 9: memory

def _peak(template: list[dict], events: int) -> int:
    text = "".join(big_log(template, events, interleave=4)).encode()
    tracemalloc.start()
    try:
        result = check_stream(io.BytesIO(text))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.verdict is Verdict.OK, result.inconclusive[:2]
    return peak


@pytest.mark.timeout(300)
def test_memory_does_not_grow_with_the_log(logs: dict[str, list[dict]]) -> None:
    template = logs["sim"] + logs["threads"]
    small, large = _peak(template, 4_000), _peak(template, 40_000)
    assert large < 2 * small + (1 << 20), (small, large)


def test_the_checker_frees_a_manager_at_its_stop(logs: dict[str, list[dict]]) -> None:
    checker = LogChecker()
    for events in by_manager(logs["sim"]):
        for event in events:
            checker.feed(event)
    assert all(m.replay is None for m in checker.managers.values())


# ------------------------------------------------------------------ item 10: mutation score

@pytest.mark.timeout(600)
def test_mutation_score(logs: dict[str, list[dict]]) -> None:
    managers = by_manager(logs["sim"])[:6] + by_manager(logs["threads"])
    result = score(managers)
    assert result.tried > 1000
    assert result.share >= 0.99, result.uncaught.most_common(10)
    assert result.caught_by_kind["delete"] >= 0.99 * result.by_kind["delete"]
