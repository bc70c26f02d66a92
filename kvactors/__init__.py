"""kvactors: tiered KV-cache offloading for LLM serving, on Pykka actors.

The public names (``from kvactors import TieringManager, ...``) are imported on first use (PEP 562).
So ``import kvactors`` alone, or the ``kvactors`` command's ``--help``, does not load torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    __version__: str
    from kvactors.aio import AsyncTieringManager
    from kvactors.core.errors import LifecycleError, ManagerStoppedError, TransferError
    from kvactors.manager import TieringManager
    from kvactors.tiers.base import SecondaryTier
    from kvactors.tiers.disk import DiskTier
    from kvactors.tiers.memory import MemoryTier
    from kvactors.tiers.redis import RedisTier
    from kvactors.transfer import TransferEngine
    from kvactors.types import (
        JobResult,
        LoadStoreSpec,
        LookupResult,
        OffloadingEvent,
        OffloadKey,
        PrepareStoreOutput,
        ReqContext,
        TransferJob,
    )

_SOURCES = {
    "AsyncTieringManager": "kvactors.aio",
    "DiskTier": "kvactors.tiers.disk",
    "JobResult": "kvactors.types",
    "LifecycleError": "kvactors.core.errors",
    "LoadStoreSpec": "kvactors.types",
    "LookupResult": "kvactors.types",
    "ManagerStoppedError": "kvactors.core.errors",
    "MemoryTier": "kvactors.tiers.memory",
    "OffloadKey": "kvactors.types",
    "OffloadingEvent": "kvactors.types",
    "PrepareStoreOutput": "kvactors.types",
    "RedisTier": "kvactors.tiers.redis",
    "ReqContext": "kvactors.types",
    "SecondaryTier": "kvactors.tiers.base",
    "TieringManager": "kvactors.manager",
    "TransferEngine": "kvactors.transfer",
    "TransferError": "kvactors.core.errors",
    "TransferJob": "kvactors.types",
}

__all__ = [
    "AsyncTieringManager",
    "DiskTier",
    "JobResult",
    "LifecycleError",
    "LoadStoreSpec",
    "LookupResult",
    "ManagerStoppedError",
    "MemoryTier",
    "OffloadKey",
    "OffloadingEvent",
    "PrepareStoreOutput",
    "RedisTier",
    "ReqContext",
    "SecondaryTier",
    "TieringManager",
    "TransferEngine",
    "TransferError",
    "TransferJob",
]


def _version() -> str:
    """pyproject.toml's [project] version, as installed.

    tests/test_docs.py checks that both agree.
    It is read on first use, because importlib.metadata costs most of a bare ``import kvactors``.
    """
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvactors")
    except PackageNotFoundError:  # a source tree on sys.path that was never installed
        return "0+unknown"


def __getattr__(name: str) -> Any:
    """Import a public name's module on first use, and keep the name here.

    Later uses cost nothing.
    ``__version__`` is loaded the same way.
    """
    if name == "__version__":
        value: Any = _version()
        globals()[name] = value
        return value
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module 'kvactors' has no attribute {name!r}")
    value = getattr(importlib.import_module(source), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, "__version__"})
