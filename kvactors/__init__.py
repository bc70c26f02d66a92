"""kvactors: tiered KV-cache offloading for LLM serving, on Pykka actors."""

from kvactors.core.errors import LifecycleError, ManagerStoppedError, TransferError
from kvactors.tiers.base import SecondaryTier
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
    "JobResult",
    "LifecycleError",
    "LoadStoreSpec",
    "LookupResult",
    "ManagerStoppedError",
    "OffloadKey",
    "OffloadingEvent",
    "PrepareStoreOutput",
    "ReqContext",
    "SecondaryTier",
    "TransferError",
    "TransferJob",
]
