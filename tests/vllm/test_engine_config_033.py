"""vLLM 0.33: what kvactors reads of the engine's VllmConfig at start, through the real Scheduler and connector.

* issue 34 item 3: with vLLM's default ``--shutdown-timeout 0``, one warning at engine start on vLLM's
  log (``vllm.kvactors``) and in the lifecycle log (``shutdown_timeout_zero``); none with a timeout;
* issue 34 item 4: the blocks' identity carries the weights' fingerprint, not the model's path
  (the same checkpoint copied to another path: the same identity; other weights: another).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import sys

import pytest

vllm = pytest.importorskip("vllm")
if not vllm.__version__.startswith("0.33"):
    pytest.skip("runs on vllm 0.33", allow_module_level=True)

sys.path.insert(0, os.path.dirname(__file__))
from sched_harness import BLOCK, LAYERS, Harness  # noqa: E402

from kvactors.logcheck import Verdict, check_file  # noqa: E402


def extra(tmp: str, **more: object) -> dict[str, object]:
    page_bytes = 2 * BLOCK * 8 * 2
    return {"spec_name": "KvactorsOffloadingSpec", "spec_module_path": "kvactors.integrations.vllm",
            "cpu_bytes_to_use": 8 * page_bytes * LAYERS, "tiers": [{"type": "memory", "capacity_blocks": 8}],
            "event_log": os.path.join(tmp, "events.kvlog"), **more}


def stop(h: Harness) -> None:
    h.connector.shutdown()
    h.worker.shutdown()


def events(tmp: str) -> list[dict[str, object]]:
    with open(os.path.join(tmp, "events.kvlog")) as f:
        return [json.loads(line) for line in f]


def write_weights(folder: str, seed: int) -> None:
    """One safetensors shard of made-up bytes (the fingerprint reads the file, not the model)."""
    data = bytes((seed * 31 + i * 7) % 251 for i in range(64 * 1024))
    header = json.dumps({"w": {"dtype": "F16", "shape": [32 * 1024], "data_offsets": [0, len(data)]}}).encode()
    with open(os.path.join(folder, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header + data)


@pytest.mark.timeout(120)
def test_shutdown_timeout_zero_is_said_once_at_start_on_both_logs(tmp_path, caplog):
    tmp = str(tmp_path)
    with caplog.at_level(logging.WARNING, logger="vllm.kvactors"):
        h = Harness(tmp, extra(tmp), num_gpu_blocks=24)
    try:
        said = [r for r in caplog.records if r.name == "vllm.kvactors" and "--shutdown-timeout 0" in r.getMessage()]
        assert len(said) == 1, [r.getMessage() for r in caplog.records]
        assert "INCONCLUSIVE" in said[0].getMessage() and "--shutdown-timeout 10" in said[0].getMessage()
    finally:
        stop(h)
    logged = [e for e in events(tmp) if e["event"] == "shutdown_timeout_zero"]
    assert len(logged) == 1 and logged[0]["shutdown_timeout_s"] == 0 and logged[0]["level"] == "warning"
    assert check_file(os.path.join(tmp, "events.kvlog")).verdict is Verdict.OK  # a noted start, not a violation


@pytest.mark.timeout(120)
def test_a_shutdown_timeout_says_nothing(tmp_path, caplog):
    tmp = str(tmp_path)
    with caplog.at_level(logging.WARNING, logger="vllm.kvactors"):
        h = Harness(tmp, extra(tmp), num_gpu_blocks=24, shutdown_timeout=10)
    stop(h)
    assert not [r for r in caplog.records if "--shutdown-timeout" in r.getMessage()]
    assert not [e for e in events(tmp) if e["event"] == "shutdown_timeout_zero"]


def _identity(tmp: str, caplog: pytest.LogCaptureFixture) -> dict[str, object]:
    """Start an engine on ``tmp``'s model and return its logged block identity."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvactors"):
        h = Harness(tmp, extra(tmp), num_gpu_blocks=24, shutdown_timeout=10)
    stop(h)
    (record,) = [r for r in caplog.records if getattr(r, "kvactors_event", {}).get("event") == "block_identity"]
    return dict(record.kvactors_event)


@pytest.mark.timeout(240)
def test_the_identity_follows_the_weights_not_the_path(tmp_path, caplog):
    a, b, c = (str(tmp_path / n) for n in ("a", "b", "c"))
    os.makedirs(os.path.join(a, "model"))
    write_weights(os.path.join(a, "model"), seed=1)
    first = _identity(a, caplog)
    assert "weights" in first and "model" not in first
    shutil.copytree(os.path.join(a, "model"), os.path.join(b, "model"))  # the same checkpoint, another path
    assert _identity(b, caplog)["identity"] == first["identity"]
    os.makedirs(os.path.join(c, "model"))
    write_weights(os.path.join(c, "model"), seed=2)  # other weights
    assert _identity(c, caplog)["identity"] != first["identity"]
