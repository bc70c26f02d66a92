"""Which copier copies between host tensors: the choice, written once.

The :class:`~kvactors.transfer.engine.TransferEngine` and the vLLM worker
(:mod:`kvactors.integrations.vllm.worker`) both choose through :func:`host_copier`.
Each builds its own copiers, so the choice takes them as constructors.
A device on a GPU is not chosen here: each caller builds its CUDA copier itself.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvactors.logs import EventLogger
from kvactors.transfer.jobs import Copier, J
from kvactors.transfer.native import MAX_THREADS as MAX_NATIVE_THREADS
from kvactors.transfer.native import native_copy_available

COPIERS = ("auto", "native", "torch")
"""The values of a ``copier`` argument."""

# Native threads per copy worker, at most: memory bandwidth is spent by a few threads, and a job
# of a few MiB has no more pieces than that.
_NATIVE_THREADS_PER_WORKER = 8


def check_copier(copier: object) -> None:
    """Raise ``ValueError`` unless ``copier`` is one of :data:`COPIERS`."""
    if copier not in COPIERS:
        raise ValueError(f"copier must be one of {', '.join(map(repr, COPIERS))}, got {copier!r}")


def native_threads(copy_workers: int) -> int:
    """The native copier's threads for ``copy_workers``.

    Each copy worker gets as many threads as torch's intra-op threads, at most 8.
    That is the parallelism each torch copy worker has.
    """
    return min(copy_workers * min(torch.get_num_threads(), _NATIVE_THREADS_PER_WORKER), MAX_NATIVE_THREADS)


def host_copier(choice: str, *, native: Callable[[], Copier[J]], torch_copier: Callable[[], Copier[J]],
                blocked: str | None, log: EventLogger) -> tuple[str, Copier[J]]:
    """The copier for ``choice`` and its name, ``"native"`` or ``"torch"``.

    ``choice`` is one of :data:`COPIERS`.
    ``"torch"`` builds the torch copier.
    ``"auto"`` and ``"native"`` build the native copier where it can run.
    It cannot run where the extension is not built, where ``blocked`` names a reason, or where
    ``native()`` raises ``RuntimeError``.
    Then ``"native"`` raises ``ValueError`` with the reason, and nothing is built.
    Then ``"auto"`` logs ``native_copier_unavailable`` with the reason and builds the torch copier.
    Thread-safe: it keeps no state.
    """
    if choice != "torch":
        why = "it is not built (no C compiler at install?)" if not native_copy_available() else blocked
        if why is None:
            try:
                return "native", native()
            except RuntimeError as exc:
                why = str(exc)
        if choice == "native":
            raise ValueError(f"copier='native' cannot be used: {why}")
        log.warning("native_copier_unavailable", error=why)
    return "torch", torch_copier()
