# SPDX-License-Identifier: Apache-2.0
"""The stored value of a chunk entry: header + payload (the KV bytes).

    offset 0   magic b"CCKV", format version (u16), reserved (u16)
           8   header size in bytes (u32), number of tokens (u32)
          16   virtual start (i64): the position the chunk's K were rotated to
          24   payload size in bytes (u64)
          32   checksum: xxh3-64 of the payload (u64)
          40   token ids (u32 each)
               zero padding to a multiple of 64 bytes, then the payload

Little-endian. NOTE: nothing read from the store is trusted: a get may return
another replica's bug, a torn write (Mooncake #1071: "done" before the data
was fully written) or a forged value, so decode_and_verify compares every
header field with what the reader expects and checksums the payload before
any byte reaches the pool.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

MAGIC = b"CCKV"
FORMAT_VERSION = 1
_FIXED = struct.Struct("<4sHHIIqQQ")
FIXED_NBYTES = _FIXED.size  # 40
_CHECKSUM_AT = 32
ALIGN = 64
_MAX_TOKEN_ID = (1 << 32) - 1

# VerifyResult.cause values (a fixed set: the connector counts them by cause).
OK = "ok"
BAD_MAGIC = "bad magic"
BAD_VERSION = "bad version"
HEADER_MISMATCH = "header mismatch"
TOKEN_MISMATCH = "token mismatch"
TRUNCATED = "truncated"
CHECKSUM = "checksum"
CAUSES = (
    OK,
    BAD_MAGIC,
    BAD_VERSION,
    HEADER_MISMATCH,
    TOKEN_MISMATCH,
    TRUNCATED,
    CHECKSUM,
)


@dataclass(frozen=True)
class EntryHeader:
    version: int
    virtual_start: int
    token_ids: tuple[int, ...]
    payload_nbytes: int
    checksum: int
    """xxh3-64 of the payload."""


@dataclass(frozen=True)
class VerifyResult:
    ok: bool
    cause: str
    """One of CAUSES ("ok" when ok)."""
    detail: str = ""
    """What differed, for the log."""


def header_nbytes(num_tokens: int) -> int:
    """Bytes of the header of an entry of `num_tokens` tokens (the payload starts here)."""
    raw = FIXED_NBYTES + 4 * num_tokens
    return -(-raw // ALIGN) * ALIGN


def entry_nbytes(num_tokens: int, payload_nbytes: int) -> int:
    return header_nbytes(num_tokens) + payload_nbytes


def payload_checksum(payload) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def make_header(virtual_start: int, token_ids: Sequence[int], payload) -> EntryHeader:
    """The header of `payload` (a buffer: bytes, memoryview, numpy array)."""
    view = memoryview(payload).cast("B")
    return EntryHeader(
        version=FORMAT_VERSION,
        virtual_start=int(virtual_start),
        token_ids=tuple(int(t) for t in token_ids),
        payload_nbytes=view.nbytes,
        checksum=payload_checksum(view),
    )


def encode_header(h: EntryHeader) -> bytes:
    """header_nbytes(len(h.token_ids)) bytes."""
    n = len(h.token_ids)
    size = header_nbytes(n)
    tokens = np.asarray(h.token_ids, dtype=np.int64)
    if n and (tokens.min() < 0 or tokens.max() > _MAX_TOKEN_ID):
        raise ValueError("token ids must fit in 32 bits unsigned")
    out = bytearray(size)
    _FIXED.pack_into(
        out,
        0,
        MAGIC,
        h.version,
        0,
        size,
        n,
        h.virtual_start,
        h.payload_nbytes,
        h.checksum,
    )
    out[FIXED_NBYTES : FIXED_NBYTES + 4 * n] = tokens.astype("<u4").tobytes()
    return bytes(out)


def header_for_mac(header) -> bytes:
    """The header as the entry's MAC covers it: every field but the checksum
    (zeroed), which is over the payload and so over the tag itself. The MAC
    covers the payload's rows directly (integrity.py)."""
    out = bytearray(memoryview(header).cast("B"))
    out[_CHECKSUM_AT : _CHECKSUM_AT + 8] = bytes(8)
    return bytes(out)


def decode_and_verify(
    view: memoryview,
    expected_tokens: Sequence[int],
    expected_virtual_start: int,
    expected_payload_nbytes: int,
) -> VerifyResult:
    """Check the value read from the store (exactly the bytes the get returned)
    against what the reader expects; ok only if every check passes."""
    view = memoryview(view).cast("B")
    result, size = _check_header(
        view,
        view.nbytes,
        expected_tokens,
        expected_virtual_start,
        expected_payload_nbytes,
    )
    if result is not None:
        return result
    return _check_payload(view, [view[size:]])


def verify_parts(
    header: memoryview,
    payload_parts: Sequence[memoryview],
    expected_tokens: Sequence[int],
    expected_virtual_start: int,
    expected_payload_nbytes: int,
) -> VerifyResult:
    """decode_and_verify for a value the get scattered: its header in `header`
    (header_nbytes(len(expected_tokens)) bytes), its payload over
    `payload_parts` in order (a read straight into pool rows, issue 39)."""
    header = memoryview(header).cast("B")
    parts = [memoryview(p).cast("B") for p in payload_parts]
    result, _ = _check_header(
        header,
        header.nbytes + sum(p.nbytes for p in parts),
        expected_tokens,
        expected_virtual_start,
        expected_payload_nbytes,
    )
    if result is not None:
        return result
    return _check_payload(header, parts)


def _check_header(
    view: memoryview,
    value_nbytes: int,
    expected_tokens: Sequence[int],
    expected_virtual_start: int,
    expected_payload_nbytes: int,
) -> tuple[VerifyResult | None, int]:
    """(a failed VerifyResult, or None when every header field and the value's
    length are what the reader expects; the header's size)."""
    if view.nbytes < FIXED_NBYTES:
        return VerifyResult(
            False, TRUNCATED, f"{view.nbytes} bytes, less than a header"
        ), 0
    magic, version, _, size, n, start, nbytes, _ = _FIXED.unpack_from(view, 0)
    if magic != MAGIC:
        return VerifyResult(False, BAD_MAGIC, f"magic {magic!r}"), size
    if version != FORMAT_VERSION:
        return VerifyResult(
            False,
            BAD_VERSION,
            f"format version {version}, this reader knows {FORMAT_VERSION}",
        ), size
    expected_n = len(expected_tokens)
    if n != expected_n or size != header_nbytes(expected_n):
        return VerifyResult(
            False,
            HEADER_MISMATCH,
            f"{n} tokens / header of {size} bytes, expected {expected_n} tokens",
        ), size
    if start != expected_virtual_start:
        return VerifyResult(
            False,
            HEADER_MISMATCH,
            f"virtual start {start}, expected {expected_virtual_start}",
        ), size
    if nbytes != expected_payload_nbytes:
        return VerifyResult(
            False,
            HEADER_MISMATCH,
            f"payload of {nbytes} bytes, expected {expected_payload_nbytes}",
        ), size
    total = size + nbytes
    if value_nbytes < total or view.nbytes < size:
        return VerifyResult(False, TRUNCATED, f"{value_nbytes} of {total} bytes"), size
    if value_nbytes > total:
        return VerifyResult(
            False, HEADER_MISMATCH, f"{value_nbytes} bytes, the header says {total}"
        ), size
    stored = np.frombuffer(view, dtype="<u4", count=n, offset=FIXED_NBYTES)
    if not np.array_equal(stored, np.asarray(expected_tokens, dtype=np.int64)):
        first = int(np.argmax(stored != np.asarray(expected_tokens, dtype=np.int64)))
        return VerifyResult(
            False, TOKEN_MISMATCH, f"first differing token at {first}"
        ), size
    return None, size


def _check_payload(header: memoryview, parts: Sequence[memoryview]) -> VerifyResult:
    """The header's checksum against the payload's bytes (over its parts)."""
    checksum = _FIXED.unpack_from(header, 0)[-1]
    digest = xxhash.xxh3_64()
    for part in parts:
        digest.update(part)
    if digest.intdigest() != checksum:
        return VerifyResult(False, CHECKSUM, "payload checksum differs")
    return VerifyResult(True, OK)


def decode_header(view: memoryview) -> EntryHeader | None:
    """The header as stored (None if it is not one): for tools and logs, never
    for trusting an entry (decode_and_verify does that)."""
    view = memoryview(view).cast("B")
    if view.nbytes < FIXED_NBYTES:
        return None
    magic, version, _, size, n, start, nbytes, checksum = _FIXED.unpack_from(view, 0)
    if magic != MAGIC or view.nbytes < FIXED_NBYTES + 4 * n:
        return None
    tokens = np.frombuffer(view, dtype="<u4", count=n, offset=FIXED_NBYTES)
    return EntryHeader(version, start, tuple(int(t) for t in tokens), nbytes, checksum)
