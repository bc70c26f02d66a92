"""The names a transfer job carries in the counters, the metrics and the log.

Each is a ``StrEnum``: a member equals its string, so a log field, a metric
label or a key built from one reads exactly as the literal did. Plain values,
safe from any thread.
"""

from __future__ import annotations

import enum


class JobKind(enum.StrEnum):
    """What a job does (the ``kind`` label)."""

    STORE = "store"
    """A ``prepare_store`` call on the primary pool (tier ``cpu``)."""
    LOAD = "load"
    """A ``prepare_load`` call on the primary pool (tier ``cpu``)."""
    CASCADE = "cascade"
    """A block copied from the pool to a secondary tier."""
    PROMOTION = "promotion"
    """A block copied from a secondary tier into the pool."""


TIER_JOB_KINDS: tuple[JobKind, ...] = (JobKind.CASCADE, JobKind.PROMOTION)
"""The kinds of a secondary tier's jobs."""


class JobOutcome(enum.StrEnum):
    """How a job ended (the ``outcome`` label)."""

    OK = "ok"
    FAILED = "failed"
    TIMED_OUT = "timed_out"


class DropReason(enum.StrEnum):
    """Why a job failed before it reached its tier (``job_dropped``'s ``reason``)."""

    TIER_STUCK = "tier_stuck"
    """Its tier is stuck inside a call: sent, the job would hold its rows until the tier moves."""
    NO_REQUEST = "no_request"
    """Its request was finalized already (a guard; unreachable while the counts are right)."""
    TIMED_OUT = "timed_out"
    """It waited in its tier's queue past its deadline."""
    RESET = "reset"
    """``reset_cache`` dropped the queued jobs."""
    STOPPING = "stopping"
    """``stop`` dropped the queued jobs."""
