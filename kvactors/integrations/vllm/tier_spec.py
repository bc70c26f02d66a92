"""One entry of ``tiers`` in vLLM's ``kv_connector_extra_config``, checked once into a :class:`TierSpec`.

Plain code, no vLLM import. :func:`parse_tier` checks an entry's keys and the
values kvactors knows the meaning of, and raises ``ValueError`` naming the key
at fault (``tiers[i].key``). What the tier's constructor alone can judge (a
Redis ``timeout_s``, a Mooncake ``segment_bytes``) stays in
:attr:`TierSpec.options` and is judged when the tier is built
(:func:`~kvactors.integrations.vllm.config.build_tiers`).

Threading: none; every function is pure but for :func:`parse_tier`'s reads of the entry.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import Any

from kvactors.core.admission import parse_admission
from kvactors.core.arguments import check_int


class TierType(StrEnum):
    """The value of a ``tiers`` entry's ``type``: which tier it builds."""

    DISK = "disk"
    REDIS = "redis"
    MEMORY = "memory"
    MOONCAKE = "mooncake"
    CUSTOM = "custom"


@dataclass(frozen=True)
class TierKeys:
    """The keys a tier type takes besides ``type`` and :data:`CONTROL_KEYS`."""

    required: tuple[str, ...]
    optional: tuple[str, ...]


CONTROL_KEYS = ("admission", "max_queued_bytes")
"""Keys every entry may carry besides its type's (docs/controls.md); they go to ``TieringManager.start``."""

TIER_KEYS: Mapping[TierType, TierKeys] = MappingProxyType({
    TierType.DISK: TierKeys(("root", "capacity_bytes"), ("name", "io_workers", "fsync", "direct_io")),
    TierType.REDIS: TierKeys(("url",), ("name", "namespace", "capacity_bytes", "cluster", "timeout_s", "io_workers",
                                        "retry_after_s")),
    TierType.MEMORY: TierKeys(("capacity_blocks",), ("name",)),
    TierType.MOONCAKE: TierKeys(("master",), ("name", "namespace", "segment_bytes", "local_buffer_bytes", "timeout_s",
                                              "io_workers", "retry_after_s", "local_host")),
    TierType.CUSTOM: TierKeys(("class",), ("kwargs",)),
})

_COUNTS = ("capacity_bytes", "capacity_blocks", "io_workers")  # ints >= 1
_FLAGS = ("fsync", "direct_io", "cluster")  # bools
_NAMES = ("root", "url", "master", "name", "namespace", "class")  # non-empty strings (or paths)

Admission = str | Mapping[str, Any]
"""An ``admission`` value as given (``"write_through"``, ``"write_back"``, ``{"min_seen": N}``), checked."""


@dataclass(frozen=True)
class TierSpec:
    """One checked ``tiers`` entry."""

    index: int
    """Its place in ``tiers``: errors name it ``tiers[index]``."""
    type: TierType
    options: Mapping[str, Any]
    """The keys of its type as given (read-only): the tier's constructor keywords, or for a
    custom tier its ``class`` and ``kwargs``."""
    admission: Admission | None = None
    """Which ready blocks go to the tier; None: the runtime's default."""
    max_queued_bytes: int | None = None
    """The bytes of cascades accepted for the tier and not yet reported; None: the runtime's default."""

    @property
    def where(self) -> str:
        """How errors name the entry: ``tiers[i]``."""
        return f"tiers[{self.index}]"

    @property
    def writes_back(self) -> bool:
        """Whether its admission is ``write_back``."""
        return self.admission is not None and parse_admission(self.admission).mode == "write_back"


def parse_tier(index: int, entry: object) -> TierSpec:
    """Check entry ``index`` of ``tiers``; ``ValueError`` naming the key at fault."""
    where = f"tiers[{index}]"
    if not isinstance(entry, Mapping):
        raise ValueError(f"kvactors: {where} must be a mapping, got {type(entry).__name__}")
    kind = entry.get("type")
    if not isinstance(kind, str) or kind not in TIER_KEYS:
        raise ValueError(f"kvactors: {where}.type must be one of {sorted(t.value for t in TierType)}, got {kind!r}")
    tier_type = TierType(kind)
    keys = TIER_KEYS[tier_type]
    optional = keys.optional + CONTROL_KEYS
    for key in entry:
        if key != "type" and key not in keys.required and key not in optional:
            raise ValueError(f"kvactors: unknown key {where}.{key} for a {kind} tier "
                             f"(known: {', '.join(keys.required + optional)})")
    for key in keys.required:
        if key not in entry:
            raise ValueError(f"kvactors: {where}.{key} is required for a {kind} tier")
    _check_values(where, tier_type, entry)
    admission = _admission(where, entry)
    max_queued_bytes = _max_queued_bytes(where, entry)
    if tier_type is TierType.CUSTOM:
        _check_custom(where, entry)
    options = {k: v for k, v in entry.items() if k != "type" and k not in CONTROL_KEYS}
    return TierSpec(index=index, type=tier_type, options=MappingProxyType(options), admission=admission,
                    max_queued_bytes=max_queued_bytes)


def _check_values(where: str, tier_type: TierType, entry: Mapping[str, Any]) -> None:
    for key in _COUNTS:
        # A Redis tier's capacity_bytes may be None: no limit.
        if key in entry and not (key == "capacity_bytes" and tier_type is TierType.REDIS and entry[key] is None):
            check_int(entry[key], f"kvactors: {where}.{key}")
    for key in _FLAGS:
        if key in entry and type(entry[key]) is not bool:
            raise ValueError(f"kvactors: {where}.{key} must be true or false, got {entry[key]!r}")
    for key in _NAMES:
        if key in entry and (not isinstance(entry[key], str | os.PathLike) or not str(entry[key])):
            raise ValueError(f"kvactors: {where}.{key} must be a non-empty string, got {entry[key]!r}")


def _admission(where: str, entry: Mapping[str, Any]) -> Admission | None:
    if "admission" not in entry:
        return None
    try:
        parse_admission(entry["admission"], f"kvactors: {where}.admission")
    except TypeError as exc:
        raise ValueError(str(exc)) from None
    value: Admission = entry["admission"]
    return value


def _max_queued_bytes(where: str, entry: Mapping[str, Any]) -> int | None:
    if "max_queued_bytes" not in entry:
        return None
    limit = entry["max_queued_bytes"]
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
        raise ValueError(f"kvactors: {where}.max_queued_bytes must be an int >= 0 (bytes), got {limit!r}")
    return limit


def _check_custom(where: str, entry: Mapping[str, Any]) -> None:
    spec = str(entry["class"])
    module_name, _, attr = spec.partition(":")
    if not module_name.strip() or not attr.strip():
        raise ValueError(f"kvactors: {where}.class must be 'module:Class', got {spec!r}")
    if not isinstance(entry.get("kwargs", {}), Mapping):
        raise ValueError(f"kvactors: {where}.kwargs must be a mapping, got {entry['kwargs']!r}")
