"""The testing toolkit: the runtime explored on a seeded scheduler, and tiers that check the contract.

:class:`SimRuntime` (``scheduler``) runs the same actors on one thread, a seed
picking every step; ``explore`` draws a random workload per seed and checks the
contract after it; ``recorder`` (what reached a tier, checked) and ``faults``
(faults injected) wrap any tier, transparently; ``tiers`` holds the in-memory test tier and their stacks;
``workload`` the frontend clients that drive a :class:`~kvactors.TieringManager`.
"""

from kvactors.testing.scheduler import SimActorRef, SimRuntime, SimulationStuck

__all__ = ["SimActorRef", "SimRuntime", "SimulationStuck"]
