"""The identity of an engine's blocks in the tiers that outlive it or are shared.

vLLM's offload keys are prefix hashes of token ids (plus a 4-byte group index):
they do not say which model computed the KV, nor how its bytes are laid out. A
disk root or Redis namespace used by servers of two models (a fine-tune and its
base: same architecture, same sizes, other weights) would serve one model the
other's KV under the same key, silently: wrong outputs, no error. So every key
kvactors puts in a secondary tier for vLLM carries a digest of what the bytes of
the block depend on (:class:`BlockIdentity`), as vLLM's own ``FileMapper``
(``vllm/v1/kv_offload/file_mapper.py``) names its folders:

* the model: ``model.name`` from vLLM's config (the path or hub name it was
  loaded from), or the operator's ``model_id`` in its place (servers that load one
  model from different paths then share; two models must never be given the same
  ``model_id``: the digest cannot tell them apart);
* the KV dtype (``model.dtype``: the cache's, ``fp8`` included);
* tokens per hash and blocks per chunk (what one key covers);
* the KV-cache groups: group id, tokens per block, layer names, in order;
* the parallel layout: world size and the tp, pp, pcp and dcp sizes;
* the bytes: ``worker_kv_bytes_per_block`` and the pool row's ``block_bytes``,
  the page layout (``kv_cache_layout``, when vLLM reports it) and vLLM's layout
  flags when set (``replicated_layout``, ``canonical_layout``);
* :data:`ROW_FORMAT`, how :mod:`~kvactors.integrations.vllm.worker` lays the pages
  out in a row (bumped when that changes, so rows of an older layout become misses).

What "rank" means here. ``FileMapper`` puts the worker rank in its paths because
each vLLM worker writes its own files. A kvactors pool row holds the pages of
*every* worker rank of the engine (rank ``r`` at ``r * per_worker_bytes``), and
the scheduler side stores whole rows: there is no per-rank block in any tier,
so the rank is not part of the identity; the world size and the tp/pp/pcp/dcp
sizes are, because they decide which rank holds which heads and layers in the
row. Data parallelism is left out on purpose, as ``FileMapper`` leaves it out:
each data-parallel replica is an engine of its own (its own pool, ``engine_id``
and rows) whose rows are laid out exactly as a single engine's with the same
tp/pp/pcp/dcp, so replicas of one deployment, and deployments of any DP size,
share blocks, which is what a shared tier is for.

Not covered: anything vLLM does not report to the offloading spec (the model's
revision on the hub, a ``model_id`` reused for other weights): name those in
``model_id`` (``"org/model@rev"``). Blocks written by kvactors before keys carried
an identity are misses (their keys are shorter), evicted in LRU order like any
other block.

Plain code, no vLLM import: :func:`block_identity` reads vLLM's
``OffloadingConfig`` by attribute, so it is tested with stand-ins.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

ROW_FORMAT = "kvactors-vllm-row/1"
"""The layout of a pool row (per rank, per tensor of the group, ``blocks_per_chunk``
pages): part of the identity, so a change of the layout makes old blocks misses."""

PREFIX_BYTES = 8
"""Bytes of the digest put in front of each key. 64 bits: the chance that two of a
thousand identities sharing a tier collide is about 3e-14; each byte more costs
each block one more byte of key in every tier (a Redis key holds it twice, as hex)."""


@dataclass(frozen=True)
class BlockIdentity:
    """What the bytes of an engine's blocks depend on, and its digest.

    ``fields`` is plain JSON (str, int, bool, lists, dicts); ``digest`` is the
    first :data:`PREFIX_BYTES` bytes of the SHA-256 of its canonical JSON (sorted
    keys, no spaces), so the same fields give the same digest in every process,
    on every machine and with every Python.
    """

    fields: Mapping[str, Any]
    digest: bytes = field(init=False)

    def __post_init__(self) -> None:
        canonical = json.dumps(self.fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        object.__setattr__(self, "digest", hashlib.sha256(canonical.encode("ascii")).digest()[:PREFIX_BYTES])

    @property
    def prefix(self) -> bytes:
        """What :class:`~kvactors.tiers.prefixed.PrefixedTier` puts in front of each key."""
        return self.digest

    def describe(self) -> dict[str, Any]:
        """For the log: the digest (hex) and the fields it was made of."""
        return {"identity": self.digest.hex(), **self.fields}


def _get(obj: object, name: str, default: Any = None) -> Any:
    return getattr(obj, name, default) if obj is not None else default


def _int(value: object, what: str) -> int:
    if type(value) is bool or not isinstance(value, int):
        raise ValueError(f"kvactors: vLLM reported {what}={value!r}, not an integer")
    return int(value)


def block_identity(config: Any, *, model_id: str | None, block_bytes: int) -> BlockIdentity:
    """The identity of the blocks of the engine that ``config`` (vLLM's ``OffloadingConfig``) describes.

    ``model_id``: the operator's name for the model (the config key), or None to
    use ``config.model.name``. ``block_bytes``: the bytes of one pool row.
    ``ValueError`` if vLLM's config names no model and ``model_id`` is None, or
    reports a size that is not an integer."""
    model, cache, parallel = _get(config, "model"), _get(config, "cache"), _get(config, "parallel")
    name = model_id if model_id is not None else _get(model, "name")
    if not isinstance(name, str) or not name:
        raise ValueError("kvactors: vLLM's config names no model; set model_id")
    groups = [
        {"group_id": _int(_get(g, "group_id", i), "group_id"),
         "tokens_per_block": _int(_get(g, "tokens_per_block"), "tokens_per_block"),
         "layer_names": [str(n) for n in (_get(g, "layer_names") or ())]}
        for i, g in enumerate(_get(config, "groups") or ())
    ]
    fields: dict[str, Any] = {
        "row_format": ROW_FORMAT,
        "model": name,
        "dtype": str(_get(model, "dtype")),
        "tokens_per_hash": _int(_get(cache, "tokens_per_hash", 0), "tokens_per_hash"),
        "blocks_per_chunk": _int(_get(cache, "blocks_per_chunk", 1), "blocks_per_chunk"),
        "groups": groups,
        "world_size": _int(_get(parallel, "world_size", 1), "world_size"),
        "tp_size": _int(_get(parallel, "tp_size", 1), "tp_size"),
        "pp_size": _int(_get(parallel, "pp_size", 1), "pp_size"),
        "pcp_size": _int(_get(parallel, "pcp_size", 1), "pcp_size"),
        "dcp_size": _int(_get(parallel, "dcp_size", 1), "dcp_size"),
        "worker_kv_bytes_per_block": _int(_get(config, "worker_kv_bytes_per_block"), "worker_kv_bytes_per_block"),
        "block_bytes": _int(block_bytes, "block_bytes"),
    }
    # Only when set, as FileMapper does: a vLLM without these flags and one with them
    # off describe the same bytes, so they give the same digest.
    for flag in ("replicated_layout", "canonical_layout"):
        if _get(config, flag) is True:
            fields[flag] = True
    # The page layout (NHD, HND, ...) changes the bytes of a direct-layout page too.
    if _get(config, "kv_cache_layout") is not None:
        fields["kv_cache_layout"] = str(_get(config, "kv_cache_layout"))
    return BlockIdentity(fields)
