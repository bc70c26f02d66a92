"""What differs between the vLLM versions kvactors supports (0.32.x, 0.33.x), in one place.

* 0.33 adds ``OffloadingManager.lock`` (callers hold it from a lookup HIT to
  the ``prepare_load`` that pins it), ``on_reset_flushed`` (workers reported
  every job in flight at the last ``reset_cache``), ``config_info`` and
  ``OffloadingSpec.config_info_keys``, and an ``expedited`` argument of
  ``OffloadingWorker.submit_load``. Our manager defines all of them; on 0.32
  nothing calls them.
* 0.32 has no reset fence: :data:`RESET_FLUSH_STEPS` scheduler steps after a
  ``reset_cache`` stand in for ``on_reset_flushed`` (the worker flushes the
  reset's jobs in the step that follows it).
"""

from __future__ import annotations

from vllm import __version__ as VLLM_VERSION
from vllm.v1.kv_offload import base as _base

SUPPORTED = ("0.32", "0.33")

HAS_RESET_FENCE = hasattr(_base.OffloadingManager, "on_reset_flushed")
HAS_CONFIG_INFO = hasattr(_base.OffloadingManager, "config_info")

# Steps after reset_cache after which a version without the fence treats the
# reset's stale jobs as flushed by the workers.
RESET_FLUSH_STEPS = 3


def version_supported(version: str = VLLM_VERSION) -> bool:
    return any(version == v or version.startswith(v + ".") for v in SUPPORTED)
