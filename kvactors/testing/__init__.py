"""The testing toolkit: the runtime explored on a seeded scheduler, and tiers that check the contract.

* :class:`SimRuntime` (``scheduler``) runs the same actors on one thread, with a seed picking every step.
* ``explore`` draws a random workload per seed and checks the contract after it.
* ``recorder`` and ``faults`` wrap any tier, transparently.
  ``recorder`` checks what reached a tier, and ``faults`` injects faults.
* ``tiers`` holds the in-memory test tier and their stacks.
* ``workload`` holds the frontend clients that drive a :class:`~kvactors.TieringManager`.
"""

from kvactors.testing.scheduler import SimActorRef, SimRuntime, SimulationStuck

__all__ = ["SimActorRef", "SimRuntime", "SimulationStuck"]
