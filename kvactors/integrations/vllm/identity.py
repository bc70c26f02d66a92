"""The identity of an engine's blocks in the tiers that outlive it or are shared.

vLLM's offload keys are prefix hashes of token ids, plus a 4-byte group index.
They do not say which model computed the KV, nor how its bytes are laid out.
A disk root or Redis namespace may be used by servers of two models,
such as a fine-tune and its base (same architecture, same sizes, other weights).
It would then serve one model the other's KV under the same key, silently.
The outputs would be wrong, with no error.
So every key kvactors puts in a secondary tier for vLLM carries a digest (:class:`BlockIdentity`).
The digest covers what the bytes of the block depend on,
as vLLM's own ``FileMapper`` (``vllm/v1/kv_offload/file_mapper.py``) names its folders.

* The model. There are three ways to name it.

  - By default, a fingerprint of its weights and config
    (:mod:`~kvactors.integrations.vllm.weights`, ``identity_by: "weights"``), not its path.
    The same weights loaded from two paths share blocks.
    New weights deployed under the same path never load the old ones'.
  - The operator's ``model_id``, an explicit override. No fingerprint is taken.
    Two models must never be given the same ``model_id``, because the digest cannot tell them apart.
  - ``model.name`` from vLLM's config, the path or hub name the model was loaded from.
    This is used with ``identity_by: "name"``.
    It is also the fallback when the weights cannot be read, with a ``weights_fingerprint_failed`` warning.

* The KV dtype (``model.dtype``), which is the cache's, ``fp8`` included.
* Tokens per hash and blocks per chunk, which say what one key covers.
* The KV-cache groups, in order: group id, tokens per block, layer names.
* The parallel layout: world size and the tp, pp, pcp and dcp sizes.
* The bytes: ``worker_kv_bytes_per_block`` and the pool row's ``block_bytes``.
  The page layout (``kv_cache_layout``) counts when vLLM reports it.
  vLLM's layout flags (``replicated_layout``, ``canonical_layout``) count when set.
* :data:`ROW_FORMAT`, how :mod:`~kvactors.integrations.vllm.worker` lays the pages out in a row.
  It is bumped when that changes, so rows of an older layout become misses.

What "rank" means here.
``FileMapper`` puts the worker rank in its paths because each vLLM worker writes its own files.
A kvactors pool row holds the pages of *every* worker rank of the engine,
with rank ``r`` at ``r * per_worker_bytes``.
The scheduler side stores whole rows, so there is no per-rank block in any tier.
So the rank is not part of the identity.
The world size and the tp/pp/pcp/dcp sizes are part of it,
because they decide which rank holds which heads and layers in the row.
Data parallelism is left out on purpose, as ``FileMapper`` leaves it out.
Each data-parallel replica is an engine of its own, with its own pool, ``engine_id`` and rows.
Its rows are laid out exactly as a single engine's with the same tp/pp/pcp/dcp.
So replicas of one deployment, and deployments of any DP size, share blocks.
That is what a shared tier is for.

Not covered is anything vLLM does not report to the offloading spec.
That includes the model's revision on the hub, and a ``model_id`` reused for other weights.
Name those in ``model_id`` (``"org/model@rev"``).
Blocks written by kvactors before keys carried an identity are misses, because their keys are shorter.
They are evicted in LRU order like any other block.

Plain code, with no vLLM import.
:func:`block_identity` reads vLLM's ``OffloadingConfig`` by attribute, so it is tested with stand-ins.
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
"""Bytes of the digest put in front of each key.

With 64 bits, the chance that two of a thousand identities sharing a tier collide is about 3e-14.
Each byte more costs each block one more byte of key in every tier.
A Redis key holds it twice, as hex.
"""


@dataclass(frozen=True)
class BlockIdentity:
    """What the bytes of an engine's blocks depend on, and its digest.

    ``fields`` is plain JSON (str, int, bool, lists, dicts).
    ``digest`` is the first :data:`PREFIX_BYTES` bytes of the SHA-256 of its canonical JSON
    (sorted keys, no spaces).
    So the same fields give the same digest in every process, on every machine and with every Python.
    It is what :class:`~kvactors.tiers.prefixed.PrefixedTier` puts in front of each key.
    """

    fields: Mapping[str, Any]
    digest: bytes = field(init=False)

    def __post_init__(self) -> None:
        canonical = json.dumps(self.fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        object.__setattr__(self, "digest", hashlib.sha256(canonical.encode("ascii")).digest()[:PREFIX_BYTES])

    def describe(self) -> dict[str, Any]:
        """The digest (hex) and the fields it was made of, for the log."""
        return {"identity": self.digest.hex(), **self.fields}


_MISSING = object()


def _required(obj: object, path: str, where: str = "") -> Any:
    """``obj.<path>`` (dotted), a field that every vLLM with the offloading spec reports (0.32 and 0.33).

    Raises ``ValueError`` naming the field if it is missing.
    A default in its place would put blocks of other layouts under one digest.
    """
    value = obj
    for name in path.split("."):
        value = getattr(value, name, _MISSING)
        if value is _MISSING:
            raise ValueError(f"kvactors: vLLM's offloading config has no {where}{path}")
    return value


def _seq(value: object, what: str) -> tuple[Any, ...]:
    if not isinstance(value, tuple | list):
        raise ValueError(f"kvactors: vLLM reported {what}={value!r}, not a sequence")
    return tuple(value)


def _int(value: object, what: str) -> int:
    if type(value) is bool or not isinstance(value, int):
        raise ValueError(f"kvactors: vLLM reported {what}={value!r}, not an integer")
    return int(value)


def block_identity(config: Any, *, model_id: str | None, block_bytes: int,
                   weights: str | None = None) -> BlockIdentity:
    """The identity of the blocks of the engine that ``config`` (vLLM's ``OffloadingConfig``) describes.

    ``model_id`` is the operator's name for the model (the config key), or None.
    With None, ``weights`` names the model: the fingerprint of the weights, in hex.
    The model's name, its path, is then not part of the identity.
    Without ``weights`` either, ``config.model.name`` names the model.
    ``block_bytes`` is the bytes of one pool row.

    Raises ``ValueError`` in three cases.

    * vLLM's config names no model and ``model_id`` is None.
    * The config lacks a field that vLLM 0.32 and 0.33 both report.
    * The config reports a size that is not an integer.

    Only the layout flags and ``kv_cache_layout`` may be absent.
    """
    if model_id is None and weights is not None:
        if not isinstance(weights, str) or not weights:
            raise ValueError(f"kvactors: weights must be a non-empty fingerprint, got {weights!r}")
        model: dict[str, Any] = {"weights": weights}
    else:
        name = model_id if model_id is not None else _required(config, "model.name")
        if not isinstance(name, str) or not name:
            raise ValueError("kvactors: vLLM's config names no model; set model_id")
        model = {"model": name}
    groups = [
        {"group_id": _int(_required(g, "group_id", f"groups[{i}]."), "group_id"),
         "tokens_per_block": _int(_required(g, "tokens_per_block", f"groups[{i}]."), "tokens_per_block"),
         "layer_names": [str(n) for n in _seq(_required(g, "layer_names", f"groups[{i}]."), "layer_names")]}
        for i, g in enumerate(_seq(_required(config, "groups"), "groups"))
    ]
    fields: dict[str, Any] = {
        "row_format": ROW_FORMAT,
        **model,
        "dtype": str(_required(config, "model.dtype")),
        "tokens_per_hash": _int(_required(config, "cache.tokens_per_hash"), "tokens_per_hash"),
        "blocks_per_chunk": _int(_required(config, "cache.blocks_per_chunk"), "blocks_per_chunk"),
        "groups": groups,
        **{size: _int(_required(config, f"parallel.{size}"), size)
           for size in ("world_size", "tp_size", "pp_size", "pcp_size", "dcp_size")},
        "worker_kv_bytes_per_block": _int(_required(config, "worker_kv_bytes_per_block"), "worker_kv_bytes_per_block"),
        "block_bytes": _int(block_bytes, "block_bytes"),
    }
    # Optional (defaults in vLLM's dataclass, and custom builds may lack them). Only when
    # set, as FileMapper does: a vLLM without these flags and one with them off describe
    # the same bytes, so they give the same digest.
    for flag in ("replicated_layout", "canonical_layout"):
        if getattr(config, flag, False) is True:
            fields[flag] = True
    # The page layout (NHD, HND, ...) changes the bytes of a direct-layout page too.
    layout = getattr(config, "kv_cache_layout", None)
    if layout is not None:
        fields["kv_cache_layout"] = str(layout)
    return BlockIdentity(fields)
