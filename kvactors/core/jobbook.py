"""The supervisor's job book: every cascade and promotion from its creation to its end.

A job is in exactly one of these places at a time.

* **queued**: it waits for a slot at its tier.
  Each tier has at most ``max_inflight`` jobs in flight.
  The queue is FIFO and nothing overtakes it.
* **in flight**: it was sent to its tier, and waits for the tier's report until its deadline.
* **held**: its deadline passed before its report, so it failed.
  Its rows stay held until its late report comes, as the tier may still be touching them.
* **done**: it was reported, dropped before it was sent, or its late report came.

A promotion's deadline runs from its booking, queued or not.
Its keys are ``HIT_PENDING`` from then on.
So a queued promotion can expire before it is sent.
A cascade's deadline runs from its submit.
A freed slot goes to the queue's head at once (:meth:`JobBook._pump`).
So a tier with a queue always has every slot busy.

No threads, no I/O, no logging.
Each operation returns the :class:`Step` s it took, in order.
The owner (the supervisor's actor, its only caller) does what each means
(send the job, tell the primary, log, count).
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvactors.core.deadlines import DeadlineQueue
from kvactors.core.jobkinds import JobKind
from kvactors.core.lifecycle import Pending
from kvactors.core.outcomes import KeyOutcomes, key_outcomes
from kvactors.types import JobResult, ReqContext, TransferJob


class Step(enum.Enum):
    """What the book did with one job."""

    STARTED = "started"  # it went in flight: send it to its tier now
    QUEUED = "queued"  # it waits for a slot (its request's unsent counter holds the request open)
    REFUSED = "refused"  # its request is not live: it never goes out (a guard; unreachable while counts are right)
    EXPIRED = "expired"  # queued past its deadline: it fails, never sent
    TIMED_OUT = "timed_out"  # in flight past its deadline: it fails, and is held until its late report


class Route(enum.Enum):
    """Where a tier's report goes."""

    ENDED = "ended"  # the report of a job in flight: the job is done
    LATE = "late"  # the late report of a held job: release its rows
    UNEXPECTED = "unexpected"  # no such job in flight or held at that tier (unknown, duplicate, queued, foreign)


@dataclass(slots=True)
class BookedJob:
    """A job from its booking until it is done."""

    tier: str
    job: TransferJob
    origin: int  # the work id wait_idle waits on: the job's own, or its lookup's
    epoch: int
    deadline: float | None = None
    submitted: bool = False
    waited: bool = False  # it was queued: its request counted it as unsent until it left the queue
    submitted_at: float = 0.0

    @property
    def job_id(self) -> int:
        return self.job.job_id

    @property
    def counter(self) -> Pending:
        """The request count that holds the request open while this job is queued."""
        return Pending.UNSENT_PROMOTIONS if self.job.is_promotion else Pending.PARKED_CASCADES

    @property
    def kind(self) -> JobKind:
        return JobKind.PROMOTION if self.job.is_promotion else JobKind.CASCADE


@dataclass(frozen=True, slots=True)
class Report:
    """A report routed: where it went, its job (``None`` if unexpected), the per-key
    outcome (for ``ENDED``), and the steps the freed slot took."""

    route: Route
    job: BookedJob | None = None
    outcomes: KeyOutcomes | None = None
    steps: tuple[tuple[Step, BookedJob], ...] = ()


class JobBook:
    """Queues, slots, deadlines and held jobs of every secondary tier (see the module docstring).

    ``live(ctx)`` says whether ``ctx``'s request may still get a submit (the owner's lifecycle table).
    A job whose request is not live is refused, never sent.
    Not thread-safe: one owner.
    Times are the owner's clock.
    """

    __slots__ = (
        "_deadlines",
        "_held",
        "_inflight",
        "_jobs",
        "_live",
        "_queues",
        "max_inflight",
        "tier_order",
        "timeout_s",
    )

    def __init__(self, tier_limits: Sequence[tuple[str, int]], timeout_s: float,
                 live: Callable[[ReqContext], bool] = lambda ctx: True) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        for name, limit in tier_limits:
            if type(limit) is not int or limit < 1:
                raise ValueError(f"max_inflight of tier {name!r} must be an int >= 1, got {limit!r}")
        self.tier_order = tuple(name for name, _ in tier_limits)
        self.max_inflight = dict(tier_limits)
        self.timeout_s = timeout_s
        self._live = live
        self._jobs: dict[int, BookedJob] = {}  # queued and in flight
        self._queues: dict[str, deque[int]] = {name: deque() for name in self.tier_order}
        self._inflight: dict[str, int] = dict.fromkeys(self.tier_order, 0)
        self._deadlines: DeadlineQueue[int] = DeadlineQueue()
        self._held: dict[int, BookedJob] = {}

    # ------------------------------------------------------------ what is where

    def get(self, job_id: int) -> BookedJob | None:
        """A queued or in-flight job."""
        return self._jobs.get(job_id)

    def jobs(self) -> list[BookedJob]:
        """Queued and in-flight jobs."""
        return list(self._jobs.values())

    def held(self) -> list[BookedJob]:
        return list(self._held.values())

    def is_held(self, job_id: int) -> bool:
        return job_id in self._held

    def in_flight(self, tier: str | None = None) -> int:
        return sum(self._inflight.values()) if tier is None else self._inflight[tier]

    def in_flight_by_tier(self) -> dict[str, int]:
        return dict(self._inflight)

    def in_flight_ids(self) -> set[int]:
        return {job_id for job_id, job in self._jobs.items() if job.submitted}

    def queued(self, tier: str | None = None) -> int:
        if tier is None:
            return sum(len(queue) for queue in self._queues.values())
        return len(self._queues[tier])

    def queued_by_tier(self) -> dict[str, int]:
        return {tier: len(queue) for tier, queue in self._queues.items()}

    def queue(self, tier: str) -> tuple[int, ...]:
        """The job ids waiting at ``tier``, head first."""
        return tuple(self._queues[tier])

    def oldest_origin(self) -> int | None:
        """The smallest origin of a queued or in-flight job (what a barrier waits behind)."""
        return min((job.origin for job in self._jobs.values()), default=None)

    def next_deadline(self) -> float | None:
        return self._deadlines.next_deadline()

    # ------------------------------------------------------------ transitions

    def add(self, tier: str, job: TransferJob, origin: int, epoch: int, now: float) -> tuple[Step, BookedJob]:
        """Book a new job: ``STARTED`` if a slot is free and nobody waits, else ``QUEUED``
        (``REFUSED`` if its request is not live). ``ValueError`` for an unknown tier or a
        job id already booked, and nothing changes."""
        if tier not in self._queues:
            raise ValueError(f"unknown tier {tier!r}")
        if job.job_id in self._jobs or job.job_id in self._held:
            raise ValueError(f"job {job.job_id} is already booked")
        entry = BookedJob(tier, job, origin, epoch)
        if job.is_promotion:
            entry.deadline = now + self.timeout_s
        if self._inflight[tier] < self.max_inflight[tier] and not self._queues[tier]:
            return self._start(entry, now), entry
        self._jobs[job.job_id] = entry
        self._queues[tier].append(job.job_id)
        entry.waited = True
        if entry.deadline is not None:
            # A promotion waiting for a slot times out too: no key is HIT_PENDING past the deadline.
            self._deadlines.add(job.job_id, entry.deadline)
        return Step.QUEUED, entry

    def _start(self, entry: BookedJob, now: float) -> Step:
        if not self._live(entry.job.req_context):
            self._jobs.pop(entry.job_id, None)
            self._deadlines.discard(entry.job_id)
            return Step.REFUSED
        self._jobs[entry.job_id] = entry
        entry.submitted = True
        entry.submitted_at = now
        self._inflight[entry.tier] += 1
        self._deadlines.add(entry.job_id, entry.deadline if entry.deadline is not None else now + self.timeout_s)
        return Step.STARTED

    def _pump(self, tier: str, now: float) -> list[tuple[Step, BookedJob]]:
        """Give ``tier``'s free slots to its queue's head.

        Each job there is ``STARTED``, or ``EXPIRED`` for a promotion whose tick is late.
        Such a promotion is past its deadline, and it fails unsent.
        """
        steps: list[tuple[Step, BookedJob]] = []
        queue = self._queues[tier]
        while queue and self._inflight[tier] < self.max_inflight[tier]:
            entry = self._jobs[queue.popleft()]
            if entry.deadline is not None and entry.deadline <= now:
                del self._jobs[entry.job_id]
                self._deadlines.discard(entry.job_id)
                steps.append((Step.EXPIRED, entry))
            else:
                steps.append((self._start(entry, now), entry))
        return steps

    def report(self, tier: str, result: JobResult, now: float) -> Report:
        """Route ``tier``'s report.

        ``ENDED`` means the job is done, and its slot goes to the queue.
        Its per-key outcome is read with :func:`~kvactors.core.outcomes.key_outcomes`.
        ``LATE`` means a held job's report came, and that job is done.
        ``UNEXPECTED`` means nothing changes.
        """
        job_id = result.job_id
        if type(job_id) is not int:  # a plugin's garbage: unhashable, or True standing for job 1
            return Report(Route.UNEXPECTED)
        entry = self._jobs.get(job_id)
        if entry is None or not entry.submitted or entry.tier != tier:
            late = self._held.get(job_id)
            if late is not None and late.tier == tier:
                del self._held[job_id]
                return Report(Route.LATE, late)
            return Report(Route.UNEXPECTED)
        del self._jobs[job_id]
        self._deadlines.discard(job_id)
        self._inflight[tier] -= 1
        return Report(Route.ENDED, entry, key_outcomes(entry.job.keys, result), tuple(self._pump(tier, now)))

    def expire(self, now: float) -> list[tuple[Step, BookedJob]]:
        """Every deadline ``<= now``: queued jobs ``EXPIRED`` first (a slot that a timed-out
        job frees must not go to a job already past its deadline), then in-flight ones
        ``TIMED_OUT`` (now held), each followed by the steps its freed slot took."""
        expired = [self._jobs.pop(job_id) for job_id in self._deadlines.pop_expired(now)]
        steps: list[tuple[Step, BookedJob]] = []
        for entry in expired:
            if not entry.submitted:
                self._queues[entry.tier].remove(entry.job_id)
                steps.append((Step.EXPIRED, entry))
        for entry in expired:
            if entry.submitted:
                steps.extend(self._time_out(entry, now))
        return steps

    def time_out_all(self, now: float) -> list[tuple[Step, BookedJob]]:
        """Every job in flight times out now (a stop's budget is spent)."""
        steps: list[tuple[Step, BookedJob]] = []
        for job_id in [job_id for job_id, entry in self._jobs.items() if entry.submitted]:
            entry = self._jobs.pop(job_id)
            self._deadlines.discard(job_id)
            steps.extend(self._time_out(entry, now))
        return steps

    def _time_out(self, entry: BookedJob, now: float) -> list[tuple[Step, BookedJob]]:
        self._held[entry.job_id] = entry
        self._inflight[entry.tier] -= 1
        return [(Step.TIMED_OUT, entry), *self._pump(entry.tier, now)]

    def drop_queued(self, tiers: Iterable[str] | None = None) -> list[BookedJob]:
        """Remove every job waiting for a slot at ``tiers`` (default: all), in queue order."""
        dropped = []
        for tier in self.tier_order if tiers is None else tiers:
            queue = self._queues[tier]
            while queue:
                entry = self._jobs.pop(queue.popleft())
                self._deadlines.discard(entry.job_id)
                dropped.append(entry)
        return dropped
