"""RedisTier through the whole runtime: across processes, and with the server killed mid-run."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from kvactors import LookupResult, RedisTier, ReqContext, TieringManager
from tests.support import settled, wait_for

pytestmark = pytest.mark.redis

BLOCK = 4096
ROOT = pathlib.Path(__file__).resolve().parent.parent


def block_bytes(key: bytes) -> torch.Tensor:
    """What a block must hold: derived from its key, the same in every process."""
    generator = torch.Generator().manual_seed(int.from_bytes(key[-4:], "little"))
    return torch.randint(0, 256, (BLOCK,), dtype=torch.uint8, generator=generator)


WRITER = textwrap.dedent(
    """
    import sys
    import torch
    from kvactors import RedisTier, ReqContext, TieringManager
    from tests.test_redis_integration import block_bytes

    url, namespace, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    keys = [b"shared-%04d" % n for n in range(count)]
    with TieringManager.start(num_blocks=count, block_bytes=4096,
                              secondary_tiers=[RedisTier(url, namespace=namespace)]) as manager:
        ctx = ReqContext("writer")
        manager.on_new_request(ctx)
        out = manager.prepare_store(keys, ctx)
        for key, row in zip(out.keys_to_store, out.store_spec.block_ids):
            manager.pool[row].copy_(block_bytes(key))
        manager.complete_store(out.keys_to_store, ctx)
        manager.on_request_finished(ctx)
        assert manager.wait_idle(30)
        stats = manager.stats()
        assert stats["jobs_succeeded"] == 1 and stats["contract_violations"] == 0, stats
    print("stored", len(out.keys_to_store))
    """
)


@pytest.mark.timeout(120)
def test_a_second_process_promotes_what_the_first_stored(redis_server):
    count = 24
    written = subprocess.run([sys.executable, "-c", WRITER, redis_server.url, "tenant-a", str(count)],
                             capture_output=True, text=True, timeout=90, cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert written.returncode == 0, written.stderr
    assert written.stdout.split() == ["stored", str(count)]

    keys = [b"shared-%04d" % n for n in range(count)]
    tier = RedisTier(redis_server.url, namespace="tenant-a")
    other = RedisTier(redis_server.url, name="other", namespace="tenant-b")
    with TieringManager.start(num_blocks=count, block_bytes=BLOCK, secondary_tiers=[other, tier]) as manager:
        ctx = ReqContext("reader")
        manager.on_new_request(ctx)
        assert manager.lookup(keys, ctx) == [LookupResult.HIT_PENDING] * count  # promoted from tenant-a only
        assert manager.wait_idle(30)
        assert manager.lookup(keys, ctx) == [LookupResult.HIT] * count
        spec = manager.prepare_load(keys, ctx)
        for key, row in zip(keys, spec.block_ids, strict=True):
            assert torch.equal(manager.pool[row], block_bytes(key)), key
        manager.complete_load(keys, ctx)
        manager.on_request_finished(ctx)
        stats = settled(manager, 30)
        assert stats["contract_violations"] == 0 and stats["blocks_pinned"] == 0

    # Another namespace on the same server sees nothing.
    lonely = RedisTier(redis_server.url, namespace="tenant-b")
    with TieringManager.start(num_blocks=count, block_bytes=BLOCK, secondary_tiers=[lonely]) as manager:
        ctx = ReqContext("outsider")
        manager.on_new_request(ctx)
        assert manager.lookup(keys, ctx) == [LookupResult.MISS] * count
        manager.on_request_finished(ctx)


@pytest.mark.timeout(180)
def test_server_killed_and_restarted_during_concurrent_requests(redis_server):
    tier = RedisTier(redis_server.url, namespace="restart", timeout_s=0.5, retry_after_s=0.1)
    errors: list[BaseException] = []
    stop = threading.Event()

    def frontend(thread: int, manager: TieringManager) -> None:
        n = 0
        try:
            while not stop.is_set() and n < 400:
                ctx = ReqContext(f"t{thread}-{n}")
                keys = [b"r-%d-%d-%d" % (thread, n, j) for j in range(4)]
                manager.on_new_request(ctx)
                manager.lookup(keys, ctx)
                out = manager.prepare_store(keys, ctx)
                if out is not None:
                    for key, row in zip(out.keys_to_store, out.store_spec.block_ids, strict=True):
                        manager.pool[row].copy_(block_bytes(key))
                    manager.complete_store(out.keys_to_store, ctx)
                manager.on_request_finished(ctx)
                n += 1
        except BaseException as exc:
            errors.append(exc)

    with TieringManager.start(num_blocks=512, block_bytes=BLOCK, secondary_tiers=[tier],
                              transfer_timeout_s=5, lookup_timeout_s=2) as manager:
        threads = [threading.Thread(target=frontend, args=(t, manager)) for t in range(4)]
        for thread in threads:
            thread.start()
        assert wait_for(lambda: manager.stats()["jobs_succeeded"] >= 20, timeout=60)
        redis_server.kill()
        assert wait_for(lambda: manager.stats()["jobs_failed"] >= 1, timeout=60)  # jobs fail while it is down
        redis_server.restart()
        stop.set()
        for thread in threads:
            thread.join(60)
        assert not any(thread.is_alive() for thread in threads), "a frontend hung"
        assert not errors, errors[:3]
        stats = settled(manager, 60)
        assert stats["contract_violations"] == 0 and stats["internal_errors"] == 0
        assert stats["active_requests"] == 0 and stats["jobs_in_flight"] == 0

        # After the restart the tier works again: store, clear the pool, promote it back.
        ctx = ReqContext("after-restart")
        manager.on_new_request(ctx)
        keys = [b"after-%d" % j for j in range(8)]

        def stored_again() -> bool:
            out = manager.prepare_store(keys, ctx)
            if out is not None:
                for key, row in zip(out.keys_to_store, out.store_spec.block_ids, strict=True):
                    manager.pool[row].copy_(block_bytes(key))
                manager.complete_store(out.keys_to_store, ctx)
            before = manager.stats()["jobs_succeeded"]
            assert manager.wait_idle(30)
            if manager.stats()["jobs_succeeded"] > before:
                return True
            manager.reset_cache()  # the store failed (the tier was still backing off): try again
            return False

        assert wait_for(stored_again, timeout=30, interval=0.2)
        manager.reset_cache()
        assert manager.lookup(keys, ctx) == [LookupResult.HIT_PENDING] * len(keys)
        assert manager.wait_idle(30)
        spec = manager.prepare_load(keys, ctx)
        for key, row in zip(keys, spec.block_ids, strict=True):
            assert torch.equal(manager.pool[row], block_bytes(key))
        manager.complete_load(keys, ctx)
        manager.on_request_finished(ctx)
        assert settled(manager, 30)["contract_violations"] == 0
