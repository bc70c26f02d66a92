"""Self-describing block records for tiers that persist bytes (disk, Redis).

A record is a fixed header followed by the key and the payload::

    magic "KVA2" | key length u16 | payload length u32 | XXH3-64 of key+payload u64

The checksum covers the key too, so a record stored under the wrong name (or a
payload swapped between blocks) is rejected like a corrupt one. XXH3 (the
``xxhash`` package) is fast enough that verifying a block costs a small
fraction of reading it, which zlib's crc32 was not (see
``docs/performance.md``). It detects corruption, not tampering.
"""

from __future__ import annotations

import struct

import xxhash

from kvactors.types import OffloadKey

MAGIC = b"KVA2"
_HEADER = struct.Struct("<4sHIQ")
HEADER_SIZE = _HEADER.size


class CorruptRecordError(ValueError):
    """A record failed verification: bad header, wrong key, wrong length or checksum."""


def checksum(key: OffloadKey, payload: bytes | memoryview) -> int:
    """XXH3-64 of ``key`` then ``payload``."""
    digest = xxhash.xxh3_64(key)
    digest.update(payload)
    return digest.intdigest()


def encode_header(key: OffloadKey, payload: bytes | memoryview) -> bytes:
    """The header and key that precede ``payload`` in a record."""
    return _HEADER.pack(MAGIC, len(key), len(payload), checksum(key, payload)) + key


def encode(key: OffloadKey, payload: bytes | memoryview) -> bytes:
    """A whole record as one bytes object."""
    return encode_header(key, payload) + bytes(payload)


def decode_header(header: bytes | memoryview) -> tuple[int, int]:
    """``(key length, payload length)`` from the first ``HEADER_SIZE`` bytes of a record.

    It checks the magic only.
    That lets a reader size its buffer (or find a record's key) before :func:`decode` verifies the whole record.
    Raises ``CorruptRecordError`` when the header is short or the magic is wrong.
    """
    if len(header) < HEADER_SIZE:
        raise CorruptRecordError(f"header truncated: {len(header)} bytes")
    magic, key_len, payload_len, _ = _HEADER.unpack_from(header)
    if magic != MAGIC:
        raise CorruptRecordError("bad magic")
    return key_len, payload_len


def verify_split(
    head: bytes | memoryview, payload: bytes | memoryview, key: OffloadKey, payload_size: int
) -> None:
    """Verify a record read in two parts, ``head`` (header and key) and ``payload``.

    It makes the same checks as :func:`decode`, for readers that put the payload
    straight into its destination buffer.
    Raises ``CorruptRecordError``, and the caller must then treat ``payload`` as garbage.
    """
    # One header unpack, a key comparison without copying, one streaming hash:
    # this runs once per block loaded, on the bytes in place.
    if len(head) < HEADER_SIZE:
        raise CorruptRecordError(f"header truncated: {len(head)} bytes")
    magic, key_len, payload_len, digest = _HEADER.unpack_from(head)
    if magic != MAGIC:
        raise CorruptRecordError("bad magic")
    if payload_len != payload_size:
        raise CorruptRecordError(f"payload is {payload_len} bytes, expected {payload_size}")
    if len(head) != HEADER_SIZE + key_len or memoryview(payload).nbytes != payload_len:
        raise CorruptRecordError(
            f"record is {len(head) + memoryview(payload).nbytes} bytes, header says "
            f"{HEADER_SIZE + key_len + payload_len}"
        )
    if memoryview(head)[HEADER_SIZE:] != key:
        raise CorruptRecordError("record holds another key")
    if checksum(key, payload) != digest:
        raise CorruptRecordError("checksum mismatch")


def decode(record: bytes | memoryview, key: OffloadKey, payload_size: int) -> memoryview:
    """Verify ``record`` against ``key`` and the expected size, and return the payload.

    Raises ``CorruptRecordError`` on any mismatch.
    The caller must then treat the block as missing, and never serve its bytes.
    """
    view = memoryview(record)
    key_len, _ = decode_header(view)
    head_size = HEADER_SIZE + key_len
    payload = view[head_size:]
    verify_split(view[:head_size], payload, key, payload_size)
    return payload
