"""The supervisor's lookup book: one lookup's fan-out over the secondary tiers, and its answers.

A secondary lookup asks every tier that is not stuck about the keys the primary missed, each key once.
It is **open** while some tier it asked has not answered.
It **resolves** once every tier asked answered or was found stuck.
It also resolves when its deadline passed, or when a reset or a stop cut it short.
Each of these resolves it once, and it leaves the book then.
Resolving combines the answers (:func:`~kvactors.core.lookups.resolve_lookup`).
A tier's ``HIT`` for a key the promotion quarantine blocks is first taken as ``MISS``.
A lookup whose resolution starts promotions stays in the book as **allocating**
until the primary has allocated them.
A barrier waits behind such lookups.

No threads, no I/O, no logging.
The supervisor's actor owns one book and is its only caller.
Times are the owner's clock.
``R`` is the owner's reply type, carried along untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from kvactors.core.deadlines import DeadlineQueue
from kvactors.core.lookups import resolve_lookup
from kvactors.types import LookupResult, OffloadKey, ReqContext

R = TypeVar("R")

Answer = tuple[LookupResult, ...] | None
"""One tier's answer: a result per asked key, or ``None`` if the tier failed."""


@dataclass(slots=True)
class PendingLookup(Generic[R]):
    """One lookup from its fan-out until it resolves."""

    lookup_id: int
    ctx: ReqContext
    keys: tuple[OffloadKey, ...]
    missing: tuple[int, ...]
    results: list[LookupResult]
    reply: R
    asked: tuple[OffloadKey, ...]  # the missing keys, de-duplicated, as sent to the tiers
    waiting: set[str]
    answers: dict[str, Answer] = field(default_factory=dict)

    def answer(self, tier: str, results: Answer) -> bool:
        """Note that ``tier`` answered.

        Returns ``False``, and nothing changes, if the tier is not waited for.
        """
        if tier not in self.waiting:
            return False
        self.answers[tier] = results
        self.waiting.discard(tier)
        return True


@dataclass(frozen=True, slots=True)
class Resolution:
    """A lookup resolved.

    ``results`` is the answer: the primary's, with the tiers' verdicts at the missing positions.
    ``plan`` holds the promotions to allocate, tier -> keys, each key once, in key order.
    An empty plan means answer at once.
    ``hits_ignored`` counts the ``HIT`` s the quarantine ignored.
    """

    results: list[LookupResult]
    plan: dict[str, tuple[OffloadKey, ...]]
    hits_ignored: int = 0


class LookupBook(Generic[R]):
    """Open and allocating lookups, and their deadlines (see the module docstring)."""

    __slots__ = ("_allocating", "_deadlines", "_open", "tier_order", "timeout_s")

    def __init__(self, tier_order: Sequence[str], timeout_s: float) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.tier_order = tuple(tier_order)
        self.timeout_s = timeout_s
        self._open: dict[int, PendingLookup[R]] = {}
        self._deadlines: DeadlineQueue[int] = DeadlineQueue()
        self._allocating: dict[int, ReqContext] = {}

    def __len__(self) -> int:
        """Lookups in flight, open or allocating."""
        return len(self._open) + len(self._allocating)

    def __contains__(self, lookup_id: object) -> bool:
        return lookup_id in self._open or lookup_id in self._allocating

    def is_open(self, lookup_id: int) -> bool:
        return lookup_id in self._open

    def open_lookups(self) -> list[PendingLookup[R]]:
        return list(self._open.values())

    def allocating(self) -> tuple[int, ...]:
        """The ids of lookups resolved with promotions the primary has not allocated yet."""
        return tuple(self._allocating)

    def oldest(self) -> int | None:
        """The smallest id of a lookup in flight (what a barrier waits behind)."""
        return min((*self._open, *self._allocating), default=None)

    def next_deadline(self) -> float | None:
        return self._deadlines.next_deadline()

    # ------------------------------------------------------------ transitions

    def begin(self, lookup_id: int, ctx: ReqContext, keys: tuple[OffloadKey, ...], missing: tuple[int, ...],
              results: Sequence[LookupResult], reply: R, skip: Iterable[str] = ()) -> PendingLookup[R]:
        """A lookup's fan-out, which waits for every tier but those in ``skip``.

        The tiers in ``skip`` are stuck, and are not asked.
        The lookup is not in the book yet.
        The owner asks the tiers, recording inline answers with :meth:`PendingLookup.answer`.
        Then it calls :meth:`wait` or :meth:`resolve`.
        Raises ``ValueError`` if ``lookup_id`` is in the book, or ``missing`` does not index ``keys``.
        """
        if lookup_id in self:
            raise ValueError(f"lookup {lookup_id} is already in the book")
        if any(not 0 <= i < len(keys) for i in missing) or len(results) != len(keys):
            raise ValueError("missing must index keys, and results hold one per key")
        skipped = set(skip)
        asked = tuple(dict.fromkeys(keys[i] for i in missing))
        # A stuck tier counts as failed: its answer is a miss, not a wait for every request.
        return PendingLookup(lookup_id, ctx, keys, missing, list(results), reply, asked,
                             {tier for tier in self.tier_order if tier not in skipped},
                             {tier: None for tier in self.tier_order if tier in skipped})

    def wait(self, pending: PendingLookup[R], now: float) -> float:
        """Open ``pending``, which still waits for a tier's message, with its deadline.

        Returns the deadline.
        """
        if not pending.waiting:
            raise ValueError(f"lookup {pending.lookup_id} waits for no tier: resolve it")
        due = now + self.timeout_s
        self._open[pending.lookup_id] = pending
        self._deadlines.add(pending.lookup_id, due)
        return due

    def answered(self, lookup_id: int, tier: str, results: Answer) -> PendingLookup[R] | None:
        """Note that ``tier``'s message answered ``lookup_id``.

        Returns the lookup if that was the last answer it waited for, and the owner then resolves it.
        Returns ``None`` otherwise.
        It also returns ``None`` for an answer too late for its lookup, or from a tier found stuck meanwhile.
        Such an answer is ignored.
        """
        pending = self._open.get(lookup_id)
        if pending is None or not pending.answer(tier, results) or pending.waiting:
            return None
        return pending

    def tier_stuck(self, tier: str) -> list[PendingLookup[R]]:
        """Note that ``tier`` is stuck, so no open lookup waits for it any more.

        Returns the lookups it was the last wait of, and the owner resolves them.
        The tier counts as failed there.
        So its keys are a ``MISS`` unless another tier has them.
        """
        done = []
        for pending in self._open.values():
            if tier in pending.waiting:
                pending.waiting.discard(tier)
                pending.answers[tier] = None
                if not pending.waiting:
                    done.append(pending)
        return done

    def expire(self, now: float) -> list[PendingLookup[R]]:
        """The open lookups whose deadline is ``<= now`` (resolve them), earliest first."""
        return [self._open[i] for i in self._deadlines.pop_expired(now) if i in self._open]

    def resolve(self, pending: PendingLookup[R], *, promote: bool = True,
                blocked: Callable[[str, OffloadKey], bool] | None = None) -> Resolution:
        """Resolve ``pending``, which leaves the open lookups. Sets ``pending.results``.

        With promotions, it is allocating until :meth:`allocated`.
        ``blocked(tier, key)`` is the quarantine.
        A blocked ``HIT`` is taken as ``MISS``.
        """
        self._open.pop(pending.lookup_id, None)
        self._deadlines.discard(pending.lookup_id)
        ignored = _ignore_blocked(pending, blocked) if promote and blocked is not None else 0
        pending.results, plan = resolve_lookup(pending.keys, pending.missing, pending.results, pending.asked,
                                               self.tier_order, pending.answers, promote=promote)
        if plan:
            self._allocating[pending.lookup_id] = pending.ctx
        return Resolution(pending.results, {tier: tuple(dict.fromkeys(keys)) for tier, keys in plan.items()},
                          ignored)

    def allocated(self, lookup_id: int) -> ReqContext | None:
        """Note that the primary allocated ``lookup_id``'s promotions.

        The lookup leaves the book.
        """
        return self._allocating.pop(lookup_id, None)


def _ignore_blocked(pending: PendingLookup[R], blocked: Callable[[str, OffloadKey], bool]) -> int:
    """Take each ``HIT`` that ``blocked`` refuses as ``MISS``. Returns how many."""
    hit, miss = LookupResult.HIT, LookupResult.MISS
    ignored = 0
    for tier, answer in list(pending.answers.items()):
        if answer is None or hit not in answer:
            continue
        refused = [i for i, (key, result) in enumerate(zip(pending.asked, answer, strict=True))
                   if result is hit and blocked(tier, key)]
        if refused:
            ignored += len(refused)
            changed = list(answer)
            for i in refused:
                changed[i] = miss
            pending.answers[tier] = tuple(changed)
    return ignored
