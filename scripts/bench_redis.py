#!/usr/bin/env python
"""RedisTier throughput against the plain redis client, same server, same value size.

Measures, in one run:

* ``store``/``load``: ``RedisTier.submit_store``/``submit_load`` of ``--blocks`` blocks of
  ``--block-bytes``, in jobs of ``--job-blocks`` with ``--inflight`` jobs outstanding,
  timed from the first submit to the last report (records are encoded and verified
  with their XXH3 checksum, loads are copied into the pool);
* ``raw_set``/``raw_get``: pipelined ``SET``/``GET`` of values of the same size with the
  plain ``redis`` client, pipelines of ``--job-blocks`` commands, on 1 thread and on
  ``--io-workers`` threads (the better of the two is the baseline).

``store_ratio = store_gbps / raw_set_gbps`` and ``load_ratio = load_gbps / raw_get_gbps``.
Each figure is the best of ``--repeat`` runs, the phases interleaved. A ``redis-server`` is started on a free
loopback port unless ``--url`` is given. ``--json`` prints one JSON object as the last
line of stdout.

``--cluster``: the same against a Redis Cluster, ``RedisTier(url, cluster=True)`` against
redis-py's ``RedisCluster`` pipelines (which group the commands per node); without
``--url`` a local cluster of 3 primaries (and 3 replicas, ``--replicas``) is started and
removed afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import redis
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvactors.tiers.redis import RedisTier
from kvactors.types import JobResult, ReqContext, TransferJob
from tests.redis_cluster import LocalCluster
from tests.redis_server import RedisServer

GB = 1e9


def run_tier_jobs(tier: RedisTier, results: queue.Queue[JobResult], jobs: list[TransferJob],
                  inflight: int, promotion: bool) -> float:
    """Submit ``jobs`` keeping ``inflight`` outstanding (from this thread, as the tier
    actor would); returns seconds from the first submit to the last report."""
    submit = tier.submit_load if promotion else tier.submit_store
    pending = iter(jobs)
    outstanding = 0
    start = time.perf_counter()
    for job in pending:
        submit(job)
        outstanding += 1
        if outstanding >= inflight:
            break
    failed = 0
    first_error = None
    while outstanding:
        res = results.get(timeout=60)
        outstanding -= 1
        failed += not res.success
        first_error = first_error or res.error
        job = next(pending, None)
        if job is not None:
            submit(job)
            outstanding += 1
    elapsed = time.perf_counter() - start
    if failed:
        raise RuntimeError(f"{failed} jobs failed, the first: {first_error}")
    return elapsed


def raw_phase(client: redis.Redis | redis.RedisCluster, keys: list[bytes], values: list[bytes], batch: int,
              threads: int, op: str) -> float:
    batches = [list(range(i, min(i + batch, len(keys)))) for i in range(0, len(keys), batch)]

    def one(idx: list[int]) -> None:
        pipe = client.pipeline(transaction=False)
        for i in idx:
            if op == "set":
                pipe.set(keys[i], values[i])
            else:
                pipe.get(keys[i])
        replies = pipe.execute()
        if op == "get" and any(r is None for r in replies):
            raise RuntimeError("raw GET missed a key (maxmemory too small?)")

    start = time.perf_counter()
    if threads == 1:
        for b in batches:
            one(b)
    else:
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(one, batches))
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="use this server instead of starting one (its data under the "
                    "bench namespace is overwritten)")
    ap.add_argument("--block-bytes", type=int, default=256 * 1024)
    ap.add_argument("--blocks", type=int, default=512)
    ap.add_argument("--job-blocks", type=int, default=16)
    ap.add_argument("--inflight", type=int, default=8, help="tier jobs outstanding")
    ap.add_argument("--io-workers", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="fewer blocks and repeats (well under 30 s)")
    ap.add_argument("--json", action="store_true", help="last line of stdout: one JSON object")
    ap.add_argument("--cluster", action="store_true", help="a Redis Cluster: --url names any node, or "
                    "a local one is started")
    ap.add_argument("--replicas", type=int, default=1, help="replicas per primary of the local cluster")
    args = ap.parse_args(argv)
    if args.quick:
        args.blocks = min(args.blocks, 256)
        args.repeat = min(args.repeat, 3)

    server: RedisServer | LocalCluster | None = None
    url = args.url
    if url is None:
        need = str(max(2 * 2 * args.blocks * (args.block_bytes + 1024), 256 << 20))
        if args.cluster:
            server = LocalCluster(maxmemory=need, replicas=args.replicas).start()
        else:
            server = RedisServer(maxmemory=need).start()
        url = server.url
    try:
        return _bench(args, url, server is not None)
    finally:
        if server is not None:
            server.stop()


def _bench(args: argparse.Namespace, url: str, own_server: bool) -> int:
    n, bb, jb = args.blocks, args.block_bytes, args.job_blocks
    total = n * bb
    ctx = ReqContext("bench")
    pool = torch.randint(0, 256, (n, bb), dtype=torch.uint8)
    reference = pool.clone()
    results: queue.Queue[JobResult] = queue.Queue()
    tier = RedisTier(url, name="bench", namespace="kvactors-bench", io_workers=args.io_workers,
                     cluster=args.cluster)
    tier.attach(pool, results.put)
    keys = [f"blk-{i}".encode() for i in range(n)]
    job_ids = iter(range(1, 1 << 62))

    def jobs(kind: bool) -> list[TransferJob]:
        return [
            TransferJob(next(job_ids), tuple(keys[i : i + jb]), tuple(range(i, min(i + jb, n))), ctx, kind)
            for i in range(0, n, jb)
        ]

    client: redis.Redis | redis.RedisCluster = (
        redis.RedisCluster.from_url(url) if args.cluster else redis.Redis.from_url(url))
    raw_keys = [f"kvactors-bench-raw:{i}".encode() for i in range(n)]
    values = [bytes(reference[i].numpy()) for i in range(n)]
    thread_options = sorted({1, args.io_workers})
    store_s = load_s = float("inf")
    raw_set_s = dict.fromkeys(thread_options, float("inf"))
    raw_get_s = dict.fromkeys(thread_options, float("inf"))
    try:
        # warm-up: connections, server allocator
        run_tier_jobs(tier, results, jobs(False), args.inflight, False)
        raw_phase(client, raw_keys, values, jb, 1, "set")
        # Phases interleaved, best of --repeat each: background noise hits both sides alike.
        for _ in range(args.repeat):
            store_s = min(store_s, run_tier_jobs(tier, results, jobs(False), args.inflight, False))
            for t in thread_options:
                raw_set_s[t] = min(raw_set_s[t], raw_phase(client, raw_keys, values, jb, t, "set"))
            pool.zero_()
            load_s = min(load_s, run_tier_jobs(tier, results, jobs(True), args.inflight, True))
            if not torch.equal(pool, reference):
                raise RuntimeError("loaded blocks differ from the stored ones")
            for t in thread_options:
                raw_get_s[t] = min(raw_get_s[t], raw_phase(client, raw_keys, values, jb, t, "get"))
        tier.take_events()
    finally:
        tier.shutdown()
        if own_server and not args.cluster:  # a local cluster is removed with its data
            client.flushall()
        client.close()

    def gbps(seconds: float) -> float:
        return total / seconds / GB

    out = {
        "cluster": args.cluster,
        "block_bytes": bb,
        "blocks": n,
        "job_blocks": jb,
        "inflight": args.inflight,
        "io_workers": args.io_workers,
        "store_gbps": gbps(store_s),
        "load_gbps": gbps(load_s),
        "raw_set_gbps": max(gbps(s) for s in raw_set_s.values()),
        "raw_get_gbps": max(gbps(s) for s in raw_get_s.values()),
    }
    for t in thread_options:
        out[f"raw_set_gbps_t{t}"] = gbps(raw_set_s[t])
        out[f"raw_get_gbps_t{t}"] = gbps(raw_get_s[t])
    out["store_ratio"] = out["store_gbps"] / out["raw_set_gbps"]
    out["load_ratio"] = out["load_gbps"] / out["raw_get_gbps"]

    kind = " (cluster)" if args.cluster else ""
    print(f"RedisTier{kind} vs raw redis-py: {n} blocks x {bb // 1024} KiB = {total / 2**20:.0f} MiB, "
          f"jobs/pipelines of {jb}, best of {args.repeat}")
    print(f"{'path':<34}{'GB/s':>8}")
    print(f"{'RedisTier store':<34}{out['store_gbps']:>8.2f}")
    print(f"{'RedisTier load (verified)':<34}{out['load_gbps']:>8.2f}")
    for t in thread_options:
        print(f"{f'raw pipelined SET, {t} thread(s)':<34}{out[f'raw_set_gbps_t{t}']:>8.2f}")
        print(f"{f'raw pipelined GET, {t} thread(s)':<34}{out[f'raw_get_gbps_t{t}']:>8.2f}")
    print(f"store_ratio {out['store_ratio']:.2f}  load_ratio {out['load_ratio']:.2f}")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
