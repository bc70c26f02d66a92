"""``SimConfig``: the settings of one ``simulate`` run, and their defaults (the one place they are written).

Plain data, with no torch.
The ``simulate`` command's options and their help read the defaults from here (:data:`DEFAULTS`).
So ``kvactors --help`` imports nothing heavy.
:mod:`kvactors.commands.simulate.runner` runs a config.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvactors.commands.simulate.traffic import WorkloadShape


def _default_shape() -> WorkloadShape:
    from kvactors.commands.simulate.traffic import WorkloadShape  # here: traffic imports torch

    return WorkloadShape()


@dataclass
class SimConfig:
    threads: int = 4
    requests: int | None = 2000
    """Turns to serve, where a preempted turn's retries count once. ``None`` serves until ``seconds``."""
    seconds: float | None = None
    """Stop starting turns after this long."""
    seed: int = 0
    block_bytes: int = 64 * 1024
    cpu_blocks: int = 256
    disk_dir: str = ""
    disk_bytes: int = 256 * 1024 * 1024
    redis_url: str | None = None
    redis_bytes: int | None = 256 * 1024 * 1024
    """Capacity of the RedisTier's namespace (``None``: the server's ``maxmemory``)."""
    event_log: str | None = None
    device: str = "cpu"
    preempt_p: float = 0.08
    abort_p: float = 0.04
    offload_chunk: int = 8
    pending_wait_s: float = 2.0
    transfer_timeout_s: float = 30.0
    sample_interval_s: float = 0.5
    shape: WorkloadShape = field(default_factory=_default_shape)


DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(SimConfig)
                            if f.default is not dataclasses.MISSING}
"""Each setting's default, by field name (``shape``, built on demand, is not here)."""
