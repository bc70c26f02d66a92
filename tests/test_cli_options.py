"""Every bad option of ``kvactors stress`` and ``kvactors simulate`` is one line and exit status 2.

Each hostile value runs the real command line, ``kvactors`` as ``python -m
kvactors`` would run it, in a process of its own: a driver process imports
kvactors once and forks one child per case (a fresh ``python -m kvactors`` costs
seconds of torch import; hundreds of cases would take minutes). The child's
stdout and stderr are files, its working directory and ``TMPDIR`` empty
directories of the case, and its exit status the command's. A few cases also run
as a plain ``python -m kvactors`` subprocess, to show the driver changes nothing.

Also here: the consistency of the two commands (names, sizes, defaults in
``--help``, ``--seconds`` alone, ``--json``, temporary files, ``--event-log``
onto an existing file, Ctrl-C).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
ENV.pop("KVACTORS_EVENT_LOG", None)

# --------------------------------------------------------------------- the hostile values

INTS = ["0", "-3", "1" + "0" * 30, "nan", "inf", "x", "", "1.5", "16KiB"]
SECONDS = ["0", "-5", "1e30", "nan", "inf", "-inf", "x", ""]
PROBABILITIES = ["-0.1", "2", "nan", "inf", "x", ""]
SIZES = ["0", "-1", "1EiB", "10000000PiB", "nan", "inf", "x", "", "16KiBs", "16 parsecs", "1.5", "0.3KiB"]
DIRS = ["/etc/passwd", "/etc/passwd/below", "", "/proc/kvactors-cannot-be-made"]
FILES = ["{tmp}", "", "/etc/passwd/events.jsonl", "{tmp}/"]
SEEDS = ["-1", str(2**64), "nan", "x", "", "1.5"]
FAULTS = ["0.05", "fail=x", "fail=2", "fail=nan", "fail=-1", "nosuch=0.1", "", "fail=0.5,fail=0.1",
          "fail=0.6,stall=0.6", "fail", ",", "fail=0.1,,slow=0.1", "=0.1",
          "partial=2", "lie=x", "hang=-1", "hang=nan", "partial=0.6,lie=0.6", "fail=0.5,lie=0.6", "hang=0.1,hang=0.2",
          "hang_s=1", "raise_=0.1"]
TIER_LISTS = ["memory,memory", "", "nosuch", "memory,", ",", "MEMORY", "disk, disk"]
REDIS = ["redis://127.0.0.1:1", "nonsense://x", "", "redis://127.0.0.1:notaport"]


def _cases(option: str, values: list[str]) -> list[list[str]]:
    return [[f"{option}={value}"] for value in values]


COMMON: list[list[str]] = [
    *_cases("--threads", INTS), *_cases("--requests", INTS), *_cases("--seconds", SECONDS),
    *_cases("--seed", SEEDS), *_cases("--block-bytes", SIZES), *_cases("--cpu-blocks", INTS),
    *_cases("--num-blocks", INTS), *_cases("--disk-dir", DIRS), *_cases("--disk-bytes", SIZES),
    *_cases("--redis", REDIS), *_cases("--redis-bytes", SIZES), *_cases("--transfer-timeout", SECONDS),
    *_cases("--event-log", FILES),
    ["--event-log", "{existing}"],                  # an existing file, without --append-log
    ["--redis-bytes", "1MiB"],                      # without --redis
    ["--disk-bytes", "1000TiB"],                    # more than the disk holds
    ["--nosuch"], ["extra"], ["--threads"], ["--json=1"],
]
STRESS: list[list[str]] = [
    *COMMON,
    *_cases("--keys", INTS), *_cases("--workers", INTS), *_cases("--hang-after", SECONDS),
    *_cases("--switch-interval", [*SECONDS, "2"]), *_cases("--never-complete", PROBABILITIES),
    *_cases("--faults", FAULTS), *_cases("--tiers", TIER_LISTS),
    ["--tiers", "redis"],                           # no --redis URL
    ["--hang-after", "0.5", "--transfer-timeout", "1"],
    ["--cpu-blocks", "2000000", "--block-bytes", "1MiB"],   # more memory than there is
    ["--disk-bytes", "1KiB"],                       # fewer than 4 blocks
]
SIMULATE: list[list[str]] = [
    *COMMON,
    *_cases("--plot", ["out.txt", "{tmp}", "", "/etc/passwd/run.png", "run"]),
    *_cases("--device", ["tpu", ""]),
    ["--cpu-blocks", "100000000000"], ["--cpu-blocks", "2000000000"],  # the issue's, and one that fits an int
    ["--threads", "256", "--block-bytes", "1GiB", "--disk-bytes", "10GiB"],
    ["--cpu-blocks", "4"], ["--block-bytes", "16"], ["--quick", "--disk-bytes", "1KiB"],
]
# The cases the issue found, run as a plain ``python -m kvactors`` too.
PLAIN = [
    ("stress", ["--faults", "0.05"]), ("stress", ["--tiers", "memory,memory"]), ("stress", ["--keys", "0"]),
    ("stress", ["--redis", "redis://127.0.0.1:1"]), ("simulate", ["--plot", "out.txt"]),
    ("simulate", ["--cpu-blocks", "100000000000"]),
]

DRIVER = textwrap.dedent('''
    import json, os, runpy, signal, sys, tempfile, traceback
    import kvactors.cli, kvactors.commands.stress, kvactors.commands.simulate.command, redis  # imported once
    try:
        import matplotlib.backend_bases
    except ImportError:
        pass
    for line in sys.stdin:
        case = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            signal.alarm(20)  # a case that runs instead of failing at parse time is killed (exit status -14)
            try:
                os.chdir(case["cwd"])
                os.environ["TMPDIR"] = case["tmpdir"]
                tempfile.tempdir = None
                for fd, name in ((1, "stdout"), (2, "stderr")):
                    out = os.open(case[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                    os.dup2(out, fd)
                    os.close(out)
                sys.argv = ["kvactors", *case["argv"]]
                try:
                    runpy.run_module("kvactors", run_name="__main__", alter_sys=True)
                    code = 0
                except SystemExit as exc:
                    code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
                except BaseException:
                    traceback.print_exc()
                    code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)
''')


class Driver:
    """The forking driver: ``run(argv, case_dir)`` -> (exit status, stdout, stderr)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", DRIVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=ENV, cwd=str(ROOT))

    def run(self, argv: list[str], case_dir: Path) -> tuple[int, str, str]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        case = {"argv": argv, "cwd": str(case_dir / "cwd"), "tmpdir": str(case_dir / "tmp"),
                "stdout": str(case_dir / "stdout"), "stderr": str(case_dir / "stderr")}
        self.proc.stdin.write(json.dumps(case) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, "the driver died"
        return (json.loads(line)["rc"], (case_dir / "stdout").read_text(errors="replace"),
                (case_dir / "stderr").read_text(errors="replace"))

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(30)


@pytest.fixture(scope="module")
def driver() -> Iterator[Driver]:
    d = Driver()
    yield d
    d.close()


def _case_dir(tmp_path: Path) -> Path:
    for name in ("cwd", "tmp"):
        (tmp_path / name).mkdir()
    (tmp_path / "existing.jsonl").write_text('{"event": "manager_started"}\n')
    return tmp_path


def _argv(argv: list[str], case_dir: Path) -> list[str]:
    return [a.replace("{tmp}", str(case_dir / "tmp")).replace("{existing}", str(case_dir / "existing.jsonl"))
            for a in argv]


def _assert_one_line_error(command: str, rc: int, out: str, err: str, case_dir: Path) -> None:
    assert rc == 2, f"exit status {rc}\nstdout: {out[-2000:]}\nstderr: {err[-2000:]}"
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvactors {command}: error: "), err[-3000:]
    assert "Traceback" not in err
    assert out == ""
    assert list((case_dir / "tmp").iterdir()) == [], "temporary files left"
    assert list((case_dir / "cwd").iterdir()) == [], "files left in the working directory"


@pytest.mark.parametrize("argv", STRESS, ids=lambda a: " ".join(a))
@pytest.mark.timeout(30)
def test_every_bad_stress_option_is_one_line_and_exit_2(driver: Driver, tmp_path: Path, argv: list[str]) -> None:
    case_dir = _case_dir(tmp_path)
    rc, out, err = driver.run(["stress", *_argv(argv, case_dir)], case_dir)
    _assert_one_line_error("stress", rc, out, err, case_dir)


@pytest.mark.parametrize("argv", SIMULATE, ids=lambda a: " ".join(a))
@pytest.mark.timeout(30)
def test_every_bad_simulate_option_is_one_line_and_exit_2(driver: Driver, tmp_path: Path, argv: list[str]) -> None:
    case_dir = _case_dir(tmp_path)
    rc, out, err = driver.run(["simulate", *_argv(argv, case_dir)], case_dir)
    _assert_one_line_error("simulate", rc, out, err, case_dir)


@pytest.mark.parametrize(("command", "argv"), PLAIN, ids=lambda a: a if isinstance(a, str) else " ".join(a))
@pytest.mark.timeout(60)
def test_bad_options_as_a_plain_python_m_kvactors(tmp_path: Path, command: str, argv: list[str]) -> None:
    case_dir = _case_dir(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "kvactors", command, *argv], capture_output=True, text=True,
                          env={**ENV, "TMPDIR": str(case_dir / "tmp")}, cwd=case_dir / "cwd", timeout=50,
                          check=False)
    _assert_one_line_error(command, proc.returncode, proc.stdout, proc.stderr, case_dir)


# --------------------------------------------------------------------- consistency


def _parsers() -> dict[str, argparse.ArgumentParser]:
    from kvactors.cli import build_parser, subparsers

    found = subparsers(build_parser()[0])
    return {name: found[name] for name in ("stress", "simulate")}


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in parser._actions for s in a.option_strings if a.help is not argparse.SUPPRESS}


SHARED = {"--threads", "--requests", "--seconds", "--seed", "--block-bytes", "--cpu-blocks", "--disk-dir",
          "--disk-bytes", "--redis", "--redis-bytes", "--transfer-timeout", "--event-log", "--append-log", "--json",
          "--no-progress"}


def test_both_commands_share_the_option_names_and_take_the_old_ones_hidden() -> None:
    parsers = _parsers()
    for name, parser in parsers.items():
        assert set(_options(parser)) >= SHARED, (name, SHARED - set(_options(parser)))
        assert "--num-blocks" not in _options(parser)  # hidden: the old name still parses
        assert parser.parse_args(["--num-blocks", "32"]).cpu_blocks == 32
        assert "--num-blocks" not in parser.format_help()
        with pytest.raises(SystemExit) as exit_:  # both names: which one wins would be a guess
            parser.parse_args(["--num-blocks", "16", "--cpu-blocks", "32"])
        assert exit_.value.code == 2


@pytest.mark.parametrize("size", ["4096", "16KiB", "1MiB", "2GiB", "1.5MB", "64k"])
def test_sizes_take_the_same_suffixes_in_both_commands(size: str) -> None:
    from kvactors.commands.options import parse_size

    expected = parse_size(size)
    for parser in _parsers().values():
        for option in ("--block-bytes", "--disk-bytes", "--redis-bytes"):
            dest = option[2:].replace("-", "_")
            assert getattr(parser.parse_args([option, size]), dest) == expected


def test_help_shows_every_default_and_the_syntax() -> None:
    for name, parser in _parsers().items():
        for option, action in _options(parser).items():
            if action.nargs == 0:  # a flag: off unless given
                continue
            assert "default" in (action.help or ""), f"{name} {option}: no default in --help"
        text = parser.format_help()
        assert "SIZE: bytes, or with a suffix" in text and "exit status" in text
    stress_help = " ".join(_parsers()["stress"].format_help().split())
    assert "fail=0.05, raise=0.01, stall=0.001, slow=0.05, lookup_raise=0.01" in stress_help
    assert "NAME=P[,NAME=P...]" in stress_help


def test_parse_size_is_exact_and_bounded() -> None:
    from kvactors.commands.options import MAX_SIZE, parse_size

    assert parse_size("1.5KiB") == 1536 and parse_size("1PiB".replace("P", "T")) == 1 << 40
    assert parse_size(str(MAX_SIZE)) == MAX_SIZE
    for bad in ("1.0000000001KiB", str(MAX_SIZE + 1), "0.1", "1e3"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_size(bad)


def test_fault_spec_grammar() -> None:
    from kvactors.commands.options import fault_spec

    assert fault_spec("none") == {}
    assert fault_spec(" fail=0.5 , raise=0.5,lookup_raise=1") == {"fail": 0.5, "raise": 0.5, "lookup_raise": 1.0}
    with pytest.raises(argparse.ArgumentTypeError, match="add up to"):
        fault_spec("fail=0.5,stall=0.3,slow=0.3")
    assert fault_spec("partial=0.5,lie=0.5,hang=1") == {"partial": 0.5, "lie": 0.5, "hang": 1.0}
    with pytest.raises(argparse.ArgumentTypeError, match="add up to"):
        fault_spec("partial=0.5,lie=0.3,slow=0.3")


def test_an_existing_event_log_needs_append_log(tmp_path: Path) -> None:
    from kvactors.commands import stress
    from kvactors.commands.options import OptionError
    from kvactors.commands.simulate import command as simulate

    log = tmp_path / "events.jsonl"
    log.write_text("")
    for module in (stress, simulate):
        parser = argparse.ArgumentParser()
        module.add_arguments(parser)
        with pytest.raises(OptionError, match="--append-log"):
            module.plan(parser.parse_args(["--event-log", str(log)]))
        module.plan(parser.parse_args(["--event-log", str(log), "--append-log"]))


def test_stress_checks_the_event_log_the_environment_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --event-log the manager writes to $KVACTORS_EVENT_LOG: the same file, the same rule."""
    from kvactors.commands import stress
    from kvactors.commands.options import OptionError

    log = tmp_path / "events.jsonl"
    log.write_text("")
    monkeypatch.setenv("KVACTORS_EVENT_LOG", str(log))
    parser = argparse.ArgumentParser()
    stress.add_arguments(parser)
    with pytest.raises(OptionError, match=r"KVACTORS_EVENT_LOG .*--append-log"):
        stress.plan(parser.parse_args([]))
    assert stress.plan(parser.parse_args(["--append-log"])).event_log == str(log)
    other = tmp_path / "other.jsonl"
    assert stress.plan(parser.parse_args(["--event-log", str(other)])).event_log == str(other)
    monkeypatch.delenv("KVACTORS_EVENT_LOG")
    assert stress.plan(parser.parse_args([])).event_log is None


@pytest.mark.parametrize("value, error", [
    ("{dir}", "KVACTORS_EVENT_LOG: .*is a directory"),
    ("{dir}/", "KVACTORS_EVENT_LOG: .*is a directory"),
    ("   ", "KVACTORS_EVENT_LOG: the file name is empty"),
    ("{file}/below-a-file.jsonl", "KVACTORS_EVENT_LOG: "),
])
def test_stress_refuses_an_event_log_the_environment_names_badly(
    value: str, error: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvactors.commands import stress
    from kvactors.commands.options import OptionError

    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("KVACTORS_EVENT_LOG", value.format(dir=tmp_path, file=tmp_path / "a-file"))
    parser = argparse.ArgumentParser()
    stress.add_arguments(parser)
    for argv in ([], ["--append-log"]):
        with pytest.raises(OptionError, match=error):
            stress.plan(parser.parse_args(argv))


def test_stress_takes_a_relative_event_log_from_the_environment(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from kvactors.commands import stress

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KVACTORS_EVENT_LOG", "events.jsonl")
    parser = argparse.ArgumentParser()
    stress.add_arguments(parser)
    plan = stress.plan(parser.parse_args([]))
    assert plan.event_log == str(tmp_path / "events.jsonl") and plan.event_log_source == "KVACTORS_EVENT_LOG"


def test_prepare_dir_of_a_bare_file_name_is_the_current_directory(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from kvactors.commands.options import prepare_dir

    monkeypatch.chdir(tmp_path)
    created: list[str] = []
    prepare_dir("", "--event-log", created)  # os.path.dirname("events.jsonl"): it looped for ever
    assert created == []
    prepare_dir("new/sub", "--event-log", created)
    assert created == [str(tmp_path / "new"), str(tmp_path / "new" / "sub")]


def test_simulate_redis_capacity_is_its_own_option(tmp_path: Path) -> None:
    from kvactors.commands.simulate.runner import SimConfig, Simulation

    config = SimConfig(disk_dir=str(tmp_path), disk_bytes=1 << 20, redis_url="redis://127.0.0.1:1",
                       redis_bytes=3 << 20)
    disk, redis_tier = Simulation(config)._tiers()
    assert disk.capacity_bytes == 1 << 20 and redis_tier.capacity_bytes == 3 << 20
    redis_tier.shutdown()


def _stress_args(**overrides: Any) -> argparse.Namespace:
    from kvactors.commands import stress

    parser = argparse.ArgumentParser()
    stress.add_arguments(parser)
    args = parser.parse_args(["--no-progress"])
    for name, value in overrides.items():
        setattr(args, name, value)
    return args


@pytest.mark.timeout(60)
def test_stress_seconds_alone_runs_for_that_long() -> None:
    from kvactors.commands import stress

    summary = stress.run_stress(_stress_args(threads=1, seconds=3.0, seed=5))
    assert summary["seconds"] >= 3.0
    assert summary["requests"] > 200  # the per-thread default does not cut a run by time short
    assert stress.verdict(summary) == (0, None)


@pytest.mark.timeout(60)
def test_a_crash_of_the_workload_is_not_reported_as_violations(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvactors.commands import stress
    from kvactors.testing import workload

    calls = []

    def broken(self: Any) -> tuple[bytes, ...]:
        calls.append(1)
        if len(calls) > 20:
            raise ZeroDivisionError("a bug of the workload")
        return (workload.key_of(len(calls)),)

    monkeypatch.setattr(workload.WorkloadClient, "some_keys", broken)
    summary = stress.run_stress(_stress_args(threads=2, requests=50, seed=1))
    assert summary["workload_errors"] >= 1 and "ZeroDivisionError" in summary["workload_error_list"][0]
    assert summary["violations"] == 0 and summary["violation_list"] == []
    status, why = stress.verdict(summary)
    assert status == 3 and why is not None and "workload itself crashed" in why


def test_workload_config_refuses_a_shape_that_would_crash_it() -> None:
    from kvactors.testing.workload import WorkloadConfig

    for bad in ({"keys": 0}, {"clients": 0}, {"requests": -1}, {"store_outcomes": (0.8, 0.1, -1.9, 2.0)},
                {"p_reset": 2.0}):
        with pytest.raises(ValueError, match="WorkloadConfig"):
            WorkloadConfig(**bad)  # type: ignore[arg-type]


@pytest.mark.timeout(90)
def test_stress_json_is_alone_on_stdout_and_the_disk_tier_leaves_no_temporary_files(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.run([sys.executable, "-m", "kvactors", "stress", "--tiers", "memory,disk", "--threads", "2",
                           "--requests", "20", "--seed", "4", "--json"], capture_output=True, text=True,
                          env={**ENV, "TMPDIR": str(tmp)}, cwd=tmp_path, timeout=80, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, proc.stdout
    assert json.loads(lines[0])["requests"] == 40
    assert "violations" in proc.stderr  # the table went to stderr
    assert list(tmp.iterdir()) == []


@pytest.mark.timeout(60)
def test_simulate_json_is_alone_on_stdout(tmp_path: Path) -> None:
    from kvactors.cli import main

    out_file = tmp_path / "out"
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["simulate", "--quick", "--requests", "60", "--json", "--disk-dir", str(tmp_path / "disk"),
                   "--event-log", str(tmp_path / "events.jsonl")])
    out_file.write_text(out.getvalue())
    assert rc == 0, out.getvalue() + err.getvalue()
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["requests"] == 60
    assert "contract violations" in err.getvalue()


def _interrupt(argv: list[str], tmp_path: Path, signum: int = signal.SIGINT) -> tuple[int, str, str, Path]:
    """Start ``python -m kvactors ARGV``, send ``signum`` once it said it started; (status, stdout, stderr, TMPDIR)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    err_path = tmp_path / "stderr"
    with open(err_path, "w") as err_file:
        proc = subprocess.Popen([sys.executable, "-m", "kvactors", *argv], stdout=subprocess.PIPE,
                                stderr=err_file, text=True, env={**ENV, "TMPDIR": str(tmp)}, cwd=tmp_path)
        try:
            deadline = time.monotonic() + 60
            while "started" not in err_path.read_text() and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.05)  # polling the child's stderr: there is nothing to wait on
            assert "started" in err_path.read_text(), err_path.read_text()
            # Let the run get going (requests in flight, blocks on the disk) before the interrupt.
            log = tmp_path / "events.jsonl"
            while (not log.exists() or log.stat().st_size < 20_000) and time.monotonic() < deadline:
                time.sleep(0.05)
            proc.send_signal(signum)
            out, _ = proc.communicate(timeout=90)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return proc.returncode, out, err_path.read_text(), tmp


@pytest.mark.timeout(150)
@pytest.mark.parametrize("command", [
    ["stress", "--tiers", "memory,disk", "--seconds", "120", "--no-progress"],
    ["simulate", "--quick", "--seconds", "120", "--no-progress"],
], ids=lambda c: c[0])
@pytest.mark.parametrize(("signum", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["int", "term"])
def test_ctrl_c_or_sigterm_stops_cleanly_with_one_line(tmp_path: Path, command: list[str], signum: int,
                                                        status: int) -> None:
    rc, out, err, tmp = _interrupt([*command, "--event-log", str(tmp_path / "events.jsonl")], tmp_path, signum)
    assert rc == status, err[-3000:]
    lines = err.splitlines()
    assert lines[0].startswith(f"kvactors {command[0]}: started")
    assert len(lines) == 2 and lines[1].startswith(f"kvactors {command[0]}: interrupted"), err[-3000:]
    assert out == ""
    assert list(tmp.iterdir()) == [], "temporary files left"
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines() if line.strip()]
    assert events[-1]["event"] == "manager_stopped", events[-1]  # the manager was stopped, not abandoned


_SIGTERM_PRELUDE = textwrap.dedent("""
    import signal, sys
    import kvactors.commands.check_log as check_log
    from kvactors import cli

    def terminated_run(args):  # a command that says 130 for any interrupt
        try:
            signal.raise_signal(signal.SIGTERM)
            return 0
        except KeyboardInterrupt:
            return 130
    check_log.run = terminated_run
""")


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _SIGTERM_PRELUDE + textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=60, env=ENV)


def test_main_gives_its_signal_handlers_back_so_a_second_main_still_exits_143() -> None:
    proc = _python("""
        before = signal.getsignal(signal.SIGTERM)
        first = cli.main(["check-log", "x.jsonl"])
        assert signal.getsignal(signal.SIGTERM) == before, "main() left its SIGTERM handler behind"
        print(first, cli.main(["check-log", "x.jsonl"]))
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["143", "143"]


def test_a_sigterm_of_one_main_does_not_leak_into_the_next() -> None:
    """Once SIGTERM is the embedding program's (not the default), main() installs nothing;
    an interrupt in a later main() is still Ctrl-C's 130, on any thread."""
    proc = _python("""
        import threading
        first = cli.main(["check-log", "x.jsonl"])
        def interrupted(args):
            try:
                raise KeyboardInterrupt
            except KeyboardInterrupt:
                return 130
        check_log.run = interrupted
        signal.signal(signal.SIGTERM, lambda *args: None)
        second = cli.main(["check-log", "x.jsonl"])
        out = []
        thread = threading.Thread(target=lambda: out.append(cli.main(["check-log", "x.jsonl"])))
        thread.start()
        thread.join()
        print(first, second, out[0])
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["143", "130", "130"]


def test_a_sigterm_before_the_command_starts_is_one_line_and_143() -> None:
    proc = _python("""
        import kvactors.cli as cli_module
        real = cli_module.build_parser
        def parse_then_terminated():
            signal.raise_signal(signal.SIGTERM)
            return real()
        cli_module.build_parser = parse_then_terminated
        sys.exit(cli.main(["check-log", "x.jsonl"]))
    """)
    assert proc.returncode == 143, proc.stderr
    assert proc.stderr.strip() == "kvactors: interrupted"


def test_a_stress_run_with_a_hung_thread_exits_143_on_sigterm() -> None:
    proc = _python("""
        import kvactors.commands.stress as stress
        def hung(args, state):
            state["hung"] = True
            signal.raise_signal(signal.SIGTERM)
        stress.run_stress = hung
        sys.exit(cli.main(["stress", "--seconds", "1", "--no-progress"]))
    """)
    assert proc.returncode == 143, (proc.returncode, proc.stderr[-2000:])


@pytest.mark.parametrize("command", ["simulate", "stress"])
def test_the_help_gives_both_interrupt_statuses(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    from kvactors.cli import main

    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    assert "130 Ctrl-C" in out and "143 SIGTERM" in out


# --------------------------------------------------------------------- bools are not numbers

NUMERIC_TYPES = {"integer", "number", "parse_size"}


def _numeric_options() -> list[tuple[str, str]]:
    from kvactors.cli import build_parser, subparsers

    parser, _ = build_parser()
    return [(command, action.option_strings[-1])
            for command, sub in sorted(subparsers(parser).items()) for action in sub._actions
            if getattr(action.type, "__name__", None) in NUMERIC_TYPES]


NUMERIC_OPTIONS = _numeric_options()


def test_the_numeric_options_are_found():
    found = {option for _, option in NUMERIC_OPTIONS}
    assert {"--threads", "--requests", "--seconds", "--seed", "--block-bytes", "--cpu-blocks", "--keys",
            "--metrics-port", "--transfer-timeout"} <= found


@pytest.mark.parametrize(("command", "option"), NUMERIC_OPTIONS, ids=[f"{c} {o}" for c, o in NUMERIC_OPTIONS])
@pytest.mark.parametrize("value", ["True", "False", "true"])
def test_a_bool_given_to_a_numeric_option_is_refused_at_parse_time(command, option, value, capsys):
    from kvactors.cli import build_parser

    parser, _ = build_parser()
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args([command, f"{option}={value}"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"kvactors {command}: error: argument {option}")


def test_simulate_defaults_are_sim_configs():
    """One source: the command's defaults (and its --help) are SimConfig's, its --quick overrides some."""
    from kvactors.cli import build_parser
    from kvactors.commands.simulate import command
    from kvactors.commands.simulate.config import SimConfig

    parser, _ = build_parser()
    the_plan = command.plan(parser.parse_args(["simulate", "--device", "cpu"]))
    config = SimConfig()
    for name in ("threads", "requests", "block_bytes", "cpu_blocks", "disk_bytes", "redis_bytes"):
        assert getattr(the_plan, name) == getattr(config, name), name
    args = parser.parse_args(["simulate"])
    assert (args.seed, args.transfer_timeout) == (config.seed, config.transfer_timeout_s)
    quick = command.plan(parser.parse_args(["simulate", "--quick", "--device", "cpu"]))
    assert quick.threads == config.threads and quick.requests == command.QUICK["requests"] != config.requests
