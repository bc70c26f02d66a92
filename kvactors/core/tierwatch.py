"""Which secondary tiers owe the supervisor an answer, and which of them are stuck.

A tier's actor runs its plugin's calls one at a time.
A plugin stuck inside one answers nothing after it.
A ``submit_store`` blocked on a dead NFS mount is such a case.
The supervisor sends a tier *probes*, messages its actor answers when it gets to them.
A probe is a gather (events, barrier, shutdown) or a lookup.
The supervisor tells this watch about each probe sent and each answer received.

A tier is **stuck** when it owes at least one answer and has given none for ``stuck_after_s``.
Any answer, to any probe, is progress and restarts its clock.
So a tier that is busy but moving is never stuck.
A stuck tier **recovers** with its next answer.
The watch only keeps the books.
What a stuck tier means (calls answered without it) is the supervisor's to decide.

Not thread-safe: it has one owner, the supervisor's actor.
Times are the owner's clock, virtual in a simulation.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field


@dataclass(slots=True)
class _Tier:
    owed: set[Hashable] = field(default_factory=set)
    silent_since: float = 0.0  # the last answer, or the first probe owed since then
    stuck: bool = False


class TierWatch:
    """Probes owed per tier, and the stuck verdict (see the module docstring)."""

    __slots__ = ("_tiers", "found_stuck", "recovered", "stuck_after_s")

    def __init__(self, tiers: Iterable[str], stuck_after_s: float) -> None:
        if not stuck_after_s > 0:
            raise ValueError(f"stuck_after_s must be > 0, got {stuck_after_s!r}")
        self.stuck_after_s = stuck_after_s
        self._tiers = {name: _Tier() for name in tiers}
        self.found_stuck = 0  # times a tier was found stuck
        self.recovered = 0  # times a stuck tier answered again

    def asked(self, tier: str, probe: Hashable, now: float) -> None:
        """Note that ``probe`` was sent to ``tier``.

        The tier owes an answer from now on.
        """
        state = self._tiers[tier]
        if not state.owed and not state.stuck:
            state.silent_since = now  # the clock runs only while something is owed
        state.owed.add(probe)

    def answered(self, tier: str, probe: Hashable, now: float) -> float | None:
        """Note that ``tier`` answered ``probe``.

        The probe may be one it owes or not, as any answer is progress.
        Returns how long the tier had been silent if this answer ends a stuck spell (the tier recovered).
        Returns ``None`` otherwise.
        """
        state = self._tiers[tier]
        state.owed.discard(probe)
        silent = now - state.silent_since
        state.silent_since = now
        if state.stuck:
            state.stuck = False
            self.recovered += 1
            return silent
        return None

    def due(self, now: float) -> list[str]:
        """The tiers found stuck at ``now`` (each once per stuck spell), in order."""
        found = []
        for name, state in self._tiers.items():
            # The same sum as next_deadline(): a tick at that deadline must find the tier due.
            if state.owed and not state.stuck and now >= state.silent_since + self.stuck_after_s:
                state.stuck = True
                self.found_stuck += 1
                found.append(name)
        return found

    def next_deadline(self) -> float | None:
        """When :meth:`due` may next find a tier stuck.

        ``None`` means nothing is owed.
        """
        deadlines = [state.silent_since + self.stuck_after_s for state in self._tiers.values()
                     if state.owed and not state.stuck]
        return min(deadlines) if deadlines else None

    def is_stuck(self, tier: str) -> bool:
        return self._tiers[tier].stuck

    def stuck(self) -> list[str]:
        """The tiers stuck now, in order."""
        return [name for name, state in self._tiers.items() if state.stuck]

    def owed(self, tier: str) -> int:
        """How many probes ``tier`` has not answered."""
        return len(self._tiers[tier].owed)

    def silent_for(self, tier: str, now: float) -> float:
        """Seconds since ``tier`` last answered, while it owes something (else 0)."""
        state = self._tiers[tier]
        return now - state.silent_since if state.owed or state.stuck else 0.0
