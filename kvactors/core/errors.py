"""Exceptions raised to callers of kvactors."""

from __future__ import annotations


class LifecycleError(Exception):
    """A caller broke the lifecycle contract.

    Examples: a submit call after ``on_request_finished``, an unknown or
    duplicate request, keys that were not prepared. It is raised to that caller
    only, and the runtime's state is unchanged by the call that raised it.
    """


class ManagerStoppedError(RuntimeError):
    """A call reached a ``TieringManager`` (or a ``TransferEngine``) after ``stop()``."""


class TransferError(RuntimeError):
    """A copy between the device cache and the primary pool failed."""
