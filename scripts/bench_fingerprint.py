"""The cost of the weights fingerprint (kvactors.integrations.vllm.weights) against a full SHA-256.

    python scripts/bench_fingerprint.py [--gb 3] [--dir DIR] [--keep] [--json]

Writes a Llama-shaped checkpoint of random bf16 tensors (embedding, per layer q/k/v/o and
gate/up/down projections and two norms, lm_head; layers added until ``--gb`` is reached) as
safetensors shards of about 1 GB, with a config.json, in a temporary folder under ``--dir``
(/tmp), deleted at the end unless ``--keep``. Then, each timed on the same files:

* the fingerprint, cold (every file dropped from the page cache first, with
  ``posix_fadvise(DONTNEED)``) and warm (right after), with the bytes it read;
* a full SHA-256 of every file, cold and warm;

and prints both and the ratio (SHA-256 seconds / fingerprint seconds). ``--json``: one line with
the figures on stdout.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import struct
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvactors.integrations.vllm.weights import fingerprint_model

HIDDEN, INTER, VOCAB = 2048, 5632, 32000
SHARD_BYTES = 1 << 30


def layer_tensors(i: int) -> list[tuple[str, list[int]]]:
    p = f"model.layers.{i}."
    return [(p + "self_attn.q_proj.weight", [HIDDEN, HIDDEN]), (p + "self_attn.k_proj.weight", [HIDDEN, HIDDEN]),
            (p + "self_attn.v_proj.weight", [HIDDEN, HIDDEN]), (p + "self_attn.o_proj.weight", [HIDDEN, HIDDEN]),
            (p + "mlp.gate_proj.weight", [INTER, HIDDEN]), (p + "mlp.up_proj.weight", [INTER, HIDDEN]),
            (p + "mlp.down_proj.weight", [HIDDEN, INTER]), (p + "input_layernorm.weight", [HIDDEN]),
            (p + "post_attention_layernorm.weight", [HIDDEN])]


def plan(total_bytes: int) -> list[tuple[str, list[int]]]:
    tensors = [("model.embed_tokens.weight", [VOCAB, HIDDEN]), ("lm_head.weight", [VOCAB, HIDDEN]),
               ("model.norm.weight", [HIDDEN])]
    layer = 0
    while sum(2 * _numel(s) for _, s in tensors) < total_bytes:
        tensors += layer_tensors(layer)
        layer += 1
    return tensors


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def write_checkpoint(folder: str, total_bytes: int) -> tuple[int, int]:
    """Shards of random bytes; returns (bytes written, tensors)."""
    pool = os.urandom(64 << 20)  # random bytes, reused at a random offset per chunk: writing is not the test
    tensors = plan(total_bytes)
    shards: list[list[tuple[str, list[int]]]] = [[]]
    size = 0
    for name, shape in tensors:
        if size >= SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += 2 * _numel(shape)
    written = 0
    for k, shard in enumerate(shards):
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, shape in shard:
            n = 2 * _numel(shape)
            header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + n]}
            offset += n
        raw = json.dumps(header).encode()
        path = os.path.join(folder, f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors")
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            left = offset
            while left:
                start = int.from_bytes(os.urandom(3), "little") % (len(pool) // 2)
                chunk = min(left, len(pool) - start, 32 << 20)
                f.write(pool[start:start + chunk])
                left -= chunk
        written += 8 + len(raw) + offset
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"model_type": "llama", "hidden_size": HIDDEN, "intermediate_size": INTER,
                   "vocab_size": VOCAB, "torch_dtype": "bfloat16"}, f)
    return written, len(tensors)


def drop_cache(folder: str) -> None:
    for name in os.listdir(folder):
        fd = os.open(os.path.join(folder, name), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def full_sha256(folder: str) -> str:
    h = hashlib.sha256()
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as f:
            while chunk := f.read(8 << 20):
                h.update(chunk)
    return h.hexdigest()


def timed(fn, *args):  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=3.0, help="checkpoint size in GB (3)")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the checkpoint's folder goes (/tmp)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint")
    ap.add_argument("--json", action="store_true", help="one line of JSON on stdout")
    args = ap.parse_args()
    folder = tempfile.mkdtemp(prefix="kvactors-fingerprint-", dir=args.dir)
    cache = tempfile.mkdtemp(prefix="kvactors-fingerprint-cache-")
    try:
        (size, count), write_s = timed(write_checkpoint, folder, int(args.gb * 1e9))
        drop_cache(folder)
        fp_cold, fp_cold_s = timed(lambda: fingerprint_model(folder, cache=cache))
        fp_warm, fp_warm_s = timed(lambda: fingerprint_model(folder, cache=cache))
        assert fp_cold.digest == fp_warm.digest
        drop_cache(folder)
        _, sha_cold_s = timed(full_sha256, folder)
        _, sha_warm_s = timed(full_sha256, folder)
        out = {"checkpoint_bytes": size, "tensors": count, "shards": len(os.listdir(folder)) - 1,
               "write_s": round(write_s, 2), "fingerprint_bytes_read": fp_cold.bytes_read,
               "fingerprint_cold_s": round(fp_cold_s, 4), "fingerprint_warm_s": round(fp_warm_s, 4),
               "sha256_cold_s": round(sha_cold_s, 3), "sha256_warm_s": round(sha_warm_s, 3),
               "ratio_cold": round(sha_cold_s / fp_cold_s, 1), "ratio_warm": round(sha_warm_s / fp_warm_s, 1)}
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(cache, ignore_errors=True)
    if args.json:
        print(json.dumps(out))
        return 0
    gb = out["checkpoint_bytes"] / 1e9
    print(f"checkpoint: {gb:.2f} GB, {out['tensors']} tensors in {out['shards']} safetensors shards "
          f"(written in {out['write_s']} s){' , kept at ' + folder if args.keep else ''}")
    print(f"{'':14}{'cold (s)':>10}{'warm (s)':>10}{'bytes read':>16}")
    print(f"{'fingerprint':14}{out['fingerprint_cold_s']:>10.3f}{out['fingerprint_warm_s']:>10.3f}"
          f"{out['fingerprint_bytes_read']:>16,}")
    print(f"{'full SHA-256':14}{out['sha256_cold_s']:>10.3f}{out['sha256_warm_s']:>10.3f}"
          f"{out['checkpoint_bytes']:>16,}")
    print(f"ratio (SHA-256 / fingerprint): cold {out['ratio_cold']}x, warm {out['ratio_warm']}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
