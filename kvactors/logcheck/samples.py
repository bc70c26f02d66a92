"""Event logs to test and measure the checker on: real runs, and big logs made from them.

* :func:`sim_log` gives the seed explorer's runs (:func:`kvactors.testing.explore.explore_one`).
* :func:`thread_log` runs a :class:`~kvactors.TieringManager` on real threads with a ``MemoryTier``.
  Its workload leaves some requests unfinished and some stores never completed at the stop.
  So the stop's roll call is exercised.
* :func:`big_log` makes a log of any length from a real one's event patterns.
  It repeats the real log's managers, each copy with fresh ``manager`` numbers, ``req_id`` and ``job_id`` values.
  Several copies are interleaved line by line, as managers sharing one file are.
  Lines are yielded, never held.

Threading: :func:`thread_log` starts and stops its own threads. The rest is plain.
"""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Iterator
from pathlib import Path

from kvactors.logcheck.model import Event


def sim_log(path: str | Path, seeds: range = range(40)) -> Path:
    """Append the explorer's runs of ``seeds`` to ``path`` (each run is checked by the explorer too)."""
    from kvactors.testing.explore import explore_one

    for seed in seeds:
        result = explore_one(seed, event_log=str(path))
        if not result.ok:
            raise AssertionError(result.describe())
    return Path(path)


def thread_log(path: str | Path, *, threads: int = 4, requests: int = 30, seed: int = 0) -> Path:
    """Run a real-thread workload with ``event_log=path``.

    Some requests, at least each client's last, are left live at the stop.
    """
    from kvactors import LifecycleError, LookupResult, MemoryTier, ReqContext, TieringManager

    manager = TieringManager.start(num_blocks=48, block_bytes=64, secondary_tiers=[MemoryTier(capacity_blocks=96)],
                                   transfer_timeout_s=30.0, event_log=str(path))
    errors: list[BaseException] = []

    def client(number: int) -> None:
        rng = random.Random(seed * 1000 + number)
        try:
            for r in range(requests):
                ctx = ReqContext(f"t{number}r{r}", rng.choice((0, 0, 1)))
                manager.on_new_request(ctx)
                keys = [bytes([rng.randrange(40)]) for _ in range(rng.randint(1, 4))]
                try:
                    results = manager.lookup(keys, ctx)
                    ready = [k for k, res in zip(keys, results, strict=True) if res is LookupResult.HIT]
                    if ready:
                        manager.prepare_load(ready, ctx)
                        manager.complete_load(ready, ctx)
                    out = manager.prepare_store(keys, ctx)
                    if out is not None and out.keys_to_store:
                        fate = rng.random()
                        if fate < 0.1:
                            pass  # never completed: pending at the stop
                        else:
                            manager.complete_store(out.keys_to_store, ctx, success=fate > 0.2)
                except LifecycleError:
                    pass  # a key evicted between lookup and load
                # The others are never finished by their caller; each client's last one always so, as the
                # roll call must have someone to name whatever the interleaving did to the random draws.
                if r != requests - 1 and rng.random() < 0.9:
                    manager.on_request_finished(ctx)
                if number == 0 and r == requests // 2:
                    manager.reset_cache()
        except BaseException as exc:  # reported to the caller below
            errors.append(exc)

    workers = [threading.Thread(target=client, args=(n,), name=f"sample-client-{n}") for n in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=60)
    manager.wait_idle(timeout=30)
    manager.stop(timeout=30)
    if errors:
        raise errors[0]
    return Path(path)


def read_log(path: str | Path) -> list[Event]:
    """Every event of a (small) log, in file order."""
    with open(path, encoding="utf-8") as stream:
        return [json.loads(line) for line in stream if line.strip()]


def by_manager(events: list[Event]) -> list[list[Event]]:
    """The events of each manager, in ``seq`` order."""
    groups: dict[tuple[object, object], list[Event]] = {}
    for event in events:
        groups.setdefault((event.get("pid"), event.get("manager")), []).append(event)
    return [sorted(group, key=lambda e: e["seq"]) for _, group in sorted(groups.items(), key=lambda kv: str(kv[0]))]


def _renamed(event: Event, copy: int, manager: int) -> Event:
    out = dict(event)
    out["manager"] = manager
    if "req_id" in out:
        out["req_id"] = f"{out['req_id']}~{copy}"
    if "job_id" in out:
        out["job_id"] = out["job_id"] * 1_000_003 + copy  # fresh ids, unique per copy
    return out


def big_log(template: list[Event], events: int, *, interleave: int = 4, seed: int = 0) -> Iterator[str]:
    """JSON lines of about ``events`` events, made of ``template``'s managers copied with fresh identities.

    Up to ``interleave`` copies at a time share the file.
    Their lines are interleaved, each manager's in ``seq`` order.
    """
    managers = [group for group in by_manager(template) if group and group[0]["event"] == "manager_started"]
    if not managers:
        raise ValueError("the template has no complete manager")
    rng = random.Random(seed)
    dumps = json.JSONEncoder(separators=(",", ":")).encode
    written = copy = 0
    live: list[Iterator[Event]] = []
    while written < events or live:
        while written < events and len(live) < interleave:
            group = managers[copy % len(managers)]
            live.append(iter([_renamed(e, copy, copy) for e in group]))
            written += len(group)
            copy += 1
        stream = rng.randrange(len(live))
        event = next(live[stream], None)
        if event is None:
            live.pop(stream)
            continue
        yield dumps(event) + "\n"
