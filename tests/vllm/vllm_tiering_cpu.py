"""vLLM's own ``TieringOffloadingSpec`` with its CUDA-only worker replaced by kvactors' CPU copy worker.

vLLM's ``CPUOffloadingWorker`` refuses to run without CUDA/XPU, so this spec
overrides ``get_worker`` only: it maps vLLM's own ``SharedOffloadRegion`` (the
region vLLM's scheduler side and its ``fs`` tier use) and copies with
:class:`~kvactors.integrations.vllm.worker.KvactorsOffloadingWorker`. Only the
scheduler side (manager, tiers) is vLLM's, which is what the comparisons measure.
Selected by ``spec_name="VllmTieringCpuWorkerSpec"``, ``spec_module_path="vllm_tiering_cpu"``
(this folder on ``sys.path``).
"""

from __future__ import annotations

from typing import Any

from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from kvactors.integrations.vllm.worker import KvactorsOffloadingWorker


class _RegionPool:
    """What ``KvactorsOffloadingWorker`` needs of a pool, over vLLM's ``SharedOffloadRegion``."""

    def __init__(self, region: SharedOffloadRegion, num_chunks: int, row_bytes: int) -> None:
        import torch

        self.region = region
        self.pool = region.base_tensor.view(torch.uint8)[: num_chunks * row_bytes].view(num_chunks, row_bytes)

    def mark(self, rows: Any, rank: int, value: int) -> None:
        return None  # vLLM's manager has no status table: vLLM itself asserts every copy succeeded

    def close(self, *, unlink: bool) -> None:
        self.region.cleanup()


class VllmTieringCpuWorkerSpec(TieringOffloadingSpec):
    """vLLM's ``TieringOffloadingSpec`` with kvactors' CPU copy worker."""

    def get_worker(self, kv_caches: Any) -> Any:
        if getattr(self, "_cpu_worker", None) is None:
            region = SharedOffloadRegion(engine_id=self._engine_id, num_chunks=self.num_chunks, rank=0,
                                         kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                                         cpu_page_size=self.cpu_page_size_per_worker)
            shared = _RegionPool(region, self.num_chunks, self.kv_bytes_per_chunk)
            self._cpu_worker = KvactorsOffloadingWorker(
                kv_caches, shared, rank=0, per_worker_bytes=self.cpu_page_size_per_worker,  # type: ignore[arg-type]
                blocks_per_chunk=int(self.blocks_per_chunk), transfer_timeout_s=20.0, owns_shared=True)
        return self._cpu_worker
