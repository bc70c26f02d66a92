"""Checks of the public calls' arguments, which raise a clear ``ValueError`` at the caller.

Every public method of :class:`~kvactors.TieringManager` and :class:`~kvactors.TransferEngine`
checks its arguments with these before it queues anything or changes any state.
Non-blocking methods do too.
Their misuse that only the actors can see, such as a key never prepared, is counted as a
``contract_violation`` instead.
The checks are strict on purpose.
A truthy string is not a flag, as ``success="False"`` would otherwise be a success.
``True`` is not an int.
A timeout is a finite number.

Pure functions, for any thread.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable
from typing import Any

from kvactors.types import OffloadKey, ReqContext

MAX_TIMEOUT_S = float(threading.TIMEOUT_MAX)
"""The longest timeout a wait can take (longer ones overflow ``threading``'s waits)."""


def check_ctx(ctx: object, name: str = "ctx") -> ReqContext:
    """``ctx`` if it is a :class:`ReqContext` (whose own checks ran when it was built)."""
    if not isinstance(ctx, ReqContext):
        raise ValueError(f"{name} must be a ReqContext, got {type(ctx).__name__}")
    return ctx


def check_keys(keys: Iterable[OffloadKey], name: str = "keys") -> tuple[OffloadKey, ...]:
    """``keys`` as a tuple of non-empty ``bytes``.

    The empty key ``b""`` is refused.
    A key names a block by its content (in vLLM, a prefix hash), which is never empty.
    The tiers derive names from it, such as a file named by its hex or a Redis key ``namespace:hex``.
    """
    if isinstance(keys, bytes | bytearray | memoryview | str):
        raise ValueError(f"{name} must be a sequence of bytes keys, not a single key")
    try:
        out = tuple(keys)
    except TypeError:
        raise ValueError(f"{name} must be an iterable of bytes keys, got {type(keys).__name__}") from None
    for key in out:
        if type(key) is not bytes:
            raise ValueError(f"a key must be bytes, got {type(key).__name__}")
        if not key:
            raise ValueError("the empty key b'' is not a key (a key is a block's non-empty content hash)")
    return out


def check_request(keys: Iterable[OffloadKey], ctx: object) -> tuple[tuple[OffloadKey, ...], ReqContext]:
    """``(keys, ctx)`` of a per-request call, checked in one order (keys, then ctx) so that
    the manager and the engine, given the same bad arguments, raise the same error."""
    return check_keys(keys), check_ctx(ctx)


def check_flag(value: object, name: str) -> bool:
    """``value`` if it is a ``bool`` (not a truthy string, number or None)."""
    if type(value) is not bool:
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value


def check_int(value: object, name: str, *, minimum: int = 1, maximum: int | None = None) -> int:
    """``value`` if it is an ``int`` (not ``True``) in ``[minimum, maximum]``."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be an int {bound}, got {value!r}")
    return value


def check_timeout(value: Any, name: str, *, allow_none: bool = True, allow_zero: bool = True) -> float | None:
    """``value`` as seconds.

    It must be a finite ``int`` or ``float``, not ``True``.
    It must be ``>= 0``, and ``> 0`` unless ``allow_zero``.
    It must be at most :data:`MAX_TIMEOUT_S`.
    It may be ``None`` where ``allow_none``.
    """
    if value is None and allow_none:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool):
        kinds = "a number of seconds" + (" or None" if allow_none else "")
        raise ValueError(f"{name} must be {kinds}, got {value!r}")
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero) or value > MAX_TIMEOUT_S:
        low = ">= 0" if allow_zero else "> 0"
        none = " (None: no timeout)" if allow_none else ""
        raise ValueError(f"{name} must be finite, {low} and <= {MAX_TIMEOUT_S:.0f} s{none}, got {value!r}")
    return float(value)
