"""vLLM 0.33's real Scheduler with both OffloadingConnector roles in one process; model outputs made up."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

BLOCK = 16
LAYERS = 2


def model_dir(tmp: str) -> str:
    path = os.path.join(tmp, "model")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                   "intermediate_size": 128, "num_hidden_layers": LAYERS, "num_attention_heads": 2,
                   "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 512, "max_position_embeddings": 1024,
                   "torch_dtype": "float16"}, f)
    return path


class Harness:
    def __init__(self, tmp: str, extra: dict[str, Any], *, num_gpu_blocks: int = 96, max_num_seqs: int = 8,
                 max_batched: int = 256, shutdown_timeout: int = 0) -> None:
        from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
        from vllm.v1.structured_output import StructuredOutputManager

        model_config = ModelConfig(model=model_dir(tmp), skip_tokenizer_init=True, dtype="float16", seed=0,
                                   max_model_len=1024)
        scheduler_config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_batched,
                                           max_model_len=1024, enable_chunked_prefill=True,
                                           is_encoder_decoder=False)
        cache_config = CacheConfig(block_size=BLOCK, cache_dtype="auto", enable_prefix_caching=True)
        kv_transfer_config = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                              kv_connector_extra_config=extra)
        self.vllm_config = VllmConfig(scheduler_config=scheduler_config, model_config=model_config,
                                      cache_config=cache_config, kv_transfer_config=kv_transfer_config,
                                      device_config=DeviceConfig("cpu"), shutdown_timeout=shutdown_timeout)
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float16)
        layers = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
        page = spec.page_size_bytes
        self.kv_cache_config = KVCacheConfig(
            num_blocks=num_gpu_blocks,
            kv_cache_tensors=[KVCacheTensor(size=page * num_gpu_blocks * LAYERS, layers=layers,
                                            layer_stride=page * num_gpu_blocks, block_stride=page)],
            kv_cache_groups=[KVCacheGroupSpec(layers, spec)])
        self.vllm_config.cache_config.num_gpu_blocks = num_gpu_blocks
        self.scheduler = Scheduler(vllm_config=self.vllm_config, kv_cache_config=self.kv_cache_config,
                                   log_stats=True, structured_output_manager=StructuredOutputManager(self.vllm_config),
                                   block_size=BLOCK)
        self.worker = KVConnectorFactory.create_connector(self.vllm_config, KVConnectorRole.WORKER,
                                                          self.kv_cache_config)
        self.page = page
        # The live "device" KV cache: one tensor per layer, (num_blocks, page) bytes.
        self.backing = torch.zeros(LAYERS * num_gpu_blocks * page, dtype=torch.uint8)
        self.kv = {name: self.backing[i * num_gpu_blocks * page:(i + 1) * num_gpu_blocks * page]
                   .view(torch.float16).view(num_gpu_blocks, 2, BLOCK, 1, 8) for i, name in enumerate(layers)}
        self.pages = self.backing.view(LAYERS, num_gpu_blocks, page)  # [layer, block] -> the page's bytes
        self.worker.register_kv_caches(self.kv)
        self.connector = self.scheduler.connector

    @property
    def manager(self) -> Any:
        return self.connector.connector_scheduler.manager


def fill(block_hash: bytes, layer: int, page: int, _cache: dict[tuple[bytes, int], torch.Tensor] = {}) -> torch.Tensor:  # noqa: B006
    """The made-up KV bytes of a block: a function of its hash (and the layer) only."""
    key = (bytes(block_hash), layer)
    out = _cache.get(key)
    if out is None:
        g = torch.Generator().manual_seed(int.from_bytes(bytes(block_hash)[:8], "little") ^ (layer * 0x9E3779B9))
        out = torch.randint(0, 256, (page,), dtype=torch.uint8, generator=g)
        _cache[key] = out
    return out


class Run:
    """Drives the harness: steps with made-up model outputs; checks every computed block's bytes."""

    def __init__(self, h: Harness) -> None:
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        self.h = h
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(BLOCK, sha256)
        self.written: dict[str, set[int]] = {}
        self.blockmap: dict[str, list[int]] = {}
        self.checked_loaded = 0
        self.steps = 0
        self.rt_before = 0

    def add(self, req_id: str, tokens: list[int], max_tokens: int) -> None:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.h.scheduler.add_request(Request(req_id, tokens, params, None, block_hasher=self.hasher))

    def step(self) -> None:
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        s, w = self.h.scheduler, self.h.worker
        out = s.schedule()
        meta = out.kv_connector_metadata
        # A preempted request lost its blocks: vLLM recomputes (or reloads) them, possibly into the same
        # block ids another request wrote meanwhile, so none of them counts as written by it any more.
        for req_id in out.preempted_req_ids or ():
            self.written.pop(req_id, None)
            self.blockmap.pop(req_id, None)
        w.handle_preemptions(meta)
        w.bind_connector_metadata(meta)
        w.start_load_kv(None)
        req_ids = list(out.num_scheduled_tokens)
        for req_id in req_ids:
            req = s.requests[req_id]
            blocks = s.kv_cache_manager.get_block_ids(req_id)[0]
            # schedule() already counted this step's tokens as computed.
            done_tokens = req.num_computed_tokens
            before = done_tokens - out.num_scheduled_tokens[req_id]
            mine = self.written.setdefault(req_id, set())
            old = self.blockmap.get(req_id, [])
            mine -= {i for i in list(mine) if i >= len(blocks) or i >= len(old) or old[i] != blocks[i]}
            self.blockmap[req_id] = list(blocks)
            # Blocks computed before this step (locally cached or loaded) must hold their hash's bytes.
            for i in range(min(before // BLOCK, len(req.block_hashes))):
                if i in mine:
                    continue
                for layer in range(LAYERS):
                    got = self.h.pages[layer, blocks[i]]
                    assert torch.equal(got, fill(req.block_hashes[i], layer, self.h.page)), \
                        f"{req_id} block {i}: wrong bytes"
                self.checked_loaded += 1
                mine.add(i)
            # "Compute" the blocks this step completes.
            for i in range(min(done_tokens // BLOCK, len(req.block_hashes))):
                if i not in mine:
                    for layer in range(LAYERS):
                        self.h.pages[layer, blocks[i]] = fill(req.block_hashes[i], layer, self.h.page)
                    mine.add(i)
        w.wait_for_save()
        sending, recving = w.get_finished(out.finished_req_ids)
        worker_meta = w.build_connector_worker_meta()
        w.clear_connector_metadata()
        sampled = []
        for req_id in req_ids:
            req = s.requests[req_id]
            done_tokens = req.num_computed_tokens
            sampled.append([7 + (hash(req_id) + done_tokens) % 400] if done_tokens >= req.num_tokens else [])
        mro = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                sampled_token_ids=sampled,
                                kv_connector_output=KVConnectorOutput(finished_sending=sending or None,
                                                                      finished_recving=recving or None,
                                                                      kv_connector_worker_meta=worker_meta))
        s.update_from_output(out, mro)
        for req_id in list(self.written):
            if req_id not in s.requests:
                del self.written[req_id]
                self.blockmap.pop(req_id, None)
        self.steps += 1
