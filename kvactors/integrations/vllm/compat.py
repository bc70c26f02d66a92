"""What differs between the vLLM versions kvactors supports (0.32.x, 0.33.x), in one place.

* 0.33 adds four things.
  ``OffloadingManager.lock``: callers hold it from a lookup HIT to the ``prepare_load`` that pins it.
  ``on_reset_flushed``: workers reported every job in flight at the last ``reset_cache``.
  ``config_info`` and ``OffloadingSpec.config_info_keys``.
  An ``expedited`` argument of ``OffloadingWorker.submit_load``.
  Our manager defines all of them, and on 0.32 nothing calls them.
* 0.32 has no reset fence.
  :data:`RESET_FLUSH_STEPS` scheduler steps after a ``reset_cache`` stand in for ``on_reset_flushed``.
  The worker flushes the reset's jobs in the step that follows the reset.
* Both keep a request's offload keys and their positions only in the private
  ``ReqContext._offload_key_positions``.
  The public getter answers one key.
  :func:`offload_key_positions` reads the private mapping.
  It raises :class:`VllmCompatError` where a vLLM has no such attribute, instead of guessing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from vllm import __version__ as VLLM_VERSION
from vllm.v1.kv_offload import base as _base

SUPPORTED = ("0.32", "0.33")

HAS_RESET_FENCE = hasattr(_base.OffloadingManager, "on_reset_flushed")

_KEY_POSITIONS = "_offload_key_positions"
HAS_KEY_POSITIONS = dataclasses.is_dataclass(_base.ReqContext) and any(
    f.name == _KEY_POSITIONS for f in dataclasses.fields(_base.ReqContext))


class VllmCompatError(RuntimeError):
    """This vLLM lacks something kvactors reads from it.

    The message names vLLM's version and what is missing.
    """


def require_key_positions() -> None:
    """Raise ``VllmCompatError`` unless this vLLM's ``ReqContext`` declares ``_offload_key_positions``.

    It is checked once, when the scheduler side starts.
    So a mismatch fails the start, not a step.
    """
    if not HAS_KEY_POSITIONS:
        raise VllmCompatError(f"vLLM {VLLM_VERSION}: vllm.v1.kv_offload.base.ReqContext has no field "
                              f"{_KEY_POSITIONS!r}, which kvactors reads for a request's offload keys "
                              f"(supported vLLM versions: {', '.join(SUPPORTED)})")


def offload_key_positions(req_context: Any) -> Mapping[bytes, int]:
    """The request's offload keys and the position of each.

    This is vLLM's private ``ReqContext._offload_key_positions``, and the caller must not modify it.
    Raises ``VllmCompatError`` if ``req_context`` has no such mapping.
    """
    positions = getattr(req_context, _KEY_POSITIONS, None)
    if not isinstance(positions, Mapping):
        raise VllmCompatError(f"vLLM {VLLM_VERSION}: {type(req_context).__name__}.{_KEY_POSITIONS} is "
                              f"{type(positions).__name__}, not a mapping of offload keys to positions "
                              f"(supported vLLM versions: {', '.join(SUPPORTED)})")
    return positions

# Steps after reset_cache after which a version without the fence treats the
# reset's stale jobs as flushed by the workers.
RESET_FLUSH_STEPS = 3


def version_supported(version: str = VLLM_VERSION) -> bool:
    return any(version == v or version.startswith(v + ".") for v in SUPPORTED)
