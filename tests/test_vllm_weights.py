"""Identity by weights, not by path (issue 34 item 4): kvactors.integrations.vllm.weights, no vLLM needed.

Safetensors files are written by hand (8-byte header length, JSON header, data), as the format says,
so the tests need neither the safetensors package nor a model.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvactors.integrations.vllm.config import parse_config
from kvactors.integrations.vllm.engine_config import (
    SHUTDOWN_TIMEOUT_HINT_S,
    check_shutdown_timeout,
    find_vllm_config,
    shutdown_timeout,
)
from kvactors.integrations.vllm.identity import block_identity
from kvactors.integrations.vllm.weights import (
    MAX_HEADER_BYTES,
    SAMPLE_BYTES,
    SAMPLES,
    FingerprintError,
    IdentityBy,
    fingerprint_file,
    fingerprint_model,
    model_fingerprint,
    sample_offsets,
    weight_files,
)
from tests.test_vllm_identity import vllm_config as offloading_config

pytestmark = pytest.mark.timeout(60)

DTYPES = {torch.float16: "F16", torch.float32: "F32", torch.bfloat16: "BF16"}


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset, blobs = 0, []
    for name, t in tensors.items():
        data = t.contiguous().view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


def make_model(folder: Path, *, seed: int = 0, config: dict[str, Any] | None = None, big: int = 64 * 1024) -> Path:
    """A model folder: config.json, two shards (small tensors and one of ``big`` float32s), a tokenizer."""
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    (folder / "config.json").write_text(json.dumps(config or {"model_type": "llama", "hidden_size": 64}))
    write_safetensors(folder / "model-00001-of-00002.safetensors",
                      {"embed.weight": torch.randn(32, 16, generator=g, dtype=torch.float32).half(),
                       "norm.weight": torch.randn(16, generator=g)}, {"format": "pt"})
    write_safetensors(folder / "model-00002-of-00002.safetensors", {"big.weight": torch.randn(big, generator=g)})
    (folder / "tokenizer.json").write_text('{"not": "weights"}')
    return folder


def tensor_bytes_offset(path: Path, name: str) -> tuple[int, int]:
    """Where tensor ``name``'s bytes lie in the file: (start, end)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    start, end = json.loads(raw[8:8 + n])[name]["data_offsets"]
    return 8 + n + start, 8 + n + end


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


# ------------------------------------------------------------------ what changes the fingerprint


def test_the_same_weights_at_another_path_have_the_same_fingerprint(tmp_path: Path) -> None:
    a = make_model(tmp_path / "a")
    b = tmp_path / "mnt" / "b"
    shutil.copytree(a, b)
    fa, fb = fingerprint_model(str(a), cache=str(tmp_path / "c")), fingerprint_model(str(b), cache=str(tmp_path / "c"))
    assert fa.digest == fb.digest
    assert [f.method for f in fa.files] == ["config", "safetensors", "safetensors"]  # no tokenizer
    assert fingerprint_model(str(make_model(tmp_path / "other", seed=1))).digest != fa.digest


@pytest.mark.parametrize("where", ["first", "last", "middle_sample"])
def test_a_byte_changed_in_a_sample_of_a_tensor_changes_it(tmp_path: Path, where: str) -> None:
    model = make_model(tmp_path / "m")
    before = fingerprint_model(str(model)).digest
    shard = model / "model-00002-of-00002.safetensors"
    start, end = tensor_bytes_offset(shard, "big.weight")
    offsets = sample_offsets(start, end)
    at = {"first": start, "last": end - 1, "middle_sample": offsets[1][0] + 100}[where]
    flip(shard, at)
    assert fingerprint_model(str(model)).digest != before


def test_a_fine_tune_of_one_tensor_changes_it(tmp_path: Path) -> None:
    """A fine-tune changes the tensors it touches densely: every sample of them."""
    model = make_model(tmp_path / "m")
    before = fingerprint_model(str(model)).digest
    g = torch.Generator().manual_seed(0)
    torch.randn(32, 16, generator=g)
    torch.randn(16, generator=g)
    big = torch.randn(64 * 1024, generator=g)
    write_safetensors(model / "model-00002-of-00002.safetensors", {"big.weight": big + 1e-3 * torch.randn(big.shape)})
    assert fingerprint_model(str(model)).digest != before


def test_a_change_between_the_samples_of_a_tensor_is_not_seen(tmp_path: Path) -> None:
    """The documented blind spot: bytes of a tensor between its samples are not read."""
    model = make_model(tmp_path / "m")
    before = fingerprint_model(str(model))
    shard = model / "model-00002-of-00002.safetensors"
    start, end = tensor_bytes_offset(shard, "big.weight")
    offsets = sample_offsets(start, end)
    assert end - start == 256 * 1024 and len(offsets) == SAMPLES
    gap = offsets[0][0] + SAMPLE_BYTES + 10  # after the first sample, before the second
    assert gap < offsets[1][0]
    flip(shard, gap)
    assert fingerprint_model(str(model)).digest == before.digest


@pytest.mark.parametrize("change", ["config", "dtype", "shape", "metadata", "new_shard"])
def test_the_config_and_the_header_change_it(tmp_path: Path, change: str) -> None:
    model = make_model(tmp_path / "m")
    before = fingerprint_model(str(model)).digest
    shard = model / "model-00001-of-00002.safetensors"
    t = torch.zeros(32, 16, dtype=torch.float16)
    if change == "config":
        (model / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "rope_theta": 1e6}))
    elif change == "dtype":
        write_safetensors(shard, {"embed.weight": t.view(torch.bfloat16), "norm.weight": torch.zeros(16)})
        before = fingerprint_model(str(model)).digest
        write_safetensors(shard, {"embed.weight": t, "norm.weight": torch.zeros(16)})
    elif change == "shape":
        write_safetensors(shard, {"embed.weight": t, "norm.weight": torch.zeros(16)})
        before = fingerprint_model(str(model)).digest
        write_safetensors(shard, {"embed.weight": t.view(16, 32), "norm.weight": torch.zeros(16)})
    elif change == "metadata":
        write_safetensors(shard, {"embed.weight": t, "norm.weight": torch.zeros(16)}, {"format": "pt"})
        before = fingerprint_model(str(model)).digest
        write_safetensors(shard, {"embed.weight": t, "norm.weight": torch.zeros(16)}, {"format": "np"})
    else:
        write_safetensors(model / "model-extra.safetensors", {"x": torch.zeros(4)})
    assert fingerprint_model(str(model)).digest != before


def test_the_reads_are_bounded_by_the_tensor_count_not_the_size(tmp_path: Path) -> None:
    model = make_model(tmp_path / "m", big=4 * 1024 * 1024)  # a 16 MiB tensor
    fp = fingerprint_model(str(model))
    shards = [f for f in fp.files if f.method == "safetensors"]
    headers = sum(8 + struct.unpack("<Q", (model / f.name).read_bytes()[:8])[0] for f in shards)
    assert fp.bytes_read - (model / "config.json").stat().st_size <= headers + 3 * SAMPLES * SAMPLE_BYTES
    assert fp.describe()["methods"] == {"config": 1, "safetensors": 2}


# ------------------------------------------------------------------ other formats and the cache


def test_a_torch_zip_checkpoint_is_read_by_its_directory_and_samples(tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    state = {"w": torch.randn(100_000), "b": torch.randn(10)}
    torch.save(state, model / "pytorch_model.bin")
    fp = fingerprint_model(str(model), cache=str(tmp_path / "c"))
    assert [f.method for f in fp.files] == ["config", "torch-zip"]
    assert fp.bytes_read < 100_000  # not the 400 KB of the tensor
    copy = tmp_path / "copy"
    shutil.copytree(model, copy)
    assert fingerprint_model(str(copy), cache=str(tmp_path / "c")).digest == fp.digest
    state["w"][50_000] += 1.0  # one element: its record's CRC-32 changes
    torch.save(state, model / "pytorch_model.bin")
    assert fingerprint_model(str(model), cache=str(tmp_path / "c")).digest != fp.digest


def test_other_formats_are_hashed_whole_once_then_cached_by_size_and_time(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    model = tmp_path / "m"
    model.mkdir()
    weights = model / "model.gguf"
    weights.write_bytes(os.urandom(100_000))
    first = fingerprint_model(str(model))
    assert [(f.method, f.bytes_read) for f in first.files] == [("whole", 100_000)]
    assert list((tmp_path / "xdg" / "kvactors" / "weights").glob("*.json"))
    second = fingerprint_model(str(model))
    assert [(f.method, f.bytes_read) for f in second.files] == [("whole-cached", 0)]
    assert second.digest == first.digest
    data = bytearray(weights.read_bytes())
    data[5] ^= 1
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))  # a new time
    third = fingerprint_model(str(model))
    assert third.files[0].method == "whole" and third.digest != first.digest


def test_a_corrupt_cache_entry_is_recomputed(tmp_path: Path) -> None:
    weights = tmp_path / "w.gguf"
    weights.write_bytes(b"x" * 1000)
    cache = tmp_path / "c"
    good = fingerprint_file(str(weights), cache=str(cache))
    for entry in cache.glob("*.json"):
        entry.write_text("{garbage")
    again = fingerprint_file(str(weights), cache=str(cache))
    assert (again.method, again.digest) == ("whole", good.digest)


def test_safetensors_come_first_as_vllm_picks_them(tmp_path: Path) -> None:
    model = make_model(tmp_path / "m")
    torch.save({"w": torch.zeros(3)}, model / "pytorch_model.bin")
    (model / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    assert weight_files(str(model)) == ["config.json", "model-00001-of-00002.safetensors",
                                        "model-00002-of-00002.safetensors", "model.safetensors.index.json"]


# ------------------------------------------------------------------ hostile inputs


@pytest.mark.parametrize("content", [
    b"abc",                                                           # shorter than the length
    struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{}",                  # a huge header length
    struct.pack("<Q", 1000) + b"{}",                                  # a length past the end
    struct.pack("<Q", 6) + b"\xff\xfe{}}}",                           # not JSON
    struct.pack("<Q", 2) + b"[]",                                     # not an object
    struct.pack("<Q", 45) + b'{"t": {"dtype": "F32", "data_offsets": [0, 99]}}',  # outside the data
    struct.pack("<Q", 40) + b'{"t": {"dtype": "F32", "data_offsets": 7}}',        # not offsets
])
def test_a_broken_safetensors_file_is_hashed_whole_never_raises(tmp_path: Path, content: bytes) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "model.safetensors").write_bytes(content)
    fp = fingerprint_model(str(model), cache=str(tmp_path / "c"))
    (part,) = fp.files
    assert part.method == "whole" and part.bytes_read == len(content)
    assert "unreadable header" in fp.notes[0]
    (model / "model.safetensors").write_bytes(content + b"x")
    assert fingerprint_model(str(model), cache=str(tmp_path / "c")).digest != fp.digest


def test_missing_or_empty_models_are_a_fingerprint_error(tmp_path: Path) -> None:
    with pytest.raises(FingerprintError, match="not a local folder or file"):
        fingerprint_model(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(FingerprintError, match="no weights file"):
        fingerprint_model(str(tmp_path / "empty"))
    assert issubclass(FingerprintError, ValueError)


def test_an_unreadable_weights_file_is_a_fingerprint_error(tmp_path: Path) -> None:
    model = make_model(tmp_path / "m")
    os.symlink(tmp_path / "gone.safetensors", model / "model-00003.safetensors")  # dangling: not a file
    assert "model-00003.safetensors" not in weight_files(str(model))
    if os.geteuid() != 0:  # root reads files whatever their mode
        (model / "model-00002-of-00002.safetensors").chmod(0)
        with pytest.raises(FingerprintError):
            fingerprint_model(str(model))


# ------------------------------------------------------------------ in the identity


def test_the_identity_carries_the_weights_not_the_path(tmp_path: Path) -> None:
    cfg_a, cfg_b = offloading_config(name="/models/a"), offloading_config(name="/mnt/b")
    a = block_identity(cfg_a, model_id=None, block_bytes=4096, weights="ab" * 32)
    assert "model" not in a.fields and a.fields["weights"] == "ab" * 32
    assert block_identity(cfg_b, model_id=None, block_bytes=4096, weights="ab" * 32).digest == a.digest
    assert block_identity(cfg_a, model_id=None, block_bytes=4096, weights="cd" * 32).digest != a.digest
    # model_id is the operator's override: the weights are not part of it then.
    named = block_identity(cfg_a, model_id="org/m@v1", block_bytes=4096, weights="ab" * 32)
    assert named.fields["model"] == "org/m@v1" and "weights" not in named.fields
    with pytest.raises(ValueError, match="weights"):
        block_identity(cfg_a, model_id=None, block_bytes=4096, weights="")


def test_identity_by_is_checked(tmp_path: Path) -> None:
    assert parse_config({"cpu_bytes_to_use": 1 << 20}).identity_by is IdentityBy.WEIGHTS
    assert parse_config({"cpu_bytes_to_use": 1 << 20, "identity_by": "name"}).identity_by is IdentityBy.NAME
    for bad in ("path", ["weights"], None, 1):
        with pytest.raises(ValueError, match="identity_by must be one of"):
            parse_config({"cpu_bytes_to_use": 1 << 20, "identity_by": bad})


def test_model_fingerprint_falls_back_to_the_name_with_a_warning(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    model = make_model(tmp_path / "m")
    assert model_fingerprint(str(model), None, model_id=None, identity_by=IdentityBy.WEIGHTS) == \
        fingerprint_model(str(model)).digest
    assert model_fingerprint(str(model), None, model_id="x", identity_by=IdentityBy.WEIGHTS) is None
    assert model_fingerprint(str(model), None, model_id=None, identity_by=IdentityBy.NAME) is None
    with caplog.at_level(logging.WARNING):
        assert model_fingerprint(str(tmp_path / "gone"), None, model_id=None, identity_by=IdentityBy.WEIGHTS) is None
    assert any(r.name == "vllm.kvactors" and "could not be fingerprinted" in r.getMessage() for r in caplog.records)
    assert any(getattr(r, "kvactors_event", {}).get("event") == "weights_fingerprint_failed" for r in caplog.records)


# ------------------------------------------------------------------ the shutdown-timeout warning


class VllmConfig(SimpleNamespace):
    """Stands in for vLLM's ``VllmConfig`` (found by its class name and a module under ``vllm.``)."""


VllmConfig.__module__ = "vllm.config.vllm"


def _connector(vllm_config: Any) -> Any:
    """A caller as vLLM's OffloadingConnector is: its ``vllm_config`` two frames above the finder."""
    def create_spec() -> Any:
        return find_vllm_config()
    return create_spec()


def test_the_vllm_config_is_found_in_the_callers_frames_or_not_at_all() -> None:
    config = VllmConfig(shutdown_timeout=0)
    assert _connector(config) is config
    assert _connector(SimpleNamespace(shutdown_timeout=0)) is None  # not a VllmConfig
    assert find_vllm_config() is None
    assert shutdown_timeout(VllmConfig(shutdown_timeout=7)) == 7
    assert shutdown_timeout(None) is None and shutdown_timeout(VllmConfig(shutdown_timeout=True)) is None


def test_shutdown_timeout_zero_is_said_on_vllms_log_and_the_lifecycle_log(caplog: pytest.LogCaptureFixture) -> None:
    events: list[tuple[str, dict[str, Any]]] = []

    class Log:
        def warning(self, event: str, **fields: Any) -> None:
            events.append((event, fields))

    with caplog.at_level(logging.WARNING, logger="vllm.kvactors"):
        assert check_shutdown_timeout(VllmConfig(shutdown_timeout=0), Log())
        assert not check_shutdown_timeout(VllmConfig(shutdown_timeout=10), Log())
        assert not check_shutdown_timeout(None, Log())
    (record,) = [r for r in caplog.records if r.name == "vllm.kvactors"]
    assert "--shutdown-timeout 0" in record.getMessage() and f"--shutdown-timeout {SHUTDOWN_TIMEOUT_HINT_S}" in \
        record.getMessage() and "INCONCLUSIVE" in record.getMessage()
    assert events == [("shutdown_timeout_zero", {"shutdown_timeout_s": 0, "recommended_s": SHUTDOWN_TIMEOUT_HINT_S})]


def test_check_log_names_the_shutdown_timeout_as_the_cause_of_an_unproven_stop() -> None:
    from kvactors.logcheck import Verdict, check_events

    def ev(seq: int, event: str, level: str = "info", **fields: Any) -> dict[str, Any]:
        return {"event": event, "level": level, "seq": seq, "manager": 1, "pid": 7, "thread": "t",
                "timestamp": "2026-01-01T00:00:00Z", **fields}

    started = ev(0, "manager_started", tiers="cpu,disk", num_blocks=4, block_bytes=64)
    warned = ev(1, "shutdown_timeout_zero", "warning", shutdown_timeout_s=0)
    unproven = check_events([started, warned])
    assert unproven.verdict is Verdict.INCONCLUSIVE
    assert any("--shutdown-timeout 0" in note for note in unproven.inconclusive), unproven.inconclusive
    plain = check_events([started])
    assert plain.verdict is Verdict.INCONCLUSIVE and not any("--shutdown-timeout" in n for n in plain.inconclusive)
    stopped = check_events([started, warned, ev(2, "manager_stopped")])
    assert stopped.verdict is Verdict.OK
