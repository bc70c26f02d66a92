"""The vLLM integration's shared pool lives as long as its engine (issue 27): no vLLM needed.

* its name goes once every participant (the scheduler side, each worker rank) mapped it;
* a pool whose processes all died before that (SIGKILL) is reclaimed at the next start;
* one that a live process holds is never reclaimed;
* the stop hook chains to the handler that was there and never swallows a signal;
* opening a pool is bounded (the shared lock) and leaves nothing behind when it fails.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types

import pytest

from kvactors.integrations.vllm import shm, stops
from kvactors.integrations.vllm.shm import SharedPool, pool_file_size, reclaim_stale

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def shm_dir():
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    d = tempfile.mkdtemp(prefix="kvactors-test-", dir=base)
    yield d
    for name in os.listdir(d):
        os.unlink(os.path.join(d, name))
    os.rmdir(d)


def _pool(path: str, slot: int, participants: int = 3) -> SharedPool:
    return SharedPool(path, num_blocks=4, block_bytes=8, num_writers=participants - 1, participants=participants,
                      slot=slot)


def test_the_name_goes_once_every_participant_mapped_it(shm_dir) -> None:
    path = os.path.join(shm_dir, "kvactors_pool_e1")
    manager = _pool(path, 0)
    worker0 = _pool(path, 1)
    assert os.path.exists(path)  # worker 1 has not mapped it yet
    worker0.pool[1, 3] = 7
    assert int(manager.pool[1, 3]) == 7
    worker1 = _pool(path, 2)
    assert not os.path.exists(path) and worker1.unlinked
    worker1.pool[2, 2] = 5  # the mappings stay shared without the name
    assert int(manager.pool[2, 2]) == 5 and int(worker0.pool[2, 2]) == 5
    for pool in (manager, worker0, worker1):
        pool.close(unlink=True)
    assert os.listdir(shm_dir) == []


def test_close_removes_only_its_own_file(shm_dir) -> None:
    path = os.path.join(shm_dir, "kvactors_pool_e2")
    old = SharedPool(path, num_blocks=4, block_bytes=8)
    os.unlink(path)
    new = SharedPool(path, num_blocks=4, block_bytes=8)  # another engine's, under the same name
    old.close(unlink=True)
    assert os.path.exists(path)
    new.close(unlink=True)
    assert not os.path.exists(path)


def _holder(path: str) -> subprocess.Popen[str]:
    code = ("import time; from kvactors.integrations.vllm.shm import SharedPool; "
            f"p = SharedPool({path!r}, num_blocks=4, block_bytes=8, num_writers=1, participants=2, slot=0); "
            "print('mapped', flush=True); time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.stdout is not None and proc.stdout.readline().strip() == "mapped"
    return proc


@pytest.mark.timeout(60)
def test_a_pool_whose_owners_were_killed_is_reclaimed_at_the_next_start(shm_dir) -> None:
    path = os.path.join(shm_dir, "kvactors_pool_e3")
    holder = _holder(path)  # the scheduler side mapped it; its worker never came
    try:
        assert reclaim_stale(shm_dir) == []  # alive: never reclaimed
        assert os.path.exists(path)
        holder.send_signal(signal.SIGKILL)
        holder.wait(30)
        assert os.path.exists(path)  # SIGKILL: nothing of the process ran
        # The next engine's start (any pool of the folder) reclaims it.
        other = _pool(os.path.join(shm_dir, "kvactors_pool_next"), 0, participants=2)
        assert not os.path.exists(path)
        other.close(unlink=True)
    finally:
        holder.kill()
        holder.wait(30)


@pytest.mark.timeout(60)
def test_a_restarted_engine_with_the_same_engine_id_gets_a_fresh_pool(shm_dir) -> None:
    path = os.path.join(shm_dir, "kvactors_pool_same")
    holder = _holder(path)
    holder.send_signal(signal.SIGKILL)
    holder.wait(30)
    fresh = _pool(path, 0, participants=2)  # not the dead engine's half-registered file
    assert fresh.created
    worker = _pool(path, 1, participants=2)
    assert not os.path.exists(path)
    fresh.close(unlink=True)
    worker.close(unlink=True)


def test_stop_hook_chains_and_never_swallows_the_signal() -> None:
    # raise_signal: to the main thread itself, so its handler runs before the next line. SIGINT's
    # handler is set first: a process started from a background job inherits SIGINT ignored, and
    # Python then keeps it ignored (this test failed so under a CI run started with `&`).
    code = r'''
import os, signal, sys
from kvactors.integrations.vllm import stops
seen = []
signal.signal(signal.SIGTERM, lambda s, f: seen.append(s))
signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own, even if started with SIGINT ignored
class M:
    stopped = 0
    def shutdown(self):
        M.stopped += 1
        print('stopped', flush=True)
m = M()
stops.register(m)
signal.raise_signal(signal.SIGTERM)           # chained to the handler that was there
assert seen == [signal.SIGTERM] and stops.signalled(), seen
assert stops.stop_budget(30.0) == stops.SIGNAL_STOP_BUDGET_S
try:
    signal.raise_signal(signal.SIGINT)         # Python's own: KeyboardInterrupt, not swallowed
except KeyboardInterrupt:
    print("interrupted", flush=True)
signal.signal(signal.SIGTERM, signal.SIG_DFL)
stops._previous.clear(); stops._hook_signals()  # now nobody handles SIGTERM: stop, then die of it
print("before", M.stopped, flush=True)
signal.raise_signal(signal.SIGTERM)
print("survived", flush=True)
'''
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    assert "interrupted" in out.stdout and "before 0" in out.stdout, out
    assert "survived" not in out.stdout and out.returncode == -signal.SIGTERM, out
    assert out.stdout.index("before 0") < out.stdout.index("stopped"), out  # stopped, then died of it


@pytest.mark.timeout(60)
def test_a_second_stop_signal_kills_at_once_while_the_managers_stop() -> None:
    """Review: the SIG_DFL path started and joined a thread inside the handler, and a second signal
    re-entered it for another wait. Now the first puts SIG_DFL back and a helper thread stops."""
    code = r'''
import os, signal, threading
from kvactors.integrations.vllm import stops
class M:
    def shutdown(self):
        print('stopping', flush=True)
        threading.Event().wait(60)  # a stop that hangs (the budget bounds the handler's wait)
signal.signal(signal.SIGTERM, signal.SIG_DFL)
m = M()
stops.register(m)
assert [t for t in threading.enumerate() if t.name == 'kvactors-vllm-stop'], 'helper started at register'
signal.raise_signal(signal.SIGTERM)  # to this thread: its handler runs before the next line
print("survived", flush=True)
'''
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=ROOT))
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "stopping"
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == -signal.SIGTERM
        assert time.monotonic() - sent < (stops.SIGNAL_STOP_BUDGET_S + stops._MARGIN_S) / 2
        assert "survived" not in proc.stdout.read()
    finally:
        proc.kill()
        proc.wait(30)


def test_a_handler_installed_from_c_is_left_alone(monkeypatch) -> None:
    installed: list[int] = []
    monkeypatch.setattr(stops.signal, "getsignal", lambda sig: None)
    monkeypatch.setattr(stops.signal, "signal", lambda sig, handler: installed.append(sig))
    monkeypatch.setattr(stops, "_previous", {})
    stops._hook_signals()
    assert installed == [] and stops._previous == {}


@pytest.mark.timeout(30)
def test_a_pool_file_locked_exclusively_fails_in_bounded_time_naming_it(shm_dir, monkeypatch) -> None:
    path = os.path.join(shm_dir, "kvactors_pool_locked")
    first = SharedPool(path, num_blocks=4, block_bytes=8)
    holder = os.open(path, os.O_RDONLY)
    monkeypatch.setattr(shm, "LOCK_WAIT_S", 0.3)
    try:
        first.close(unlink=False)  # nobody holds it shared now; take it exclusively (as a reclaim does)
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        began = time.monotonic()
        with pytest.raises(TimeoutError, match="kvactors_pool_locked"):
            SharedPool(path, num_blocks=4, block_bytes=8)
        assert time.monotonic() - began < 5
        fcntl.flock(holder, fcntl.LOCK_UN)
        again = SharedPool(path, num_blocks=4, block_bytes=8)  # the lock is free: it opens (stale: afresh)
        again.close(unlink=True)
    finally:
        os.close(holder)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class _NoThread:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def start(self) -> None:
        raise RuntimeError("can't start new thread")


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_a_pool_whose_mapping_or_watcher_fails_leaves_nothing_behind(shm_dir, monkeypatch) -> None:
    path = os.path.join(shm_dir, "kvactors_pool_fails")
    before = _fds()

    def refuse(*args, **kwargs):
        raise RuntimeError("no buffer")

    with monkeypatch.context() as m:
        m.setattr(shm.torch, "frombuffer", refuse)
        with pytest.raises(RuntimeError, match="no buffer"):
            SharedPool(path, num_blocks=4, block_bytes=8)
    assert path not in shm._open_paths and not os.path.exists(path) and _fds() == before
    with monkeypatch.context() as m:
        m.setattr(shm, "threading", types.SimpleNamespace(Lock=threading.Lock, Thread=_NoThread))
        with pytest.raises(RuntimeError, match="can't start"):
            _pool(path, 0)  # not the last participant: it would watch
    assert path not in shm._open_paths and not os.path.exists(path) and _fds() == before


def test_the_pool_file_size_is_computed_once(shm_dir) -> None:
    path = os.path.join(shm_dir, "kvactors_pool_size")
    pool = _pool(path, 0, participants=3)
    try:
        assert os.path.getsize(path) == pool_file_size(4, 8, 2, 3) == 4 * 8 + 4 * 2 + 3
    finally:
        pool.close(unlink=True)
