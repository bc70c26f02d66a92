"""Custom tiers for tests/vllm/test_controls_033.py, named in ``tiers`` entries as ``control_tiers:Class``."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence

from kvactors import JobResult, LookupResult, MemoryTier, OffloadKey, ReqContext, TransferJob
from kvactors.tiers.base import SecondaryTier


class RemoteMemoryTier(MemoryTier):
    """A memory tier that says it is remote storage (as Redis or Mooncake would)."""

    medium = "STORAGE"
    locality = "REMOTE"

    def __init__(self, *, name: str = "remote", capacity_blocks: int = 256) -> None:
        super().__init__(name=name, capacity_blocks=capacity_blocks)


class SlowTier(SecondaryTier):
    """Stores that take ``delay_s`` each, one at a time, on one worker thread: far slower than the
    traffic. Loads never hit (it is a sink). ``max_queue_seen``: the most jobs it ever held at once."""

    max_inflight_jobs = 64

    def __init__(self, *, name: str = "slow", delay_s: float = 0.5) -> None:
        super().__init__(name=name)
        self.delay_s = delay_s
        self.jobs: queue.SimpleQueue[TransferJob | None] = queue.SimpleQueue()
        self.held = 0
        self.max_held = 0
        self.stored = 0
        self.lock = threading.Lock()
        self.worker = threading.Thread(target=self._run, name="slow-tier", daemon=True)
        self.worker.start()

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            time.sleep(self.delay_s)  # the slow medium
            with self.lock:
                self.held -= 1
                self.stored += len(job.keys)
            self.report(JobResult(job.job_id, True))

    def lookup(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[LookupResult]:
        return [LookupResult.MISS] * len(keys)

    def submit_store(self, job: TransferJob) -> None:
        with self.lock:
            self.held += 1
            self.max_held = max(self.max_held, self.held)
        self.jobs.put(job)

    def submit_load(self, job: TransferJob) -> None:
        self.report(JobResult(job.job_id, False, "a sink"))

    def drain(self, timeout: float) -> None:
        pass  # the queued jobs are reported (or timed out by the runtime)

    def shutdown(self) -> None:
        self.jobs.put(None)


SLOW: list[SlowTier] = []


class TrackedSlowTier(SlowTier):
    """A :class:`SlowTier` the test can find (the engine builds it from the config)."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        SLOW.append(self)
