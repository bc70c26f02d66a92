"""The kvactors keys of vLLM's ``kv_connector_extra_config``, checked.

Plain code, no vLLM import: :func:`parse_config` turns the mapping into a
:class:`KvactorsConfig` or raises ``ValueError`` naming the key at fault, and
:func:`build_tiers` constructs the secondary tiers it names. Keys not listed
in :data:`TOP_LEVEL_KEYS` belong to vLLM (``spec_name``, ``offload_prompt_only``,
...) and are left alone.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvactors.core.admission import parse_admission
from kvactors.core.arguments import check_int, check_timeout
from kvactors.core.policies import POLICIES
from kvactors.integrations.vllm.identity import BlockIdentity
from kvactors.integrations.vllm.weights import IdentityBy
from kvactors.logs import component_logger
from kvactors.tiers.base import SecondaryTier
from kvactors.tiers.disk import DiskTier
from kvactors.tiers.memory import MemoryTier
from kvactors.tiers.prefixed import PrefixedTier
from kvactors.tiers.redis import RedisTier

TOP_LEVEL_KEYS = ("cpu_bytes_to_use", "eviction_policy", "tiers", "transfer_timeout_s", "lookup_timeout_s",
                  "event_log", "model_id", "identity_by")

MAX_MODEL_ID_CHARS = 1024
"""The longest ``model_id`` accepted: a hub name with a revision is well under it; a
longer value is a mistake (a file's content pasted in), not a name."""

# Keys every tier entry may carry besides its type's (docs/controls.md): they go to TieringManager.start.
CONTROL_KEYS = ("admission", "max_queued_bytes")

# Per tier type: (required keys, optional keys) besides "type" and CONTROL_KEYS.
TIER_KEYS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "disk": (("root", "capacity_bytes"), ("name", "io_workers", "fsync", "direct_io")),
    "redis": (("url",), ("name", "namespace", "capacity_bytes", "cluster", "timeout_s", "io_workers",
                         "retry_after_s")),
    "memory": (("capacity_blocks",), ("name",)),
    "mooncake": (("master",), ("name", "namespace", "segment_bytes", "local_buffer_bytes", "timeout_s", "io_workers",
                               "retry_after_s", "local_host")),
    "custom": (("class",), ("kwargs",)),
}


@dataclass(frozen=True)
class KvactorsConfig:
    """The checked kvactors settings of one vLLM engine."""

    cpu_bytes_to_use: int
    eviction_policy: str = "lru"
    tiers: tuple[Mapping[str, Any], ...] = field(default=())
    transfer_timeout_s: float = 30.0
    lookup_timeout_s: float = 5.0
    event_log: str | None = None
    model_id: str | None = None
    """The operator's name for the model, in place of the fingerprint of its weights (or
    vLLM's ``model.name``) in the identity of the blocks (:mod:`kvactors.integrations.vllm.identity`)."""
    identity_by: IdentityBy = IdentityBy.WEIGHTS
    """What names the model when ``model_id`` is not set: a fingerprint of its weights (the
    default) or vLLM's model name (:class:`~kvactors.integrations.vllm.weights.IdentityBy`)."""


def _positive_int(key: str, value: object) -> int:
    return check_int(value, f"kvactors: {key}")


def _positive_float(key: str, value: object) -> float:
    seconds = check_timeout(value, f"kvactors: {key}", allow_none=False, allow_zero=False)
    assert seconds is not None  # allow_none=False
    return seconds


def _check_tier(index: int, entry: object) -> Mapping[str, Any]:
    where = f"tiers[{index}]"
    if not isinstance(entry, Mapping):
        raise ValueError(f"kvactors: {where} must be a mapping, got {type(entry).__name__}")
    kind = entry.get("type")
    if not isinstance(kind, str) or kind not in TIER_KEYS:
        raise ValueError(f"kvactors: {where}.type must be one of {sorted(TIER_KEYS)}, got {kind!r}")
    required, optional = TIER_KEYS[kind]
    optional = optional + CONTROL_KEYS
    for key in entry:
        if key != "type" and key not in required and key not in optional:
            raise ValueError(f"kvactors: unknown key {where}.{key} for a {kind} tier "
                             f"(known: {', '.join(required + optional)})")
    for key in required:
        if key not in entry:
            raise ValueError(f"kvactors: {where}.{key} is required for a {kind} tier")
    for key in ("capacity_bytes", "capacity_blocks", "io_workers"):
        if key in entry and not (key == "capacity_bytes" and kind == "redis" and entry[key] is None):
            _positive_int(f"{where}.{key}", entry[key])
    for key in ("fsync", "direct_io", "cluster"):
        if key in entry and type(entry[key]) is not bool:
            raise ValueError(f"kvactors: {where}.{key} must be true or false, got {entry[key]!r}")
    for key in ("root", "url", "master", "name", "namespace", "class"):
        if key in entry and (not isinstance(entry[key], str | os.PathLike) or not str(entry[key])):
            raise ValueError(f"kvactors: {where}.{key} must be a non-empty string, got {entry[key]!r}")
    if "admission" in entry:
        try:
            parse_admission(entry["admission"], f"kvactors: {where}.admission")
        except TypeError as exc:
            raise ValueError(str(exc)) from None
    if "max_queued_bytes" in entry:
        limit = entry["max_queued_bytes"]
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
            raise ValueError(f"kvactors: {where}.max_queued_bytes must be an int >= 0 (bytes), got {limit!r}")
    if kind == "custom":
        spec = str(entry["class"])
        module_name, _, attr = spec.partition(":")
        if not module_name.strip() or not attr.strip():
            raise ValueError(f"kvactors: {where}.class must be 'module:Class', got {spec!r}")
        if not isinstance(entry.get("kwargs", {}), Mapping):
            raise ValueError(f"kvactors: {where}.kwargs must be a mapping, got {entry['kwargs']!r}")
    return dict(entry)


def parse_config(extra: Mapping[str, Any]) -> KvactorsConfig:
    """Check the kvactors keys of ``extra``; ``ValueError`` naming the key at fault."""
    if not isinstance(extra, Mapping):
        raise ValueError(f"kvactors: kv_connector_extra_config must be a mapping, got {type(extra).__name__}")
    if "cpu_bytes_to_use" not in extra:
        raise ValueError("kvactors: cpu_bytes_to_use is required (the primary CPU pool, in bytes)")
    cpu_bytes = _positive_int("cpu_bytes_to_use", extra["cpu_bytes_to_use"])
    policy = extra.get("eviction_policy", "lru")
    if policy not in POLICIES:
        raise ValueError(f"kvactors: eviction_policy must be one of {sorted(POLICIES)}, got {policy!r}")
    tiers_raw = extra.get("tiers", [])
    if tiers_raw is None:
        tiers_raw = []
    if not isinstance(tiers_raw, Sequence) or isinstance(tiers_raw, str | bytes):
        raise ValueError(f"kvactors: tiers must be a list of tier entries, got {tiers_raw!r}")
    tiers = tuple(_check_tier(i, entry) for i, entry in enumerate(tiers_raw))
    for i, entry in enumerate(tiers):
        if "admission" in entry and parse_admission(entry["admission"]).mode == "write_back" and policy != "lru":
            raise ValueError(f"kvactors: tiers[{i}].admission 'write_back' needs eviction_policy 'lru', "
                             f"got {policy!r}")
    event_log = extra.get("event_log")
    if event_log is not None:
        _check_event_log(event_log)
    model_id = extra.get("model_id")
    if model_id is not None:
        _check_model_id(model_id)
    identity_by = extra.get("identity_by", IdentityBy.WEIGHTS.value)
    if not isinstance(identity_by, str) or identity_by not in {i.value for i in IdentityBy}:
        raise ValueError(f"kvactors: identity_by must be one of {sorted(i.value for i in IdentityBy)}, "
                         f"got {identity_by!r}")
    return KvactorsConfig(
        cpu_bytes_to_use=cpu_bytes,
        eviction_policy=str(policy),
        tiers=tiers,
        transfer_timeout_s=_positive_float("transfer_timeout_s", extra.get("transfer_timeout_s", 30.0)),
        lookup_timeout_s=_positive_float("lookup_timeout_s", extra.get("lookup_timeout_s", 5.0)),
        event_log=None if event_log is None else os.fspath(event_log),
        model_id=model_id,
        identity_by=IdentityBy(identity_by),
    )


def _check_model_id(model_id: object) -> None:
    """A non-empty printable string of at most :data:`MAX_MODEL_ID_CHARS`; ``ValueError`` naming ``model_id``."""
    if not isinstance(model_id, str):
        raise ValueError(f"kvactors: model_id must be a non-empty string, got {type(model_id).__name__}")
    if not model_id.strip():
        raise ValueError(f"kvactors: model_id must be a non-empty string, got {model_id!r}")
    if len(model_id) > MAX_MODEL_ID_CHARS:
        raise ValueError(f"kvactors: model_id must be at most {MAX_MODEL_ID_CHARS} characters, "
                         f"got {len(model_id)}")
    if not model_id.isprintable():
        raise ValueError(f"kvactors: model_id must be printable, got {model_id[:80]!r}")


def _check_event_log(event_log: object) -> None:
    """A file the log can be created in or appended to; ``ValueError`` naming ``event_log``."""
    if not isinstance(event_log, str | os.PathLike) or not isinstance(os.fspath(event_log), str) \
            or not os.fspath(event_log) or "\0" in os.fspath(event_log):
        raise ValueError(f"kvactors: event_log must be a path, got {event_log!r}")
    path = os.path.abspath(os.fspath(event_log))
    folder = os.path.dirname(path)
    if os.path.isdir(path):
        raise ValueError(f"kvactors: event_log {event_log!r} is a directory, not a file")
    if not os.path.isdir(folder):
        raise ValueError(f"kvactors: event_log {event_log!r}: its folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ValueError(f"kvactors: event_log {event_log!r} cannot be written")


def _load_class(spec: str, where: str) -> type:
    module_name, _, attr = spec.partition(":")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except Exception as exc:  # not found, or its module raised (a SyntaxError too) while importing
        raise ValueError(f"kvactors: {where}.class {spec!r} cannot be imported: "
                         f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(obj, type) or not issubclass(obj, SecondaryTier):
        raise ValueError(f"kvactors: {where}.class {spec!r} is not a SecondaryTier subclass")
    return obj


def tier_controls(config: KvactorsConfig, tiers: Sequence[SecondaryTier]
                  ) -> tuple[dict[str, Any], dict[str, int]]:
    """The ``admission`` and ``max_queued_bytes`` arguments of ``TieringManager.start`` for the
    tiers :func:`build_tiers` built from ``config`` (by tier name; a tier without them gets the
    defaults: write-through, half the pool's bytes and at least 256 MiB)."""
    admission: dict[str, Any] = {}
    limits: dict[str, int] = {}
    for tier, entry in zip(tiers, config.tiers, strict=True):
        if "admission" in entry:
            admission[tier.name] = entry["admission"]
        if "max_queued_bytes" in entry:
            limits[tier.name] = entry["max_queued_bytes"]
    return admission, limits


def build_tiers(config: KvactorsConfig, identity: BlockIdentity | None) -> list[SecondaryTier]:
    """Construct the configured secondary tiers, in order.

    ``identity`` is required (None only where no wrapping is meant: tests, tools),
    so that no caller leaves a shared tier without isolation by forgetting it.
    With one, each tier is wrapped in a
    :class:`~kvactors.tiers.prefixed.PrefixedTier` keyed by its digest, so that
    the tier holds this engine's blocks beside those of other models and layouts
    and never answers with theirs (every kind alike: a memory tier too, so that a
    custom tier that happens to persist is covered without knowing it).
    ``ValueError`` naming the entry if a constructor refuses its arguments;
    tiers built before the failing one are shut down."""
    tiers: list[SecondaryTier] = []
    try:
        for index, entry in enumerate(config.tiers):
            kind = entry["type"]
            kwargs = {k: v for k, v in entry.items() if k != "type" and k not in CONTROL_KEYS}
            where = f"tiers[{index}]"
            try:
                if kind == "disk":
                    tier: SecondaryTier = DiskTier(kwargs.pop("root"), **kwargs)
                elif kind == "redis":
                    tier = RedisTier(kwargs.pop("url"), **kwargs)
                elif kind == "memory":
                    tier = MemoryTier(**kwargs)
                elif kind == "mooncake":
                    from kvactors.tiers.mooncake import MooncakeTier  # the extra mooncake

                    tier = MooncakeTier(kwargs.pop("master"), **kwargs)
                else:
                    cls = _load_class(str(entry["class"]), where)
                    tier = cls(**dict(entry.get("kwargs", {})))
            except OSError as exc:  # a root it may not create or write
                raise ValueError(f"kvactors: {where}{'.root' if kind == 'disk' else ''} ({kind}): {exc}") from exc
            except (TypeError, ValueError, ImportError) as exc:
                raise ValueError(f"kvactors: {where} ({kind}): {exc}") from exc
            except Exception as exc:  # a custom tier's constructor raised something else
                raise ValueError(f"kvactors: {where} ({kind}): its constructor raised "
                                 f"{type(exc).__name__}: {exc}") from exc
            tiers.append(tier if identity is None else PrefixedTier(tier, identity.digest))
    except BaseException:
        for tier in tiers:
            with contextlib.suppress(Exception):  # the first error is the one to report
                tier.shutdown()
        raise
    if identity is not None and tiers:
        log = component_logger("vllm")  # stdlib "kvactors.vllm"; events in kvactors.log_schema
        log.info("block_identity", tiers=[t.name for t in tiers], **identity.describe())
    return tiers
