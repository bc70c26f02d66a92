"""kvactors: tiered KV-cache offloading for LLM serving, on Pykka actors."""

from importlib.metadata import PackageNotFoundError, version

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

try:
    # One source: pyproject.toml's [project] version, as installed (tests/test_docs.py checks both agree).
    __version__: str = version("kvactors")
except PackageNotFoundError:  # a source tree on sys.path that was never installed
    __version__ = "0+unknown"

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
