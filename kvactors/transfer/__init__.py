"""Moving KV bytes between the server's device cache and the primary pool.

:class:`TransferEngine` drives a :class:`~kvactors.TieringManager`: CPU copy
threads (native ones, :mod:`kvactors.transfer.native`, where the extension is
built; torch's otherwise) or CUDA streams move the bytes off the caller's
thread, and each completion is posted back to the actors.
"""

from kvactors.transfer.engine import TransferEngine
from kvactors.transfer.native import native_copy_available
from kvactors.transfer.runs import copy_runs

__all__ = ["TransferEngine", "copy_runs", "native_copy_available"]
