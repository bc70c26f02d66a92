"""The value types of the public API (docs/guide.md, "Embedding it").

Every type here is immutable.
Values cross thread boundaries inside actor messages, which pykka passes by reference.
So nothing may be mutated after it has been sent.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeAlias

OffloadKey: TypeAlias = bytes
"""Identifies one block of KV data (in vLLM: a prefix hash)."""


@dataclass(frozen=True, slots=True)
class ReqContext:
    """One attempt of one request.

    A preempted request comes back with ``attempt + 1``.
    The two attempts are different identities with separate state.
    Equality and hashing use ``(req_id, attempt)`` only, so ``params`` may hold unhashable values.
    """

    req_id: str
    attempt: int = 0
    params: Mapping[str, Any] | None = field(default=None, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.req_id, str) or not self.req_id:
            raise ValueError(f"req_id must be a non-empty str, got {self.req_id!r}")
        if not isinstance(self.attempt, int) or isinstance(self.attempt, bool) or self.attempt < 0:
            raise ValueError(f"attempt must be an int >= 0, got {self.attempt!r}")
        if self.params is not None and not isinstance(self.params, Mapping):
            raise ValueError(f"params must be a Mapping or None, got {type(self.params).__name__}")

    @property
    def identity(self) -> tuple[str, int]:
        """``(req_id, attempt)``, the key of every per-request state."""
        return (self.req_id, self.attempt)

    def __str__(self) -> str:
        return f"{self.req_id}#{self.attempt}"


class LookupResult(enum.Enum):
    """The answer for one key of a lookup."""

    MISS = "miss"
    """Nowhere."""
    HIT = "hit"
    """Ready in the primary pool: ``prepare_load`` may be called now."""
    HIT_PENDING = "hit_pending"
    """Present but not ready: being stored, or being promoted from a secondary tier."""
    RETRY = "retry"
    """A tier could not answer in time; ask again later."""


@dataclass(frozen=True, slots=True)
class LoadStoreSpec:
    """Rows of the primary pool, in the order of the keys asked for."""

    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class PrepareStoreOutput:
    """What ``prepare_store`` allocated.

    ``store_spec`` has one row per key of ``keys_to_store``, in that order.
    Keys already present in the pool are left out of ``keys_to_store``.
    """

    keys_to_store: list[OffloadKey]
    store_spec: LoadStoreSpec
    evicted_keys: list[OffloadKey]


@dataclass(frozen=True, slots=True)
class OffloadingEvent:
    """Blocks stored (``removed=False``) or evicted/removed (``True``) at a tier."""

    keys: tuple[OffloadKey, ...]
    tier: str
    removed: bool


@dataclass(frozen=True, slots=True)
class TransferJob:
    """Work handed to a secondary tier.

    A store copies ``pool[block_ids]`` into the tier under ``keys``.
    A promotion (``is_promotion``) loads ``keys`` from the tier into those rows.
    """

    job_id: int
    keys: tuple[OffloadKey, ...]
    block_ids: tuple[int, ...]
    req_context: ReqContext
    is_promotion: bool


@dataclass(frozen=True, slots=True)
class JobResult:
    """A tier's report that a job ended.

    With ``successful_keys=None``, every key of the job follows ``success``.
    With a tuple, the job ended for each key on its own, whatever ``success`` says.
    The keys in the tuple succeeded, and the job's other keys failed, as with vLLM's ``JobResult.successful_keys``.
    A report may not fit its job.
    It may name a key the job does not have, hold a value that is not a tuple of keys,
    or have a ``success`` that is not a bool.
    The runtime then takes every key of the job as failed (:func:`kvactors.core.outcomes.key_outcomes`).
    """

    job_id: int
    success: bool
    error: str | None = None
    successful_keys: tuple[OffloadKey, ...] | None = None


PRIMARY_TIER_NAME = "cpu"
"""The name the primary (CPU) tier has in events and logs."""
