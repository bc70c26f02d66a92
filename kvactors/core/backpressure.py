"""Back-pressure: a bound on the bytes of cascades queued for each secondary tier.

A cascade is a block on its way from the pool to a tier, write-back included.
It is *queued* from the moment it is accepted until its tier reports it.
It also stops being queued when it fails, times out, or is dropped unsent.
Past a tier's bound, new cascades to it are dropped and counted.
The block stays in the pool.
An *episode* runs from the first drop to the first cascade accepted after it.
Each episode is reported once at its start and once at its end.
The caller logs ``cascades_dropped`` and ``cascades_resumed``.

Plain class, with no threads, as it lives in the primary's actor.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from kvactors.core.snapshot import CascadeFigures

MIN_DEFAULT_QUEUED_BYTES = 256 << 20


def default_max_queued_bytes(pool_bytes: int) -> int:
    """Half the pool's bytes, at least 256 MiB."""
    return max(pool_bytes // 2, MIN_DEFAULT_QUEUED_BYTES)


@dataclass(slots=True)
class _TierQueue:
    limit: int
    queued: int = 0
    dropped: int = 0  # cascades (jobs) dropped, all time
    dropped_blocks: int = 0
    dropping: bool = False  # in an episode


@dataclass(slots=True)
class Verdict:
    """:meth:`Backpressure.admit`'s answer.

    It says whether the cascade is accepted.
    It says whether an episode started (``started``) or ended (``resumed``, with the cascades it dropped).
    """

    accepted: bool
    started: bool = False
    resumed: bool = False
    episode_dropped: int = 0


@dataclass(slots=True)
class Backpressure:
    """Queued bytes per tier and their bounds. ``jobs`` maps each accepted cascade's job id to
    its tier and bytes until :meth:`ended`."""

    limits: Mapping[str, int]
    _tiers: dict[str, _TierQueue] = field(init=False)
    _jobs: dict[int, tuple[str, int]] = field(init=False, default_factory=dict)
    _episode: dict[str, int] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        for tier, limit in self.limits.items():
            if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
                raise ValueError(f"max_queued_bytes of tier {tier!r} must be an int >= 0, got {limit!r}")
        self._tiers = {tier: _TierQueue(limit) for tier, limit in self.limits.items()}

    def admit(self, tier: str, job_id: int, nbytes: int, blocks: int) -> Verdict:
        """Admit a cascade of ``nbytes`` (``blocks`` blocks) to ``tier``, job ``job_id``, or drop it.

        It is accepted, and counted as queued, if the tier's queued bytes stay within its bound.
        """
        queue = self._tiers[tier]
        if queue.queued + nbytes > queue.limit:
            queue.dropped += 1
            queue.dropped_blocks += blocks
            self._episode[tier] = self._episode.get(tier, 0) + 1
            started = not queue.dropping
            queue.dropping = True
            return Verdict(False, started=started)
        queue.queued += nbytes
        self._jobs[job_id] = (tier, nbytes)
        if queue.dropping:
            queue.dropping = False
            return Verdict(True, resumed=True, episode_dropped=self._episode.pop(tier, 0))
        return Verdict(True)

    def ended(self, job_id: int) -> bool:
        """Note that a job ended, so that its bytes are no longer queued.

        It ended when it was reported, failed, timed out or was dropped unsent.
        Returns ``False`` for a job that is not an accepted cascade, such as a promotion.
        """
        entry = self._jobs.pop(job_id, None)
        if entry is None:
            return False
        self._tiers[entry[0]].queued -= entry[1]
        return True

    def would_accept(self, tier: str, nbytes: int) -> bool:
        queue = self._tiers[tier]
        return queue.queued + nbytes <= queue.limit

    def queued(self, tier: str) -> int:
        return self._tiers[tier].queued

    def dropped(self, tier: str) -> int:
        return self._tiers[tier].dropped

    def dropping(self, tier: str) -> bool:
        return self._tiers[tier].dropping

    def jobs(self) -> int:
        return len(self._jobs)

    def figures(self, tiers: Iterable[str]) -> dict[str, CascadeFigures]:
        """Each tier's drops and queued bytes, by tier name.

        ``stats()`` writes them as ``cascades_dropped.<tier>`` and the like.
        See :class:`~kvactors.core.snapshot.ControlFigures`.
        """
        return {tier: CascadeFigures(queue.dropped, queue.dropped_blocks, queue.queued)
                for tier, queue in ((tier, self._tiers[tier]) for tier in tiers)}
