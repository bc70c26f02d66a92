"""The jobs of :class:`~kvactors.tiers.redis.RedisTier`.

They hold a store's and a load's pipelines and what their replies mean, key by key.

``RedisJobs`` is a mixin of ``RedisTier``.
Its methods run on the tier's I/O workers (the :class:`~kvactors.tiers.runner.JobRunner`'s), one job each.
They run concurrently with each other and with the tier's methods.
They touch the tier's state only through thread-safe calls (the connection pools, ``_failed``/``_mark_up``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import redis

from kvactors.tiers import codec
from kvactors.tiers import redis_cluster as rc
from kvactors.tiers.runner import Outcome, RunningJob
from kvactors.tiers.runner import describe as _describe
from kvactors.types import LookupResult, OffloadingEvent, OffloadKey

if TYPE_CHECKING:
    import torch
    from redis.commands.core import Script

    from kvactors.logs import EventLogger

# Evicts the ``ARGV[1]`` least recently used members of an LRU sorted set
# (``KEYS[1]``) and unlinks their blocks (``ARGV[2]`` is the key prefix).
# Atomic, so concurrent writers never evict one member twice. The block keys
# are built inside the script: on a cluster, prefix and set share a hash tag,
# so they are in the set's slot.
EVICT_LUA = """
local popped = redis.call('ZPOPMIN', KEYS[1], ARGV[1])
local out = {}
for i = 1, #popped, 2 do
  redis.call('UNLINK', ARGV[2] .. popped[i])
  out[#out + 1] = popped[i]
end
return out
"""

# A key's value cannot be reached now, because its shard is down or its slot moves.
# That is a failed key, not an unreadable value, and deleting it would be wrong.
_SHARD_FAILURES = (redis.ConnectionError, redis.TimeoutError, *rc.TRANSIENT)

class RedisJobs:
    """The store and load jobs of a Redis tier (see the module's docstring)."""

    if TYPE_CHECKING:
        name: str
        pool: torch.Tensor | None
        capacity_bytes: int | None
        _lru_sets: int
        _cluster: rc.ClusterClient | None
        _evict_script: Script
        _log: EventLogger

        def redis_key(self, key: OffloadKey) -> bytes: ...
        def _lru_groups(self, keys: Sequence[OffloadKey]) -> dict[bytes, tuple[bytes, list[OffloadKey]]]: ...
        def _pipeline(self) -> redis.client.Pipeline | rc.ShardPipeline: ...
        def _failed(self, exc: BaseException) -> LookupResult: ...
        def _mark_up(self) -> None: ...

    def _do_store(self, state: RunningJob) -> Outcome:
        job = state.job
        pool = self.pool
        assert pool is not None
        # Copy the rows out (one memcpy per block, into the record) while holding the
        # job lock: once the job is reported, its rows may be reused.
        with state.lock:
            if state.reported:
                return Outcome()
            records = []
            for key, row in zip(job.keys, job.block_ids, strict=True):
                payload = pool[row].numpy().data  # zero-copy memoryview of the row
                records.append(b"".join((codec.encode_header(key, payload), payload)))
        pipe = self._pipeline()
        for key, record in zip(job.keys, records, strict=True):
            pipe.set(self.redis_key(key), record)
        # Replies are per command. One SET refused (OOM, a read-only replica) fails that key only.
        # On a cluster, so does a shard that cannot be reached.
        replies = pipe.execute(raise_on_error=False)
        self._mark_up()
        failed: dict[OffloadKey, str] = {}
        for key, reply in zip(job.keys, replies, strict=False):
            if isinstance(reply, Exception):
                failed.setdefault(key, _describe(reply))
        stored = [key for key in dict.fromkeys(job.keys) if key not in failed]
        removed: list[OffloadKey] = []
        capacity = self.capacity_bytes
        if capacity is not None and stored:
            # Each LRU set bounds its share of the capacity (the whole of it on one server).
            limit = max(1, capacity // len(records[0]) // self._lru_sets)
            removed = self._track(stored, failed, limit, job.job_id)
            # A job larger than the room evicts some of its own keys: those are not stored.
            for key in set(stored).intersection(removed):
                failed.setdefault(key, "evicted by its own store (the job is larger than the room)")
            stored = [key for key in stored if key not in failed]
        events = [OffloadingEvent(keys=tuple(stored), tier=self.name, removed=False)] if stored else []
        if removed:
            events.append(OffloadingEvent(keys=tuple(removed), tier=self.name, removed=True))
        if not failed:
            return Outcome(events=events)
        error = f"{len(failed)} of {len(set(job.keys))} blocks not stored ({next(iter(failed.values()))})"
        return Outcome(_positions(job.keys, failed), error, events)

    def _track(self, stored: list[OffloadKey], failed: dict[OffloadKey, str], limit: int,
               job_id: int) -> list[OffloadKey]:
        """Add the keys just stored to their LRU sets, and evict past ``limit`` blocks per set.

        Returns the keys removed.
        Only keys whose ``SET`` succeeded are added, in a second round trip.
        So no set counts a block that is not there.
        A key its set refused (OOM with ``noeviction``) would never be evicted.
        Neither would a key that could not be added because the server went away meanwhile.
        Such a key fails (it is added to ``failed``), and its delete is tried.
        A delete that fails too is logged (``forget_failed``).
        The block then stays, valid, for the server's own policy to evict.
        """
        groups = self._lru_groups(stored)
        now = time.time()
        pipe = self._pipeline()
        for lru_key, (_, members) in groups.items():
            pipe.zadd(lru_key, {key.hex(): now for key in members})
            pipe.zcard(lru_key)
        try:
            replies = pipe.execute(raise_on_error=False)
        except Exception as exc:  # the server went away between the two round trips
            self._failed(exc)
            replies = [exc, exc] * len(groups)
        over: list[tuple[bytes, bytes, int]] = []
        untracked: list[OffloadKey] = []
        for (lru_key, (prefix, members)), added, count in zip(groups.items(), replies[::2], replies[1::2],
                                                               strict=True):
            if isinstance(added, Exception):
                untracked += members
                failed.update(dict.fromkeys(members, f"not tracked for eviction: {_describe(added)}"))
            elif isinstance(count, Exception):
                self._log.warning("evict_failed", job_id=job_id, error=_describe(count))
            elif int(count) > limit:
                over.append((lru_key, prefix, int(count) - limit))
        # A re-stored key may have been announced before: its removal is.
        removed = self._forget([], untracked, job_id) if untracked else []
        return removed + (self._evict(over, job_id) if over else [])

    def _evict(self, over: list[tuple[bytes, bytes, int]], job_id: int) -> list[OffloadKey]:
        """Remove the ``count`` least recently used blocks of each ``(LRU set, key prefix, count)``.

        The set is the namespace's, or on a cluster a bucket's.
        All of them go in one round trip per shard.
        A failure here does not fail the store that triggered it.
        """
        try:
            if self._cluster is None:
                ((lru_key, prefix, count),) = over
                replies = [self._evict_script(keys=[lru_key], args=[count, prefix])]
            else:
                pipe = self._cluster.pipeline()
                for lru_key, prefix, count in over:
                    pipe.eval(EVICT_LUA, lru_key, count, prefix)
                replies = pipe.execute()
        except Exception as exc:
            self._failed(exc)
            self._log.warning("evict_failed", job_id=job_id, error=_describe(exc))
            return []
        evicted: list[OffloadKey] = []
        for members in replies:
            if isinstance(members, Exception):  # that shard's failure: not the tier's
                self._log.warning("evict_failed", job_id=job_id, error=_describe(members))
                continue
            for member in members:
                try:
                    evicted.append(bytes.fromhex(member.decode()))
                except ValueError:  # not one of ours: ignore
                    continue
        return evicted

    def _do_load(self, state: RunningJob) -> Outcome:
        job = state.job
        pool = self.pool
        assert pool is not None
        pipe = self._pipeline()
        for key in job.keys:
            pipe.get(self.redis_key(key))
        if self.capacity_bytes is not None:
            now = time.time()
            for lru_key, (_, members) in self._lru_groups(job.keys).items():
                pipe.zadd(lru_key, {key.hex(): now for key in members}, xx=True)
        # Replies are per command. A key holding another Redis type (WRONGTYPE) fails that key only.
        # On a cluster, so does a shard that cannot be reached or a slot that is moving.
        replies = pipe.execute(raise_on_error=False)
        self._mark_up()
        block_bytes = int(pool.shape[1])
        good: list[tuple[int, memoryview]] = []
        missing: list[OffloadKey] = []
        bad: dict[OffloadKey, str] = {}  # cannot be read: deleted, so that a later lookup misses
        unavailable: dict[OffloadKey, str] = {}  # its shard failed or its slot moved: kept
        for key, row, record in zip(job.keys, job.block_ids, replies, strict=False):
            if record is None:
                missing.append(key)
            elif isinstance(record, _SHARD_FAILURES):
                unavailable.setdefault(key, _describe(record))
            elif isinstance(record, Exception):
                bad.setdefault(key, f"unreadable: {_describe(record)}")
            elif not isinstance(record, bytes):
                bad.setdefault(key, f"unreadable: a {type(record).__name__}")
            else:
                try:
                    good.append((row, codec.decode(record, key, block_bytes)))
                except codec.CorruptRecordError as exc:
                    bad.setdefault(key, f"corrupt: {exc}")
        if not missing and not bad and not unavailable:
            return Outcome(commit=self._copier(good))
        removed = self._forget(missing, list(bad), job.job_id) if missing or bad else []
        failed = dict.fromkeys(missing, "missing") | bad | unavailable
        parts = []
        if missing:
            parts.append(f"missing: {len(set(missing))} of {len(set(job.keys))} blocks")
        if bad:
            parts.append(f"unreadable or corrupt: {len(bad)} blocks ({next(iter(bad.values()))})")
        if unavailable:
            parts.append(f"unavailable: {len(unavailable)} blocks ({next(iter(unavailable.values()))})")
        events = [OffloadingEvent(keys=tuple(removed), tier=self.name, removed=True)] if removed else []
        return Outcome(_positions(job.keys, failed), "; ".join(parts), events, self._copier(good))

    def _copier(self, rows: list[tuple[int, memoryview]]) -> Callable[[], None]:
        pool = self.pool
        assert pool is not None

        def copy_rows() -> None:
            for row, payload in rows:
                pool[row].numpy()[:] = np.frombuffer(payload, dtype=np.uint8)

        return copy_rows

    def _forget(self, missing: list[OffloadKey], corrupt: list[OffloadKey], job_id: int) -> list[OffloadKey]:
        """Delete the values that cannot be read (corrupt records, other Redis types) and drop
        missing/corrupt keys from the LRU set (best effort). Returns the keys this tier deleted."""
        if not corrupt and (not missing or self.capacity_bytes is None):
            return []
        try:
            pipe = self._pipeline()
            for key in corrupt:
                pipe.unlink(self.redis_key(key))
            if self.capacity_bytes is not None:
                for lru_key, (_, members) in self._lru_groups([*missing, *corrupt]).items():
                    pipe.zrem(lru_key, *[k.hex() for k in members])
            # Per command (not a transaction: an UNLINK that ran counts, whatever failed after it).
            replies = pipe.execute(raise_on_error=False)
        except Exception as exc:
            self._failed(exc)
            self._log.warning("forget_failed", job_id=job_id, error=_describe(exc))
            return []
        deleted = [key for key, reply in zip(corrupt, replies, strict=False) if not isinstance(reply, Exception)]
        errors = [reply for reply in replies if isinstance(reply, Exception)]
        if errors:
            self._log.warning("forget_failed", job_id=job_id, error=_describe(errors[0]), failed=len(errors))
        return deleted


def _positions(keys: Sequence[OffloadKey], failed: Mapping[OffloadKey, str]) -> dict[int, str]:
    """``{position in keys: why}`` for the keys that failed (every place of a repeated key)."""
    return {i: failed[key] for i, key in enumerate(keys) if key in failed}
