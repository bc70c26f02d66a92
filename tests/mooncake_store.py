"""Run a throwaway Mooncake Store for tests and benchmarks: a ``mooncake_master`` on a free
port and *holders*, client processes that contribute memory segments.

Usage::

    with MooncakeMaster() as master:
        with Holder(master.address, segment_bytes=64 << 20) as holder:
            ...                   # MooncakeTier(master.address) stores into the holder's segment
            holder.freeze()       # SIGSTOP; thaw() continues it; kill() ends it
        master.kill(); master.restart()   # same port, every key gone

Only the standard library is imported at module level (``mooncake`` is only needed by
the holder process), so scripts can reuse it by adding the repository root to ``sys.path``.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from types import TracebackType


def find_master() -> str | None:
    """The ``mooncake_master`` binary of the installed ``mooncake`` package, or None."""
    try:
        spec = importlib.util.find_spec("mooncake")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        binary = Path(location) / "mooncake_master"
        if os.access(binary, os.X_OK):
            return str(binary)
    return None


def mooncake_usable() -> bool:
    """Whether Mooncake's master and client can run here (the package and libibverbs)."""
    if find_master() is None:
        return False
    try:
        import mooncake.store  # noqa: F401
    except ImportError:
        return False
    return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _listens(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _wait(predicate: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout} s")
        time.sleep(0.05)


class MooncakeMaster:
    """A ``mooncake_master`` on 127.0.0.1 (``address`` is ``"127.0.0.1:port"``); a holder that
    stops heartbeating is dropped after ``client_ttl`` seconds."""

    def __init__(self, *, client_ttl: int = 2, lease_ttl_ms: int = 1000, port: int | None = None) -> None:
        binary = find_master()
        if binary is None:
            raise RuntimeError("mooncake_master not found: pip install mooncake-transfer-engine-non-cuda")
        self.binary = binary
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.client_ttl = client_ttl
        self.lease_ttl_ms = lease_ttl_ms
        self._workdir = tempfile.TemporaryDirectory(prefix="kvactors-mooncake-")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> MooncakeMaster:
        self.proc = subprocess.Popen(
            [self.binary, "--rpc_address=127.0.0.1", f"--rpc_port={self.port}",
             f"--default_kv_lease_ttl={self.lease_ttl_ms}", f"--client_ttl={self.client_ttl}",
             "--eviction_high_watermark_ratio=0.9", "--eviction_ratio=0.2", "--enable_http_metadata_server=false",
             f"--metrics_port={free_port()}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=self._workdir.name,
        )
        _wait(lambda: _listens(self.port) or self.proc.poll() is not None, 20, "mooncake_master listening")  # type: ignore[union-attr]
        if self.proc.poll() is not None:
            raise RuntimeError(f"mooncake_master exited: {self.proc.returncode}")
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)

    def restart(self) -> None:
        """A new master on the same port: it knows no key and no segment."""
        self.kill()
        self.start()

    def freeze(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.kill()
        self._workdir.cleanup()


_HOLDER = textwrap.dedent("""
    import sys, time
    from mooncake.store import MooncakeDistributedStore
    store = MooncakeDistributedStore()
    code = store.setup("127.0.0.1", "P2PHANDSHAKE", int(sys.argv[2]), 16 << 20, "tcp", "", sys.argv[1])
    print("ready" if code == 0 else f"failed {code}", flush=True)
    sys.stdin.read()  # until the test closes our stdin
""")


class Holder:
    """A client process contributing ``segment_bytes`` to the store at ``master``."""

    def __init__(self, master: str, *, segment_bytes: int = 64 << 20) -> None:
        self.master = master
        self.segment_bytes = segment_bytes
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Holder:
        self.proc = subprocess.Popen([sys.executable, "-c", _HOLDER, self.master, str(self.segment_bytes)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().decode().strip()
        if line != "ready":
            self.kill()
            raise RuntimeError(f"mooncake holder did not start: {line!r}")
        return self

    def freeze(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)

    def __enter__(self) -> Holder:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.kill()
