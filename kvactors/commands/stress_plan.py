"""What a ``kvactors stress`` run is: its options, their combinations checked (:func:`plan`).

:mod:`kvactors.commands.stress` (the command: options, run, verdict) uses it.
So does :mod:`kvactors.commands.stress_run` (the run itself).
It is apart from both, so that checking a plan starts nothing.
It imports neither the runtime nor torch.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from dataclasses import dataclass

from kvactors.commands import options as opt
from kvactors.logs import ENV_EVENT_LOG

__all__ = ["PROG", "Plan", "plan"]

PROG = "kvactors stress"


@dataclass(frozen=True)
class Plan:
    """The run the options describe, once their combinations are checked."""

    tiers: tuple[str, ...]
    requests: int
    hang_after: float
    disk_bytes: int
    redis_bytes: int | None
    event_log: str | None
    """``--event-log``, or else ``KVACTORS_EVENT_LOG`` (where the manager would write anyway)."""
    event_log_source: str
    """Which of the two named it (for errors)."""


def plan(args: argparse.Namespace) -> Plan:
    """Check the combinations of options. Nothing starts.

    Raises :class:`~kvactors.commands.options.OptionError` for a bad combination.
    """
    tiers = list(args.tiers)
    if (args.disk_dir is not None or args.disk_bytes is not None) and "disk" not in tiers:
        tiers.append("disk")
    if args.redis is not None and "redis" not in tiers:
        tiers.append("redis")
    if "redis" in tiers and args.redis is None:
        raise opt.OptionError("the redis tier needs --redis URL")
    if args.redis_bytes is not None and args.redis is None:
        raise opt.OptionError("--redis-bytes needs --redis URL")
    requests = args.requests
    if requests is None:
        requests = 200 if args.seconds is None else 10**12  # --seconds alone: only the time bounds the run
    timeout = args.transfer_timeout
    hang_after = args.hang_after if args.hang_after is not None else max(10.0, 3 * timeout)
    if hang_after <= timeout:
        raise opt.OptionError(f"--hang-after {hang_after:g} must be more than --transfer-timeout {timeout:g} "
                              "(a call may wait that long)")
    block = args.block_bytes
    disk_bytes = args.disk_bytes if args.disk_bytes is not None else 64 * args.cpu_blocks * block
    for name, capacity in (("disk", disk_bytes if "disk" in tiers else None), ("redis", args.redis_bytes)):
        if capacity is not None and capacity < 4 * (block + 256):
            raise opt.OptionError(f"--{name}-bytes {capacity} holds fewer than 4 blocks of {block} bytes")
    if "disk" in tiers and args.disk_bytes is not None:
        free = opt.free_disk(args.disk_dir or tempfile.gettempdir())
        if disk_bytes > free:
            raise opt.OptionError(f"--disk-bytes {opt.format_bytes(disk_bytes)} is more than the "
                                  f"{opt.format_bytes(free)} free on the disk tier's file system")
    event_log, source = args.event_log, "--event-log"
    if event_log is None and os.environ.get(ENV_EVENT_LOG):
        # Where the manager would write: checked as --event-log is.
        source = ENV_EVENT_LOG
        try:
            event_log = opt.output_file(os.environ[ENV_EVENT_LOG])
        except argparse.ArgumentTypeError as exc:
            raise opt.OptionError(f"{ENV_EVENT_LOG}: {exc}") from None
    opt.check_event_log(event_log, source, args.append_log)
    try:
        opt.check_memory([("the CPU pool (--cpu-blocks x --block-bytes)", args.cpu_blocks * block),
                          ("block patterns (--keys x --block-bytes)", min(args.keys, 100_001) * block)])
    except opt.OptionError as exc:
        raise opt.OptionError(f"--cpu-blocks {args.cpu_blocks} --block-bytes {block}: {exc}") from None
    return Plan(tiers=tuple(tiers), requests=requests, hang_after=hang_after, disk_bytes=disk_bytes,
                redis_bytes=args.redis_bytes, event_log=event_log, event_log_source=source)
