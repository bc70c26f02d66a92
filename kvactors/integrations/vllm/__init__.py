"""kvactors as an out-of-tree offloading backend of vLLM (extra ``vllm``, for vLLM 0.32.x and 0.33.x).

Select it with ``kv_connector="OffloadingConnector"`` and
``kv_connector_extra_config={"spec_name": "KvactorsOffloadingSpec",
"spec_module_path": "kvactors.integrations.vllm", "cpu_bytes_to_use": ...}``
(see docs/vllm.md, "Use").
The vLLM-free parts (:mod:`.config`, :mod:`.shm`) import without vLLM.
The spec, manager and worker need it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvactorsOffloadingManager", "KvactorsOffloadingSpec", "KvactorsOffloadingWorker"]


def __getattr__(name: str) -> Any:
    # Lazy: importing the package (e.g. its config module) must not need vLLM.
    if name == "KvactorsOffloadingSpec":
        from kvactors.integrations.vllm.spec import KvactorsOffloadingSpec

        return KvactorsOffloadingSpec
    if name == "KvactorsOffloadingManager":
        from kvactors.integrations.vllm.manager import KvactorsOffloadingManager

        return KvactorsOffloadingManager
    if name == "KvactorsOffloadingWorker":
        from kvactors.integrations.vllm.worker import KvactorsOffloadingWorker

        return KvactorsOffloadingWorker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
