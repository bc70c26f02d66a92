"""``KvactorsOffloadingSpec``: kvactors as the offloading backend of vLLM's ``OffloadingConnector``.

vLLM builds the spec in each process that needs it: the scheduler side asks
:meth:`~KvactorsOffloadingSpec.get_manager`, each worker
:meth:`~KvactorsOffloadingSpec.get_worker`. Both open the pool in shared memory
(:mod:`kvactors.integrations.vllm.shm`), sized from the same config, so the
multiprocess engine works like the in-process one.
"""

from __future__ import annotations

import os
from typing import Any

from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingManager, OffloadingSpec, OffloadingWorker
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvactors.integrations.vllm import compat, stops
from kvactors.integrations.vllm.config import build_tiers, parse_config, tier_controls
from kvactors.integrations.vllm.engine_config import check_shutdown_timeout, find_vllm_config
from kvactors.integrations.vllm.identity import block_identity
from kvactors.integrations.vllm.manager import KvactorsOffloadingManager
from kvactors.integrations.vllm.shm import SharedPool, check_pool_fits, pool_file_size, pool_path
from kvactors.integrations.vllm.tier_spec import TierType
from kvactors.integrations.vllm.weights import model_fingerprint
from kvactors.integrations.vllm.worker import KvactorsOffloadingWorker
from kvactors.manager import TieringManager


class KvactorsOffloadingSpec(OffloadingSpec):
    """Offloading spec selected by ``spec_name="KvactorsOffloadingSpec"``,
    ``spec_module_path="kvactors.integrations.vllm"``.

    The kvactors keys of ``kv_connector_extra_config`` are checked here (at
    engine start): a missing or wrong value, or an unknown key in a ``tiers``
    entry, is a ``ValueError`` naming it. A pool row is one vLLM offload chunk
    (``blocks_per_chunk`` blocks, their pages in every layer, for every worker
    rank); the pool has ``cpu_bytes_to_use // row_bytes`` rows.
    """

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        self.kv_config = parse_config(self.extra_config)
        # The engine's VllmConfig, which vLLM does not pass a spec (engine_config.py): the
        # shutdown timeout and the model's revision; None where it cannot be found.
        self.vllm_config = find_vllm_config()
        if not compat.version_supported():
            import warnings

            warnings.warn(f"kvactors: vLLM {compat.VLLM_VERSION} is not a tested version "
                          f"({', '.join(compat.SUPPORTED)})", stacklevel=2)
        per_block = int(config.worker_kv_bytes_per_block)
        if per_block <= 0:
            raise ValueError("kvactors: vLLM reported no KV bytes per block (worker_kv_bytes_per_block)")
        self.per_worker_bytes = per_block * int(self.blocks_per_chunk)
        self.num_writers = max(1, int(config.parallel.world_size))
        self.block_bytes = self.per_worker_bytes * self.num_writers
        self.num_blocks = self.kv_config.cpu_bytes_to_use // self.block_bytes
        if self.num_blocks <= 0:
            raise ValueError(f"kvactors: cpu_bytes_to_use={self.kv_config.cpu_bytes_to_use} holds no block of "
                             f"{self.block_bytes} bytes")
        self.participants = self.num_writers + 1  # the scheduler side and every worker rank
        self.pool_path = pool_path(config.engine_id)
        check_pool_fits(self.kv_config.cpu_bytes_to_use,
                        pool_file_size(self.num_blocks, self.block_bytes, self.num_writers, self.participants),
                        os.path.dirname(self.pool_path))

    def _open_pool(self, slot: int) -> SharedPool:
        # Mapped by the scheduler side (slot 0) and every worker rank (slot 1 + rank); its name goes
        # once all have mapped it (shm.py), so nothing of it outlives the engine however it ends.
        return SharedPool(self.pool_path, num_blocks=self.num_blocks, block_bytes=self.block_bytes,
                          num_writers=self.num_writers, participants=self.participants, slot=slot)

    def get_manager(self) -> OffloadingManager:
        compat.require_key_positions()  # before anything starts: a vLLM without it fails here, loudly
        shared = self._open_pool(0)
        try:
            # Blocks in the tiers carry the model's identity and the layout: see identity.py.
            weights = model_fingerprint(str(self.config.model.name), self.vllm_config,
                                        model_id=self.kv_config.model_id, identity_by=self.kv_config.identity_by)
            identity = block_identity(self.config, model_id=self.kv_config.model_id, block_bytes=self.block_bytes,
                                      weights=weights)
            tiers = build_tiers(self.kv_config, identity)
            admission, max_queued_bytes = tier_controls(self.kv_config, tiers)
            tm = TieringManager.start(
                num_blocks=self.num_blocks, block_bytes=self.block_bytes, secondary_tiers=tiers,
                eviction=self.kv_config.eviction_policy, transfer_timeout_s=self.kv_config.transfer_timeout_s,
                lookup_timeout_s=self.kv_config.lookup_timeout_s, event_log=self.kv_config.event_log,
                pool=shared.pool, admission=admission, max_queued_bytes=max_queued_bytes)
        except ValueError:
            shared.close(unlink=True)
            raise
        except Exception as exc:  # a tier's attach raised, say: say so, and which tiers there are
            shared.close(unlink=True)
            names = ", ".join(f"{spec.where} ({spec.type})" for spec in self.kv_config.tiers)
            raise ValueError(f"kvactors: the runtime did not start ({names or 'no tiers'}): "
                             f"{type(exc).__name__}: {exc}") from exc
        except BaseException:
            shared.close(unlink=True)
            raise
        # Said once per engine, at its start: vLLM's log and the lifecycle log (engine_config.py).
        check_shutdown_timeout(self.vllm_config, tm.door.log)
        kinds = {tier.name: spec.type.value for tier, spec in zip(tiers, self.kv_config.tiers, strict=True)}
        source = CacheHitSource.DISK if kinds and set(kinds.values()) == {TierType.DISK.value} \
            else CacheHitSource.EXTERNAL_UNSPECIFIED
        info: dict[str, Any] = {"kvactors_num_blocks": self.num_blocks, "kvactors_block_bytes": self.block_bytes,
                                "kvactors_tiers": ",".join(kinds) or "none"}
        manager = KvactorsOffloadingManager(tm, shared, events_enabled=self.kv_events_config.enable_kv_cache_events,
                                            tier_kinds=kinds, hit_source=source, config_info=info,
                                            lookup_timeout_s=self.kv_config.lookup_timeout_s)
        stops.register(manager)  # stopped on SIGTERM/SIGINT and at the process's exit too (stops.py)
        return manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        shared = self._open_pool(1 + int(self.config.parallel.rank))
        try:
            return KvactorsOffloadingWorker(
                kv_caches, shared, rank=int(self.config.parallel.rank), per_worker_bytes=self.per_worker_bytes,
                blocks_per_chunk=int(self.blocks_per_chunk), transfer_timeout_s=self.kv_config.transfer_timeout_s,
                owns_shared=True)
        except BaseException:
            shared.close(unlink=True)
            raise

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        """kvactors' families of :mod:`kvactors.metrics` in the server's ``/metrics`` (the
        frontend declares them; the manager's ``get_stats`` feeds them: see stats.py)."""
        from kvactors.integrations.vllm.stats import metric_definitions

        return {**super().build_metric_definitions(extra_config), **metric_definitions()}

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        return ("kvactors_num_blocks", "kvactors_block_bytes", "kvactors_tiers")

