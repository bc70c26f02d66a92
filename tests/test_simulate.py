"""``kvactors simulate``: the quick run is clean, bad options are clear errors, the plot is written."""

from __future__ import annotations

import json

import pytest
import torch

from kvactors import DiskTier, LookupResult, ReqContext, TieringManager
from kvactors.cli import main
from kvactors.commands.simulate.command import parse_size
from kvactors.commands.simulate.instrument import observe
from kvactors.commands.simulate.run_metrics import percentile
from kvactors.commands.simulate.traffic import BlockBytes, Workload
from kvactors.testing.recorder import TierRecord


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        rc = main(["simulate", *argv])
    except SystemExit as exc:  # argparse errors
        rc = int(exc.code or 0)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.timeout(90)
def test_quick_run_is_clean(tmp_path, capsys):
    rc, out, err = run_cli(capsys, "--quick", "--json", "--disk-dir", str(tmp_path / "disk"),
                           "--event-log", str(tmp_path / "events.jsonl"))
    result = json.loads(out.strip().splitlines()[-1])
    assert rc == 0, out + err
    assert result["violations"] == 0
    assert result["mismatches"] == 0
    assert result["leaks"] == 0
    assert result["frontend_errors"] == 0
    assert result["hit_rate"] > 0
    # The CPU pool is small: blocks must come back from the disk too.
    assert result["hit_rate_by_tier"]["disk"] > 0
    assert result["requests"] == 1500 and result["preemptions"] > 0 and result["aborts"] > 0
    for name in ("offload_gbps", "onboard_gbps"):
        assert result[name] > 0
    assert (tmp_path / "events.jsonl").stat().st_size > 0
    assert len(out.splitlines()) == 1  # --json: only the JSON on stdout, the table on stderr
    assert "contract violations" in err and "Traceback" not in out + err


@pytest.mark.timeout(60)
def test_short_run_with_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "run.png"
    rc, out, err = run_cli(capsys, "--quick", "--requests", "150", "--threads", "3", "--json",
                           "--disk-dir", str(tmp_path / "disk"), "--plot", str(png),
                           "--event-log", str(tmp_path / "events.jsonl"))
    assert rc == 0, out + err
    assert png.read_bytes().startswith(b"\x89PNG")
    assert json.loads(out.strip().splitlines()[-1])["requests"] == 150


@pytest.mark.timeout(60)
def test_seconds_bounds_the_run(tmp_path, capsys):
    rc, out, err = run_cli(capsys, "--quick", "--seconds", "1", "--json", "--disk-dir", str(tmp_path / "d"),
                           "--event-log", str(tmp_path / "events.jsonl"))
    assert rc == 0, out + err
    result = json.loads(out.strip().splitlines()[-1])
    assert result["requests"] > 0 and result["seconds"] < 10


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--threads", "-2"], "--threads: must be > 0"),
        (["--requests", "0"], "--requests: must be > 0"),
        (["--block-bytes=-4KiB"], "--block-bytes: size must be"),
        (["--disk-bytes", "-1"], "--disk-bytes: size must be"),
        (["--disk-bytes", "lots"], "--disk-bytes: invalid size"),
        (["--cpu-blocks", "4"], "--cpu-blocks must be at least"),
        (["--block-bytes", "16"], "--block-bytes must be at least"),
        (["--seconds", "-1"], "--seconds: must be > 0"),
        (["--redis", "redis://127.0.0.1:1"], "--redis: redis://127.0.0.1:1: the server does not answer"),
        (["--redis", "nonsense://x"], "--redis: nonsense://x"),
    ],
)
@pytest.mark.timeout(30)
def test_bad_options_are_clear_errors(argv, message, capsys):
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 2
    assert "kvactors simulate: error:" in err and message in err, err
    assert "Traceback" not in out + err


@pytest.mark.timeout(30)
def test_unwritable_disk_dir_is_a_clear_error(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    for path in (blocker, blocker / "below"):
        rc, out, err = run_cli(capsys, "--quick", "--disk-dir", str(path))
        assert rc == 2
        assert f"kvactors simulate: error: argument --disk-dir: {path}" in err, err
        assert "Traceback" not in out + err


@pytest.mark.timeout(60)
def test_a_plot_into_a_new_folder_is_made_and_one_that_cannot_be_is_refused_before_the_run(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "new" / "deeper" / "run.png"
    rc, out, err = run_cli(capsys, "--quick", "--requests", "50", "--threads", "2", "--disk-dir",
                           str(tmp_path / "disk"), "--plot", str(png), "--event-log", str(tmp_path / "a.jsonl"))
    assert rc == 0, out + err
    assert png.read_bytes().startswith(b"\x89PNG")
    rc, out, err = run_cli(capsys, "--quick", "--plot", "/proc/kvactors-no-such/run.png",
                           "--event-log", str(tmp_path / "b.jsonl"))
    assert rc == 2 and err.startswith("kvactors simulate: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in out + err and not (tmp_path / "b.jsonl").exists()  # refused before the run


def test_parse_size():
    assert parse_size("4096") == 4096
    assert parse_size("256KiB") == 256 * 1024
    assert parse_size("1GiB") == 1 << 30
    assert parse_size("1.5MB") == 1_500_000
    assert parse_size("64k") == 65536


def test_block_bytes_detect_swaps_and_shifts():
    blocks = BlockBytes(4096, seed=3)
    a, b = blocks.expected(b"a"), blocks.expected(b"b")
    assert blocks.matches(a, b"a") and not blocks.matches(a, b"b") and not blocks.matches(b, b"a")
    assert not blocks.matches(torch.roll(a, 64), b"a")
    stale = a.clone()
    stale[-1] ^= 1
    assert not blocks.matches(stale, b"a")


def test_workload_shares_prefixes():
    workload = Workload(seed=1, block_bytes=4096)
    for _ in range(1000):  # a conversation with more than one turn
        conv, first = workload.next_turn()
        if conv.turns_left > 1:
            break
        workload.turn_done(conv, first, completed=False)
    workload.turn_done(conv, first, completed=True)
    for _ in range(1000):  # its next turn extends the previous one: prompt and response
        conv2, turn = workload.next_turn()
        if conv2 is conv:
            assert turn.prompt_keys[: len(first.keys)] == first.keys
            assert len(turn.prompt_keys) > len(first.keys)
            return
        workload.turn_done(conv2, turn, completed=False)
    raise AssertionError("the conversation never came back")


def test_percentile():
    assert percentile([], 50) == 0.0
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile(list(map(float, range(1, 101))), 99) == 99.0


@pytest.mark.timeout(30)
def test_observed_tier_delegates_and_records(tmp_path):
    observer = TierRecord()
    [tier] = observe([DiskTier(tmp_path, capacity_bytes=1 << 20)], observer)
    with TieringManager.start(num_blocks=8, block_bytes=256, secondary_tiers=[tier]) as manager:
        ctx = ReqContext("r")
        manager.on_new_request(ctx)
        out = manager.prepare_store([b"k"], ctx)
        manager.complete_store(out.keys_to_store, ctx)
        manager.on_request_finished(ctx)
        assert manager.wait_idle(10)
        manager.reset_cache()
        ctx2 = ReqContext("r2")
        manager.on_new_request(ctx2)
        assert manager.lookup([b"k"], ctx2) == [LookupResult.HIT_PENDING]
        manager.on_request_finished(ctx2)
        assert manager.wait_idle(10)
    assert observer.cascaded_blocks == {"disk": 1}
    assert observer.promotions == {"disk": 1} and observer.promotion_of(b"k")[0] == "disk"
    assert observer.finalized_time(ctx, ["disk"]) is not None
    assert observer.finalized_time(ctx2, ["disk"]) is not None
    assert observer.violations == []


def test_check_log_is_run_and_only_its_ok_verdict_is_ok(monkeypatch, tmp_path):
    from kvactors.commands import check_log
    from kvactors.commands.simulate import command as simulate

    seen: list[str] = []
    verdict = {"rc": 0, "line": "3 requests, 0 violations"}

    def run(args):
        seen.append(args.file)
        print(verdict["line"])
        return verdict["rc"]

    monkeypatch.setattr(check_log, "run", run)
    assert simulate._check_log("events.jsonl") == ("ok: 3 requests, 0 violations", True)
    assert seen == ["events.jsonl"]
    for rc, line in ((1, "1 violation"), (3, "INCONCLUSIVE: the manager never stopped")):
        verdict.update(rc=rc, line=line)
        assert simulate._check_log("events.jsonl") == (f"FAILED (exit {rc}): {line}", False)
    monkeypatch.undo()
    # The real checker: an empty log proves nothing, so the run's check fails.
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    result, ok = simulate._check_log(str(empty))
    assert not ok and result.startswith("FAILED (exit 3)")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_cuda_without_a_device_is_a_clear_error(capsys):
    rc, out, err = run_cli(capsys, "--device", "cuda")
    assert rc == 2 and "kvactors simulate: error: --device cuda: no CUDA device" in err
    assert "Traceback" not in out + err
