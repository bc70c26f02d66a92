"""Reading a tier's :class:`~kvactors.types.JobResult` key by key.

A plain function, no threads: the supervisor calls it for every report of a
job it knows. A report is a tier's word, and a tier may be wrong: whatever
does not fit the job fails every key of it, so a confused tier can make the
runtime lose blocks, never serve bytes it did not vouch for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvactors.types import JobResult, OffloadKey


@dataclass(frozen=True, slots=True)
class KeyOutcomes:
    """What one report says about each key of its job.

    ``ok`` is the keys that succeeded, in the job's order, each once.
    ``failed`` is the others, likewise.
    ``problem`` says why the report was not taken at its word (every key then failed), or is ``None``.
    """

    ok: tuple[OffloadKey, ...]
    failed: tuple[OffloadKey, ...]
    problem: str | None = None

    @property
    def all_ok(self) -> bool:
        return not self.failed

    @property
    def partial(self) -> bool:
        return bool(self.ok) and bool(self.failed)


def key_outcomes(job_keys: Sequence[OffloadKey], result: JobResult) -> KeyOutcomes:
    """The per-key outcome of ``result`` for a job of ``job_keys``.

    * With ``successful_keys is None``, every key follows ``success``, which must be a ``bool``.
    * With a tuple of keys of the job, those keys succeeded and the job's others failed,
      whatever ``success`` says (the public API's rule).
      That holds for ``success=False`` with every key named too.
      A key named twice counts once.
    * Anything else fails every key, with a ``problem``.
      That is a ``success`` that is not a bool, or a ``successful_keys`` that is not a tuple,
      holds a non-``bytes`` item, or holds a key the job does not have.
    """
    unique = tuple(dict.fromkeys(job_keys))
    success, named = result.success, result.successful_keys
    if type(success) is not bool:
        return KeyOutcomes((), unique, f"success is {success!r}, not a bool")
    if named is None:
        return KeyOutcomes(unique, ()) if success else KeyOutcomes((), unique)
    if type(named) is not tuple:
        return KeyOutcomes((), unique, f"successful_keys is a {type(named).__name__}, not a tuple")
    members = set(unique)
    for key in named:
        if type(key) is not bytes:
            return KeyOutcomes((), unique, f"successful_keys holds {key!r}, not bytes")
        if key not in members:
            return KeyOutcomes((), unique, f"successful_keys names {key.hex()[:32]}, not a key of the job")
    said = set(named)
    ok = tuple(key for key in unique if key in said)
    failed = tuple(key for key in unique if key not in said)
    return KeyOutcomes(ok, failed)
