"""Deterministic simulation: the actors on a seeded single-threaded scheduler."""

from kvactors.sim.runtime import SimActorRef, SimRuntime, SimulationStuck

__all__ = ["SimActorRef", "SimRuntime", "SimulationStuck"]
