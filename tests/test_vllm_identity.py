"""Blocks of one model and layout never reach another: the identity, the ``model_id`` key, ``PrefixedTier``.

No vLLM needed: vLLM's ``OffloadingConfig`` is stood in for by plain objects of the same
attributes (``kvactors.integrations.vllm.identity`` reads it by attribute). The whole engine
is in tests/vllm/test_engine_032.py (``test_another_model_on_the_same_disk_root_...``).
"""

from __future__ import annotations

import logging
import queue
import uuid
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvactors.integrations.vllm.config import MAX_MODEL_ID_CHARS, TOP_LEVEL_KEYS, build_tiers, parse_config
from kvactors.integrations.vllm.identity import PREFIX_BYTES, ROW_FORMAT, BlockIdentity, block_identity
from kvactors.tiers.base import SecondaryTier
from kvactors.tiers.disk import DiskTier
from kvactors.tiers.memory import MemoryTier
from kvactors.tiers.prefixed import PrefixedTier
from kvactors.types import JobResult, LookupResult, OffloadingEvent, OffloadKey, ReqContext, TransferJob

HIT, MISS = LookupResult.HIT, LookupResult.MISS
CTX = ReqContext("r")
BLOCK = 1024


# ------------------------------------------------------------------ the identity


def vllm_config(**change: Any) -> SimpleNamespace:
    """A stand-in for vLLM 0.33's ``OffloadingConfig`` (the attributes identity.py reads, and some it must not)."""
    fields: dict[str, Any] = {
        "name": "/models/llama", "dtype": "bfloat16", "tokens_per_hash": 32, "blocks_per_chunk": 1,
        "tokens_per_block": 32, "layer_names": ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"),
        "group_id": 0, "rank": 0, "world_size": 1, "tp_size": 1, "pp_size": 1, "pcp_size": 1, "dcp_size": 1,
        "data_parallel_index": 0, "data_parallel_size": 1, "worker_kv_bytes_per_block": 16384,
        "engine_id": "e0", "max_model_len": 256, "replicated_layout": False, "canonical_layout": False,
        "kv_cache_layout": None, "extra_config": {}, "enable_kv_cache_events": False,
    }
    fields.update(change)
    f = SimpleNamespace(**fields)
    return SimpleNamespace(
        groups=(SimpleNamespace(tokens_per_block=f.tokens_per_block, layer_names=f.layer_names, group_id=f.group_id),),
        worker_kv_bytes_per_block=f.worker_kv_bytes_per_block, enable_kv_cache_events=f.enable_kv_cache_events,
        extra_config=f.extra_config, engine_id=f.engine_id,
        model=SimpleNamespace(name=f.name, dtype=f.dtype, max_model_len=f.max_model_len),
        cache=SimpleNamespace(tokens_per_hash=f.tokens_per_hash, blocks_per_chunk=f.blocks_per_chunk),
        parallel=SimpleNamespace(rank=f.rank, world_size=f.world_size, tp_size=f.tp_size, pp_size=f.pp_size,
                                 pcp_size=f.pcp_size, dcp_size=f.dcp_size, data_parallel_index=f.data_parallel_index,
                                 data_parallel_size=f.data_parallel_size, data_parallel_rank_local=None,
                                 is_parallelism_agnostic=False),
        replicated_layout=f.replicated_layout, canonical_layout=f.canonical_layout, kv_cache_layout=f.kv_cache_layout,
    )


def digest(model_id: str | None = None, block_bytes: int = 16384, **change: Any) -> bytes:
    return block_identity(vllm_config(**change), model_id=model_id, block_bytes=block_bytes).digest


def test_the_identity_is_the_fields_of_file_mapper_and_the_row_and_its_digest_is_fixed() -> None:
    identity = block_identity(vllm_config(), model_id=None, block_bytes=16384)
    assert identity.fields == {
        "row_format": ROW_FORMAT, "model": "/models/llama", "dtype": "bfloat16", "tokens_per_hash": 32,
        "blocks_per_chunk": 1,
        "groups": [{"group_id": 0, "tokens_per_block": 32,
                    "layer_names": ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]}],
        "world_size": 1, "tp_size": 1, "pp_size": 1, "pcp_size": 1, "dcp_size": 1,
        "worker_kv_bytes_per_block": 16384, "block_bytes": 16384,
    }
    assert len(identity.digest) == PREFIX_BYTES
    # Pinned: a digest that changes makes every block of every deployment a miss after an upgrade.
    # Change it only with the fields, on purpose.
    assert identity.digest.hex() == "2965e24d310cba81"
    assert BlockIdentity(dict(identity.fields)).digest == identity.digest  # from the fields alone
    assert identity.describe()["identity"] == identity.digest.hex()


@pytest.mark.parametrize("change", [
    {"name": "/models/llama-finetune"}, {"dtype": "float16"}, {"dtype": "fp8_e4m3"}, {"tokens_per_hash": 16},
    {"blocks_per_chunk": 2}, {"tokens_per_block": 64}, {"layer_names": ("model.layers.0.self_attn.attn",)},
    {"group_id": 1}, {"world_size": 2, "tp_size": 2}, {"world_size": 2, "pp_size": 2}, {"pcp_size": 2},
    {"dcp_size": 2}, {"worker_kv_bytes_per_block": 8192}, {"block_bytes": 32768}, {"kv_cache_layout": "HND"},
    {"replicated_layout": True}, {"canonical_layout": True},
], ids=lambda change: ",".join(change))
def test_every_field_the_bytes_depend_on_changes_the_digest(change: dict[str, Any]) -> None:
    assert digest(**change) != digest()


@pytest.mark.parametrize("change", [
    {"rank": 1}, {"data_parallel_index": 3}, {"data_parallel_size": 4}, {"engine_id": "e7"},
    {"max_model_len": 4096}, {"extra_config": {"cpu_bytes_to_use": 1}}, {"enable_kv_cache_events": True},
], ids=lambda change: ",".join(change))
def test_what_the_rows_do_not_depend_on_leaves_the_digest_alone(change: dict[str, Any]) -> None:
    """The rank: a row holds every rank's pages. Data parallelism: each replica is an engine whose rows
    are laid out as a single engine's (replicas share their blocks)."""
    assert digest(**change) == digest()


def test_model_id_replaces_the_model_name_and_nothing_else() -> None:
    assert digest("org/llama@v1", name="/a/llama") == digest("org/llama@v1", name="/b/copy-of-llama")
    assert digest("org/llama@v1") != digest("org/llama@v2") != digest()
    assert digest("org/llama@v1") != digest("org/llama@v1", dtype="float16")  # the layout still counts
    assert digest("/models/llama") == digest()  # model_id equal to the name: the same blocks


def test_a_config_without_a_model_name_needs_model_id() -> None:
    with pytest.raises(ValueError, match="model_id"):
        block_identity(vllm_config(name=""), model_id=None, block_bytes=1)
    assert block_identity(vllm_config(name=""), model_id="m", block_bytes=1).fields["model"] == "m"


REQUIRED = ["model.name", "model.dtype", "cache.tokens_per_hash", "cache.blocks_per_chunk", "groups",
            "groups.0.group_id", "groups.0.tokens_per_block", "groups.0.layer_names", "parallel.world_size",
            "parallel.tp_size", "parallel.pp_size", "parallel.pcp_size", "parallel.dcp_size",
            "worker_kv_bytes_per_block", "model", "cache", "parallel"]


@pytest.mark.parametrize("path", REQUIRED)
def test_a_missing_required_field_is_a_value_error_naming_it(path: str) -> None:
    """Found in review: required fields were read with defaults (dtype "None", parallel sizes 1,
    tokens_per_hash 0): a config without them would share a digest with configs of other layouts."""
    config = vllm_config()
    *parents, last = path.split(".")
    owner: Any = config
    for name in parents:
        owner = owner[int(name)] if name.isdigit() else getattr(owner, name)
    delattr(owner, last)
    shown = path.replace(".0.", "[0].")
    with pytest.raises(ValueError, match=r"^kvactors: .*" + shown.replace("[", r"\[").replace("]", r"\]")):
        block_identity(config, model_id=None, block_bytes=16384)


def test_the_optional_layout_fields_may_be_missing() -> None:
    config = vllm_config()
    for name in ("replicated_layout", "canonical_layout", "kv_cache_layout"):
        delattr(config, name)
    assert block_identity(config, model_id=None, block_bytes=16384).digest == digest()
    del config.model.name  # with model_id, vLLM's model name is not read
    assert block_identity(config, model_id="m", block_bytes=16384).fields["model"] == "m"


@pytest.mark.parametrize("change", [{"groups": None}, {"layer_names": None}, {"layer_names": "abc"}])
def test_a_groups_field_that_is_not_a_sequence_is_a_value_error(change: dict[str, Any]) -> None:
    config = vllm_config()
    owner = config if "groups" in change else config.groups[0]
    setattr(owner, *next(iter(change.items())))
    with pytest.raises(ValueError, match=f"kvactors: .*{next(iter(change))}"):
        block_identity(config, model_id=None, block_bytes=16384)


@pytest.mark.parametrize("venv", [".venv-vllm033", ".venv-vllmcpu032"])
def test_the_real_offloading_config_of_each_vllm_gives_the_pinned_digest(venv: str) -> None:
    """vLLM's own dataclasses (its config.py is plain dataclasses, loaded from the file without vLLM)."""
    import importlib.util

    found = sorted((Path(__file__).resolve().parents[1] / venv).glob("lib/python*/site-packages/"
                                                                        "vllm/v1/kv_offload/config.py"))
    if not found:
        pytest.skip(f"no {venv}")
    spec = importlib.util.spec_from_file_location(f"vllm_offload_config_{venv[1:].replace('-', '_')}", found[0])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def make(cls: type, **values: Any) -> Any:
        import dataclasses

        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})  # what the other version lacks, left out

    stand_in = vllm_config()
    config = make(
        module.OffloadingConfig,
        groups=tuple(make(module.OffloadingGroupConfig, **vars(g)) for g in stand_in.groups),
        worker_kv_bytes_per_block=stand_in.worker_kv_bytes_per_block, enable_kv_cache_events=False,
        extra_config={}, engine_id="e0", model=make(module.OffloadingModelConfig, **vars(stand_in.model)),
        cache=make(module.OffloadingCacheConfig, **vars(stand_in.cache)),
        parallel=make(module.OffloadingParallelConfig, **vars(stand_in.parallel)))
    assert block_identity(config, model_id=None, block_bytes=16384).digest.hex() == "2965e24d310cba81"


@pytest.mark.parametrize("change", [{"tp_size": "2"}, {"tokens_per_block": None}, {"block_bytes": 1.5},
                                    {"worker_kv_bytes_per_block": True}])
def test_a_size_that_is_not_an_int_is_a_value_error(change: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(change))):
        digest(**change)


# ------------------------------------------------------------------- model_id


def test_model_id_is_a_top_level_key_and_optional() -> None:
    assert "model_id" in TOP_LEVEL_KEYS
    assert parse_config({"cpu_bytes_to_use": 1 << 20}).model_id is None
    assert parse_config({"cpu_bytes_to_use": 1 << 20, "model_id": "org/model@rev"}).model_id == "org/model@rev"
    assert parse_config({"cpu_bytes_to_use": 1 << 20, "model_id": "é" * MAX_MODEL_ID_CHARS}).model_id


@pytest.mark.parametrize("value", [5, 1.0, True, b"org/model", ["org/model"], {"name": "m"}, "", "   ",
                                   "x" * (MAX_MODEL_ID_CHARS + 1), "x" * (1 << 20), "org/model\n", "a\x00b"],
                         ids=repr)
def test_a_hostile_model_id_is_a_value_error_naming_the_key(value: object) -> None:
    with pytest.raises(ValueError, match="model_id"):
        parse_config({"cpu_bytes_to_use": 1 << 20, "model_id": value})


# ----------------------------------------------------------------- PrefixedTier


class Harness:
    """A tier attached to a pool whose rows hold ``seed``-dependent bytes; reports in a queue."""

    def __init__(self, tier: SecondaryTier, seed: int = 0, rows: int = 8) -> None:
        self.tier = tier
        self.pool = torch.randint(0, 256, (rows, BLOCK), dtype=torch.uint8,
                                  generator=torch.Generator().manual_seed(seed))
        self.results: queue.Queue[JobResult] = queue.Queue()
        self.jobs = 0
        tier.attach(self.pool, self.results.put)

    def run(self, keys: Sequence[OffloadKey], rows: Sequence[int], *, load: bool) -> JobResult:
        self.jobs += 1
        job = TransferJob(self.jobs, tuple(keys), tuple(rows), CTX, load)
        (self.tier.submit_load if load else self.tier.submit_store)(job)
        result = self.results.get(timeout=10)
        assert result.job_id == job.job_id
        return result


def vllm_keys(n: int, group: int = 0) -> list[OffloadKey]:
    """Keys shaped as vLLM's: a 32-byte hash, then the 4-byte group index."""
    return [i.to_bytes(32, "big") + group.to_bytes(4, "little") for i in range(n)]


def test_a_prefix_must_be_non_empty_bytes() -> None:
    for prefix in (b"", "ab", bytearray(b"ab"), None):
        with pytest.raises(ValueError, match="prefix"):
            PrefixedTier(MemoryTier(capacity_blocks=2), prefix)  # type: ignore[arg-type]


def test_two_models_on_one_disk_root_keep_their_own_blocks(tmp_path: Path) -> None:
    """Model B on the root model A filled: A's blocks are misses to B (lookups and loads), B stores
    the same keys with its own bytes beside them, and A, restarted, still loads exactly its own."""
    root, keys = tmp_path / "disk", vllm_keys(3)
    a = Harness(PrefixedTier(DiskTier(root, capacity_bytes=1 << 20), b"A" * 8), seed=1)
    assert a.run(keys, [0, 1, 2], load=False).success
    a.tier.shutdown()

    b = Harness(PrefixedTier(DiskTier(root, capacity_bytes=1 << 20), b"B" * 8), seed=2)
    assert b.tier.lookup(keys, CTX) == [MISS] * 3
    assert not b.run(keys[:1], [5], load=True).success  # a miss, never A's data
    assert b.run(keys, [0, 1, 2], load=False).success
    b.tier.take_events()
    b.tier.shutdown()

    a2 = Harness(PrefixedTier(DiskTier(root, capacity_bytes=1 << 20), b"A" * 8), seed=3)
    assert a2.tier.lookup(keys, CTX) == [HIT] * 3
    assert a2.run(keys, [5, 6, 7], load=True).success
    assert torch.equal(a2.pool[5:8], a.pool[0:3]) and not torch.equal(a2.pool[5:8], b.pool[0:3])
    a2.tier.shutdown()


class FakeTier(SecondaryTier):
    """Records the keys it sees; reports and events as told."""

    def __init__(self) -> None:
        super().__init__(name="fake")
        self.seen: list[OffloadKey] = []
        self.events: list[OffloadingEvent] = []
        self.successful: tuple[Any, ...] | None = None

    def lookup(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[LookupResult]:
        self.seen.extend(keys)
        return [MISS] * len(keys)

    def submit_store(self, job: TransferJob) -> None:
        self.seen.extend(job.keys)
        self.report(JobResult(job.job_id, False, "partial", self.successful))

    submit_load = submit_store

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        self.seen.extend(keys)

    def take_events(self) -> list[OffloadingEvent]:
        out, self.events = self.events, []
        return out


def test_keys_go_in_with_the_prefix_and_come_out_without_it() -> None:
    inner, keys = FakeTier(), vllm_keys(2, group=7)
    h = Harness(PrefixedTier(inner, b"P" * 8))
    h.tier.lookup(keys, CTX)
    h.tier.touch(keys, CTX)
    inner.successful = (b"P" * 8 + keys[1],)  # a partial report of its own keys
    result = h.run(keys, [0, 1], load=False)
    assert result.successful_keys == (keys[1],) and result.error == "partial"
    assert inner.seen == [b"P" * 8 + k for k in keys] * 3
    assert all(k[-4:] == (7).to_bytes(4, "little") for k in inner.seen)  # the group index stays last
    inner.successful = None
    assert h.run(keys, [0, 1], load=True).successful_keys is None
    inner.events = [OffloadingEvent((b"P" * 8 + keys[0], b"Q" * 8 + keys[1]), "fake", False),
                    OffloadingEvent((b"Q" * 8 + keys[0],), "fake", True),  # another model's block evicted
                    OffloadingEvent((b"P" * 8 + keys[1],), "fake", True)]
    assert h.tier.take_events() == [OffloadingEvent((keys[0],), "fake", False),
                                    OffloadingEvent((keys[1],), "fake", True)]


@pytest.mark.parametrize("stray", ["unprefixed", "another prefix", "prefix alone", "not bytes", "bytearray"])
@pytest.mark.parametrize("load", [False, True])
def test_a_report_naming_a_key_outside_the_prefix_fails_the_whole_job(stray: str, load: bool) -> None:
    """Found in review: stray keys were dropped and the tier's other keys still counted as successes.
    A report that does not fit its job fails the whole job (kvactors.core.outcomes.key_outcomes)."""
    inner, keys = FakeTier(), vllm_keys(2)
    h = Harness(PrefixedTier(inner, b"P" * 8))
    bad = {"unprefixed": keys[0], "another prefix": b"Q" * 8 + keys[0], "prefix alone": b"P" * 7,
           "not bytes": 5, "bytearray": bytearray(b"P" * 8 + keys[0])}[stray]
    inner.successful = (b"P" * 8 + keys[1], bad)
    result = h.run(keys, [0, 1], load=load)
    assert result == JobResult(result.job_id, False, "successful_keys names a key outside this tier's prefix", None)
    inner.successful = (b"P" * 8 + keys[1], b"P" * 8 + keys[0])  # the same tier, a fitting report: passed on
    assert h.run(keys, [0, 1], load=load).successful_keys == (keys[1], keys[0])


def test_a_disk_tier_evicting_another_models_blocks_shows_no_event_of_them(tmp_path: Path) -> None:
    root, keys = tmp_path / "disk", vllm_keys(4)
    a = Harness(PrefixedTier(DiskTier(root, capacity_bytes=1 << 20), b"A" * 8))
    assert a.run(keys[:2], [0, 1], load=False).success
    a.tier.shutdown()
    inner = DiskTier(root, capacity_bytes=1 << 20)
    capacity = inner.used_bytes  # A's two blocks (their files) fill it exactly: B's store evicts them
    inner.shutdown()
    b = Harness(PrefixedTier(DiskTier(root, capacity_bytes=capacity), b"B" * 8))
    assert b.run(keys[2:4], [0, 1], load=False).success
    events = b.tier.take_events()
    assert [(e.keys, e.removed) for e in events] == [(tuple(keys[2:4]), False)]
    b.tier.shutdown()


def test_redis_two_models_in_one_namespace(redis_server: Any) -> None:
    from kvactors.tiers.redis import RedisTier

    namespace, keys = f"iso-{uuid.uuid4().hex[:8]}", vllm_keys(2)

    def tier(prefix: bytes, seed: int) -> Harness:
        return Harness(PrefixedTier(RedisTier(redis_server.url, namespace=namespace), prefix), seed=seed)

    a = tier(b"A" * 8, 1)
    assert a.run(keys, [0, 1], load=False).success
    b = tier(b"B" * 8, 2)
    assert b.tier.lookup(keys, CTX) == [MISS, MISS]
    assert not b.run(keys, [4, 5], load=True).success
    a2 = tier(b"A" * 8, 3)  # a second server of model A shares them
    assert a2.tier.lookup(keys, CTX) == [HIT, HIT]
    assert a2.run(keys, [4, 5], load=True).success and torch.equal(a2.pool[4:6], a.pool[0:2])
    for h in (a, b, a2):
        h.tier.drain(5)
        h.tier.shutdown()


# ----------------------------------------------------------------- build_tiers


def test_build_tiers_puts_every_kind_in_the_identity_and_logs_it(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    config = parse_config({"cpu_bytes_to_use": 1 << 20, "tiers": [
        {"type": "disk", "root": str(tmp_path / "d"), "capacity_bytes": 1 << 20},
        {"type": "memory", "capacity_blocks": 4},
        {"type": "custom", "class": "kvactors.tiers.memory:MemoryTier", "kwargs": {"name": "c", "capacity_blocks": 2}},
    ]})
    identity = block_identity(vllm_config(), model_id=None, block_bytes=BLOCK)
    with caplog.at_level(logging.INFO, logger="kvactors.vllm"):
        tiers = build_tiers(config, identity)
    try:
        assert [type(t).__name__ for t in tiers] == ["PrefixedTier"] * 3
        assert [t.name for t in tiers] == ["disk", "memory", "c"]
        assert all(isinstance(t, PrefixedTier) and t.prefix == identity.digest for t in tiers)
        assert isinstance(tiers[0].inner, DiskTier)  # type: ignore[attr-defined]
    finally:
        for t in tiers:
            t.shutdown()
    logged = [r for r in caplog.records if getattr(r, "kvactors_event", {}).get("event") == "block_identity"]
    assert len(logged) == 1 and logged[0].kvactors_event["identity"] == identity.digest.hex()  # type: ignore[attr-defined]
    bare = build_tiers(parse_config({"cpu_bytes_to_use": 1 << 20, "tiers": [{"type": "memory", "capacity_blocks": 4}]}),
                       identity=None)
    assert [type(t) for t in bare] == [MemoryTier]


def test_build_tiers_needs_the_identity_said() -> None:
    """Found in review: ``identity=None`` by default made the isolation easy to forget."""
    config = parse_config({"cpu_bytes_to_use": 1 << 20, "tiers": [{"type": "memory", "capacity_blocks": 4}]})
    with pytest.raises(TypeError, match="identity"):
        build_tiers(config)  # type: ignore[call-arg]
