"""The simulated workload: multi-turn conversations as prefix-hash chains of blocks.

Keys are chained like vLLM's prefix hashes.
The key of block ``i`` is a hash of the key of block ``i - 1`` and the block's token content.
So two sequences share a key exactly when they share the whole prefix up to that block.
The chain's root mixes in the seed and the block size.
So runs with other parameters never confuse each other's blocks.
A reused ``--disk-dir`` may give hits from an earlier run with the same parameters, and those are valid.

Every conversation starts with one of a few long system prompts, chosen with a skewed popularity.
It then has 1..``max_turns`` turns.
Turn ``t``'s prompt is the whole conversation so far plus the new user message.
Its response blocks are appended to the conversation for the next turn.

The bytes of a block are derived from its key (:class:`BlockBytes`).
So any thread can write them (the "compute") or check them (after an onboard),
without a shared table of expected contents.
"""

from __future__ import annotations

import hashlib
import random
import threading
from dataclasses import dataclass, field

import torch

from kvactors.types import OffloadKey

DIGEST_BYTES = 32
"""Bytes at the start of each block that hold a digest of its key."""
MIN_BLOCK_BYTES = 64


def chain_key(parent: OffloadKey, content: bytes) -> OffloadKey:
    """The prefix-hash key of a block.

    It is a hash of its parent's key and its own content.
    """
    return hashlib.blake2b(parent + content, digest_size=16).digest()


class BlockBytes:
    """The deterministic content of each block, cheap to write and to check.

    A block's bytes are a window of a random buffer (seeded), starting at an
    offset derived from the key, with the first 32 bytes replaced by the key's
    blake2b digest. A block swapped for another, shifted, truncated or partly
    stale fails :meth:`matches`. Writing and checking are slice copies and
    comparisons, no per-block hashing of the payload.
    """

    def __init__(self, block_bytes: int, seed: int, device: torch.device | str = "cpu") -> None:
        if block_bytes < MIN_BLOCK_BYTES:
            raise ValueError(f"block_bytes must be >= {MIN_BLOCK_BYTES}, got {block_bytes}")
        self.block_bytes = block_bytes
        gen = torch.Generator().manual_seed(seed)
        self._base = torch.randint(0, 256, (2 * block_bytes,), dtype=torch.uint8, generator=gen).to(device)

    def _parts(self, key: OffloadKey) -> tuple[torch.Tensor, int]:
        digest = hashlib.blake2b(key, digest_size=DIGEST_BYTES).digest()
        offset = int.from_bytes(digest[:4], "little") % self.block_bytes
        head = torch.frombuffer(bytearray(digest), dtype=torch.uint8).to(self._base.device)
        return head, offset

    def write(self, row: torch.Tensor, key: OffloadKey) -> None:
        """Fill one device row with the bytes ``key`` stands for."""
        head, offset = self._parts(key)
        row.copy_(self._base[offset:offset + self.block_bytes])
        row[:DIGEST_BYTES].copy_(head)

    def expected(self, key: OffloadKey) -> torch.Tensor:
        """The bytes of ``key`` as a new tensor (for tests and reports)."""
        row = torch.empty(self.block_bytes, dtype=torch.uint8, device=self._base.device)
        self.write(row, key)
        return row

    def matches(self, row: torch.Tensor, key: OffloadKey) -> bool:
        """Whether ``row`` holds exactly the bytes of ``key``."""
        head, offset = self._parts(key)
        return bool(torch.equal(row[:DIGEST_BYTES], head)) and bool(
            torch.equal(row[DIGEST_BYTES:], self._base[offset + DIGEST_BYTES:offset + self.block_bytes])
        )


@dataclass
class Turn:
    """One request.

    It holds the prompt's keys, which are looked up, and the response's keys, which are computed and stored.
    """

    conversation: int
    index: int
    prompt_keys: list[OffloadKey]
    response_keys: list[OffloadKey]

    @property
    def req_id(self) -> str:
        return f"conv{self.conversation}-turn{self.index}"

    @property
    def keys(self) -> list[OffloadKey]:
        return self.prompt_keys + self.response_keys


@dataclass
class Conversation:
    conv_id: int
    turns_left: int
    keys: list[OffloadKey] = field(default_factory=list)  # the whole conversation so far
    turns_done: int = 0
    busy: bool = False


@dataclass(frozen=True)
class WorkloadShape:
    """The shape of the conversations (in blocks)."""

    system_prompts: int = 8
    system_blocks: tuple[int, int] = (8, 20)
    max_turns: int = 6
    user_blocks: tuple[int, int] = (1, 4)
    response_blocks: tuple[int, int] = (1, 3)
    open_conversations: int = 48
    max_request_blocks: int = 64

    def __post_init__(self) -> None:
        longest = (self.system_blocks[1]
                   + self.max_turns * (self.user_blocks[1] + self.response_blocks[1]))
        if longest > self.max_request_blocks:
            raise ValueError(f"a request may have {longest} blocks, more than {self.max_request_blocks}")


class Workload:
    """Hands out turns to frontend threads. Thread-safe.

    A fixed number of conversations are open at once.
    :meth:`next_turn` picks a random open conversation that no thread is serving,
    as turns of one conversation are sequential.
    A finished or abandoned conversation is replaced by a new one.
    Interleaving many open conversations makes the set of live blocks larger than the CPU pool.
    So later turns find their prefix in the pool, or only on disk.
    """

    def __init__(self, *, seed: int, block_bytes: int, shape: WorkloadShape | None = None) -> None:
        self.shape = shape or WorkloadShape()
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        root = hashlib.blake2b(f"kvactors-simulate:{seed}:{block_bytes}".encode(), digest_size=16).digest()
        self._system: list[list[OffloadKey]] = []
        for s in range(self.shape.system_prompts):
            keys: list[OffloadKey] = []
            parent = root
            for j in range(self._rng.randint(*self.shape.system_blocks)):
                parent = chain_key(parent, f"system{s}:{j}".encode())
                keys.append(parent)
            self._system.append(keys)
        # Zipf-like popularity: prompt s is chosen with weight 1 / (s + 1).
        self._weights = [1.0 / (s + 1) for s in range(self.shape.system_prompts)]
        self._next_conv = 0
        self._open: list[Conversation] = [self._new_conversation() for _ in range(self.shape.open_conversations)]
        self.conversations_started = len(self._open)

    def _new_conversation(self) -> Conversation:
        conv = Conversation(self._next_conv, self._rng.randint(1, self.shape.max_turns))
        self._next_conv += 1
        system = self._rng.choices(self._system, weights=self._weights)[0]
        conv.keys = list(system)
        return conv

    def _extend(self, parent: OffloadKey, label: str, n: int) -> list[OffloadKey]:
        keys = []
        for j in range(n):
            parent = chain_key(parent, f"{label}:{j}".encode())
            keys.append(parent)
        return keys

    def next_turn(self) -> tuple[Conversation, Turn] | None:
        """A turn of a random idle conversation, or ``None`` if all are busy."""
        with self._lock:
            idle = [c for c in self._open if not c.busy]
            if not idle:
                return None
            conv = self._rng.choice(idle)
            conv.busy = True
            t = conv.turns_done
            user = self._extend(conv.keys[-1], f"c{conv.conv_id}:t{t}:user",
                                self._rng.randint(*self.shape.user_blocks))
            prompt = conv.keys + user
            response = self._extend(prompt[-1], f"c{conv.conv_id}:t{t}:response",
                                    self._rng.randint(*self.shape.response_blocks))
            return conv, Turn(conv.conv_id, t, prompt, response)

    def random(self) -> float:
        with self._lock:
            return self._rng.random()

    def turn_done(self, conv: Conversation, turn: Turn, *, completed: bool) -> None:
        """Append the turn to its conversation, if it completed.

        Retire the conversation when it is done.
        """
        with self._lock:
            conv.busy = False
            if completed:
                conv.keys = turn.keys
                conv.turns_done += 1
            if not completed or conv.turns_done >= conv.turns_left:
                self._open[self._open.index(conv)] = self._new_conversation()
                self.conversations_started += 1
