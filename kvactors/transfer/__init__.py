"""Moving KV bytes between the server's device cache and the primary pool.

:class:`TransferEngine` drives a :class:`~kvactors.TieringManager`: CPU copy
threads or CUDA streams move the bytes off the caller's thread, and each
completion is posted back to the actors.
"""

from kvactors.transfer.engine import TransferEngine
from kvactors.transfer.runs import copy_runs

__all__ = ["TransferEngine", "copy_runs"]
