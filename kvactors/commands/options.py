"""Option types and checks shared by the ``kvactors`` commands.

Each ``type=`` function here turns one command-line string into a value,
or raises :class:`argparse.ArgumentTypeError`.
So a bad value is reported at parse time, before anything starts.
The report is ``kvactors <command>: error: argument --x: ...``, with exit status 2.
The type functions create nothing.
Checks that need to touch the file system for real (create a directory, write a probe file)
run in :func:`prepare_dir`.
The commands call it before starting a run.
It removes what it created if the run does not go ahead.

The commands check combinations of options (and sizes that cannot be allocated) after parsing.
Those checks raise :class:`OptionError`, which the commands print the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import shutil
import signal
import tempfile
from collections.abc import Callable, Sequence
from typing import NoReturn


class Termination:
    """SIGTERM (a service manager's stop, ``kill``) taken as Ctrl-C.

    The handler raises ``KeyboardInterrupt``, so a command stops what it started as for Ctrl-C.
    :meth:`status` makes it exit 143 rather than 130.
    ``kvactors.cli.main`` installs it for the length of one command, on the main thread only.
    """

    def __init__(self) -> None:
        self.seen = False

    def __call__(self, signum: int, frame: object) -> None:
        self.seen = True
        raise KeyboardInterrupt

    def status(self) -> int:
        """The exit status of a command stopped by an interrupt."""
        return 128 + signal.SIGTERM if self.seen else 130


TERMINATION = Termination()


#: Largest size accepted for any byte count (1 PiB). A larger one is a typo, not a plan.
MAX_SIZE = 1 << 50

_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1000, "kib": 1024, "m": 1024**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1024**3, "gb": 1000**3, "gib": 1024**3, "t": 1024**4, "tb": 1000**4, "tib": 1024**4}

SIZE_SYNTAX = "SIZE: bytes, or with a suffix: 16KiB, 1MiB, 2GiB (KB, MB, GB: powers of 1000)"

FAULT_NAMES = ("fail", "raise", "stall", "slow", "partial", "lie", "lookup_raise", "hang")
JOB_FAULTS = ("fail", "raise", "stall", "slow", "partial", "lie")
FAULT_SYNTAX = ("SPEC: 'none' or NAME=P[,NAME=P...], NAME one of " + ", ".join(FAULT_NAMES)
                + "; P a probability in [0, 1]; " + "+".join(JOB_FAULTS) + " <= 1 (each job draws one)")


class OptionError(Exception):
    """A bad option or combination of options found after parsing (exit status 2)."""


class Parser(argparse.ArgumentParser):
    """An argument parser whose error is one line on stderr, and exit status 2.

    The line is ``PROG: error: MESSAGE``.
    argparse's own ``error`` prints the whole usage first.
    A user who typed one bad value needs the one line, and ``--help`` has the rest.
    """

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


# --------------------------------------------------------------------- numbers


def _number(text: str, kind: type[int] | type[float]) -> int | float:
    stripped = text.strip()
    try:
        value = int(stripped) if kind is int else float(stripped)
    except ValueError:
        noun = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def integer(low: int, high: int) -> Callable[[str], int]:
    """A ``type=`` for an int in ``[low, high]``."""

    def parse(text: str) -> int:
        value = int(_number(text, int))
        if value < low:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}" if low == 1 else
                                             f"must be at least {low}, got {text!r}")
        if value > high:
            raise argparse.ArgumentTypeError(f"must be at most {high}, got {text!r}")
        return value

    parse.__name__ = "integer"
    return parse


def number(low: float, high: float, *, low_open: bool = False) -> Callable[[str], float]:
    """A ``type=`` for a finite float in ``[low, high]`` (``(low, high]`` with ``low_open``)."""

    def parse(text: str) -> float:
        value = float(_number(text, float))
        if not (low < value if low_open else low <= value):
            raise argparse.ArgumentTypeError(f"must be {'>' if low_open else '>='} {low:g}, got {text!r}")
        if value > high:
            raise argparse.ArgumentTypeError(f"must be at most {high:g}, got {text!r}")
        return value

    parse.__name__ = "number"
    return parse


probability = number(0.0, 1.0)
"""A ``type=`` for a probability in ``[0, 1]``."""


def parse_size(text: str, *, high: int = MAX_SIZE) -> int:
    """``4096``, ``256KiB``, ``1GiB``, ``1.5MB`` -> bytes (an int in ``[1, high]``). For argparse ``type=``."""
    m = re.fullmatch(r"\s*([-+]?)([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(3).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"invalid size {text!r} ({SIZE_SYNTAX})")
    if m.group(1) == "-":
        raise argparse.ArgumentTypeError(f"size must be a whole number of bytes > 0, got {text!r}")
    digits, unit = m.group(2), _UNITS[m.group(3).lower()]
    whole, _, frac = digits.partition(".")
    # Exact arithmetic: a float would round 10**30 and accept 1.0000000001 KiB as a whole number.
    numerator = int(whole or "0") * 10 ** len(frac) + int(frac or "0")
    value, rest = divmod(numerator * unit, 10 ** len(frac))
    if rest or value <= 0:
        raise argparse.ArgumentTypeError(f"size must be a whole number of bytes > 0, got {text!r}")
    if value > high:
        raise argparse.ArgumentTypeError(f"size {text!r} is more than {format_bytes(high)}")
    return value


def format_bytes(n: float) -> str:
    """``65536`` -> ``64.0 KiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"


# --------------------------------------------------------------------- paths


def _existing_ancestor(path: str) -> str:
    parent = path
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    return parent


def directory(text: str) -> str:
    """A ``type=`` for a directory that exists or can be created. Creates nothing.

    Returns its absolute path.
    """
    if not text.strip():
        raise argparse.ArgumentTypeError("the directory name is empty")
    path = os.path.abspath(os.path.expanduser(text))
    if os.path.lexists(path):
        if not os.path.isdir(path):
            raise argparse.ArgumentTypeError(f"{text}: exists and is not a directory")
        if not os.access(path, os.W_OK | os.X_OK):
            raise argparse.ArgumentTypeError(f"{text}: not writable")
        return path
    ancestor = _existing_ancestor(path)
    if not os.path.isdir(ancestor):
        raise argparse.ArgumentTypeError(f"{text}: cannot be created ({ancestor} is not a directory)")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text}: cannot be created ({ancestor} is not writable)")
    return path


def output_file(text: str) -> str:
    """A ``type=`` for a file to write, whose directory exists or can be created.

    Returns its absolute path.
    """
    if not text.strip():
        raise argparse.ArgumentTypeError("the file name is empty")
    path = os.path.abspath(os.path.expanduser(text))
    if os.path.isdir(path) or text.endswith(os.sep):
        raise argparse.ArgumentTypeError(f"{text}: is a directory, not a file")
    if os.path.lexists(path) and not os.path.isfile(path):
        raise argparse.ArgumentTypeError(f"{text}: exists and is not a regular file")
    directory(os.path.dirname(path))  # the same checks for where it goes
    return path


def check_event_log(path: str | None, source: str, append: bool) -> None:
    """Check that an existing event log ``path`` (named by ``source``) is written to only with ``--append-log``.

    Raises :class:`OptionError` otherwise.
    """
    if path is not None and os.path.exists(path) and not append:
        raise OptionError(f"{source} {path}: the file exists (add --append-log to append to it)")


def plot_file(text: str) -> str:
    """A ``type=`` for ``--plot``, a file whose suffix matplotlib can write.

    matplotlib must be installed.
    """
    path = output_file(text)
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise argparse.ArgumentTypeError("needs matplotlib: pip install matplotlib "
                                         "(or pip install 'kvactors[plot]')") from None
    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    suffix = os.path.splitext(path)[1].lstrip(".").lower()
    if suffix not in formats:
        raise argparse.ArgumentTypeError(f"{text}: the file name must end in one of "
                                         + ", ".join("." + f for f in formats))
    return path


def prepare_dir(path: str, option: str, created: list[str]) -> None:
    """Create ``path`` if needed and write a probe file in it. Raises :class:`OptionError` if it cannot.

    The directories this call created are appended to ``created``, outermost first.
    So the caller can remove them when the run does not go ahead.
    """
    path = os.path.abspath(path or os.curdir)  # "" (a bare file name's directory) is the current one
    missing = []
    parent = path
    while not os.path.lexists(parent):
        missing.append(parent)
        parent = os.path.dirname(parent)
    try:
        os.makedirs(path, exist_ok=True)
        created.extend(reversed(missing))
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise OptionError(f"{option} {path}: not writable ({exc.strerror or exc})") from None


def remove_created(created: Sequence[str]) -> None:
    """Remove the directories :func:`prepare_dir` created, innermost first, if they are still empty."""
    for path in reversed(created):
        with contextlib.suppress(OSError):
            os.rmdir(path)


def free_disk(path: str) -> int:
    """Bytes free on the file system that holds ``path`` (or would hold it)."""
    return shutil.disk_usage(_existing_ancestor(os.path.abspath(path))).free


# --------------------------------------------------------------------- structured values


def tier_list(choices: Sequence[str]) -> Callable[[str], tuple[str, ...]]:
    """A ``type=`` for a comma-separated list of tier names from ``choices``.

    It allows no empties and no duplicates.
    """

    def parse(text: str) -> tuple[str, ...]:
        names = tuple(part.strip() for part in text.split(","))
        for name in names:
            if not name:
                raise argparse.ArgumentTypeError(f"empty tier name in {text!r} (a comma-separated list of "
                                                 f"{', '.join(choices)})")
            if name not in choices:
                raise argparse.ArgumentTypeError(f"unknown tier {name!r} (choose from {', '.join(choices)})")
        dups = sorted({name for name in names if names.count(name) > 1})
        if dups:
            raise argparse.ArgumentTypeError(f"tier {dups[0]!r} is listed twice in {text!r}")
        return names

    parse.__name__ = "tier_list"
    return parse


def fault_spec(text: str) -> dict[str, float]:
    """A ``type=`` for fault probabilities.

    It takes ``none`` or ``fail=0.05,raise=0.01,...`` (see :data:`FAULT_SYNTAX`).
    """
    if text.strip().lower() == "none":
        return {}
    values: dict[str, float] = {}
    for part in text.split(","):
        name, eq, value = (s.strip() for s in part.partition("="))
        if not name or not eq:
            raise argparse.ArgumentTypeError(f"{part.strip()!r} in {text!r} is not NAME=P ({FAULT_SYNTAX})")
        if name not in FAULT_NAMES:
            raise argparse.ArgumentTypeError(f"unknown fault {name!r} (choose from {', '.join(FAULT_NAMES)})")
        if name in values:
            raise argparse.ArgumentTypeError(f"fault {name!r} is given twice in {text!r}")
        try:
            values[name] = probability(value)
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"fault {name}: {exc}") from None
    total = sum(values.get(name, 0.0) for name in JOB_FAULTS)
    if total > 1.0 + 1e-9:
        raise argparse.ArgumentTypeError(f"the job faults of {text!r} add up to {total:g} > 1 (each job draws one)")
    return values


def redis_url(text: str) -> str:
    """A ``type=`` for a Redis URL whose server answers ``PING`` within a second."""
    if not text.strip():
        raise argparse.ArgumentTypeError("the URL is empty (e.g. redis://localhost:6379/0)")
    import redis

    try:
        client = redis.Redis.from_url(text, socket_connect_timeout=1.0, socket_timeout=1.0)
    except Exception as exc:  # redis-py raises ValueError, TypeError, ... for URLs it cannot use
        raise argparse.ArgumentTypeError(f"{text}: not a Redis URL ({exc}; e.g. redis://localhost:6379/0)") from None
    try:
        client.ping()
    except Exception as exc:
        raise argparse.ArgumentTypeError(f"{text}: the server does not answer PING within 1 s ({exc})") from None
    finally:
        client.close()
    return text


# --------------------------------------------------------------------- memory


def available_memory() -> int | None:
    """Bytes of memory this process can still allocate, as far as the system says, or None if unknown.

    It is ``MemAvailable`` from ``/proc/meminfo``, lowered by a cgroup v2 limit when one applies.
    """
    found: list[int] = []
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
                    break
    except (OSError, ValueError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max", encoding="ascii") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current", encoding="ascii") as f:
            current = int(f.read().strip())
        if limit != "max":
            found.append(max(int(limit) - current, 0))
    except (OSError, ValueError):
        pass
    if not found:
        try:
            found.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (OSError, ValueError):
            return None
    return min(found)


def check_memory(parts: Sequence[tuple[str, int]], *, available: int | None = None) -> None:
    """Raise :class:`OptionError` if the allocations ``parts`` ((what, bytes), ...) exceed the memory available."""
    total = sum(n for _, n in parts)
    available = available_memory() if available is None else available
    if available is not None and total > available:
        detail = " + ".join(f"{what} {format_bytes(n)}" for what, n in parts if n)
        raise OptionError(f"needs {format_bytes(total)} of memory ({detail}); "
                          f"{format_bytes(available)} available")


def is_allocation_error(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocator's refusal (``MemoryError``, torch's ``RuntimeError`` out of memory)."""
    if isinstance(exc, MemoryError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("alloc" in text or "out of memory" in text)
