# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The stored value of a chunk entry: header + payload (the KV bytes).

    offset 0   magic b"CCKV", format version (u16), reserved (u16)
           8   header size in bytes (u32), number of tokens (u32)
          16   virtual start (i64): the position the chunk's K were rotated to
          24   payload size in bytes (u64)
          32   checksum: xxh3-64 of the payload (u64)
          40   token ids (u32 each)
               zero padding to a multiple of 64 bytes, then the payload

Little-endian. Nothing read from the store is trusted (another replica's bug,
a torn write, a forged value): every header field is compared with what the
reader expects and the payload checksummed before any byte reaches the pool.
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

# VerifyResult.cause values.
OK = "ok"
BAD_MAGIC = "bad magic"
BAD_VERSION = "bad version"
HEADER_MISMATCH = "header mismatch"
TOKEN_MISMATCH = "token mismatch"
TRUNCATED = "truncated"
CHECKSUM = "checksum"


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
    """One of the causes above ("ok" when ok)."""
    detail: str = ""
    """What differed, for the log."""


def header_nbytes(num_tokens: int) -> int:
    """Bytes of the header of an entry of `num_tokens` tokens."""
    raw = FIXED_NBYTES + 4 * num_tokens
    return -(-raw // ALIGN) * ALIGN


def make_header(virtual_start: int, token_ids: Sequence[int], payload) -> EntryHeader:
    """The header of `payload` (a buffer: bytes, memoryview, numpy array)."""
    view = memoryview(payload).cast("B")
    return EntryHeader(
        version=FORMAT_VERSION,
        virtual_start=int(virtual_start),
        token_ids=tuple(int(t) for t in token_ids),
        payload_nbytes=view.nbytes,
        checksum=xxhash.xxh3_64_intdigest(view),
    )


def encode_header(h: EntryHeader) -> bytes:
    """header_nbytes(len(h.token_ids)) bytes."""
    n = len(h.token_ids)
    size = header_nbytes(n)
    tokens = np.asarray(h.token_ids, dtype=np.int64)
    if n and (tokens.min() < 0 or tokens.max() > _MAX_TOKEN_ID):
        raise ValueError("token ids must fit in 32 bits unsigned")
    out = bytearray(size)
    fields = (h.version, 0, size, n, h.virtual_start, h.payload_nbytes, h.checksum)
    _FIXED.pack_into(out, 0, MAGIC, *fields)
    out[FIXED_NBYTES : FIXED_NBYTES + 4 * n] = tokens.astype("<u4").tobytes()
    return bytes(out)


def header_for_mac(header) -> bytes:
    """The header as the entry's MAC covers it: its checksum zeroed (that is
    over the payload, the tag included)."""
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
    size = header_nbytes(len(expected_tokens))
    expected = (expected_tokens, expected_virtual_start, expected_payload_nbytes)
    return verify_parts(view[:size], [view[size:]], *expected)


def verify_parts(
    header: memoryview,
    payload_parts: Sequence[memoryview],
    expected_tokens: Sequence[int],
    expected_virtual_start: int,
    expected_payload_nbytes: int,
) -> VerifyResult:
    """decode_and_verify for a value the get scattered: its header in `header`
    (header_nbytes(len(expected_tokens)) bytes), its payload over
    `payload_parts` in order."""
    header = memoryview(header).cast("B")
    parts = [memoryview(p).cast("B") for p in payload_parts]
    value_nbytes = header.nbytes + sum(p.nbytes for p in parts)
    if header.nbytes < FIXED_NBYTES:
        return VerifyResult(False, TRUNCATED, f"{header.nbytes} bytes, no header")
    magic, version, _, size, n, start, nbytes, checksum = _FIXED.unpack_from(header)
    if magic != MAGIC:
        return VerifyResult(False, BAD_MAGIC, f"magic {magic!r}")
    if version != FORMAT_VERSION:
        why = f"format version {version}, this reader knows {FORMAT_VERSION}"
        return VerifyResult(False, BAD_VERSION, why)
    expected_n = len(expected_tokens)
    if n != expected_n or size != header_nbytes(expected_n):
        why = f"{n} tokens / header of {size} bytes, expected {expected_n} tokens"
        return VerifyResult(False, HEADER_MISMATCH, why)
    if start != expected_virtual_start:
        why = f"virtual start {start}, expected {expected_virtual_start}"
        return VerifyResult(False, HEADER_MISMATCH, why)
    if nbytes != expected_payload_nbytes:
        why = f"payload of {nbytes} bytes, expected {expected_payload_nbytes}"
        return VerifyResult(False, HEADER_MISMATCH, why)
    total = size + nbytes
    if value_nbytes < total or header.nbytes < size:
        return VerifyResult(False, TRUNCATED, f"{value_nbytes} of {total} bytes")
    if value_nbytes > total:
        why = f"{value_nbytes} bytes, the header says {total}"
        return VerifyResult(False, HEADER_MISMATCH, why)
    tokens = np.asarray(expected_tokens, dtype=np.int64)
    stored = np.frombuffer(header, dtype="<u4", count=n, offset=FIXED_NBYTES)
    if not np.array_equal(stored, tokens):
        first = int(np.argmax(stored != tokens))
        return VerifyResult(False, TOKEN_MISMATCH, f"first differing token at {first}")
    digest = xxhash.xxh3_64()
    for part in parts:
        digest.update(part)
    if digest.intdigest() != checksum:
        return VerifyResult(False, CHECKSUM, "payload checksum differs")
    return VerifyResult(True, OK)
