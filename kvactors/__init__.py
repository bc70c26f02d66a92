"""kvactors: tiered KV-cache offloading for LLM serving, on Pykka actors."""

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
