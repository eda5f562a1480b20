"""Entry format: a round trip verifies; every corruption is caught with its cause."""

import numpy as np
import pytest
import xxhash
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store import (
    entry_format as ef,
)

TOKENS = [1, 17, 4095, 2**31 + 5, 0, 42, 7]
START = 1234


def _entry(tokens=TOKENS, start=START, payload_nbytes=4096):
    payload = np.random.default_rng(0).integers(0, 256, payload_nbytes, dtype=np.uint8)
    header = ef.make_header(start, tokens, payload)
    return bytearray(ef.encode_header(header) + payload.tobytes()), header


def _verify(buf, tokens=TOKENS, start=START, payload_nbytes=4096):
    return ef.decode_and_verify(memoryview(buf), tokens, start, payload_nbytes)


def test_round_trip():
    buf, header = _entry()
    assert header.checksum == xxhash.xxh3_64_intdigest(
        bytes(buf[ef.header_nbytes(7) :])
    )
    assert _verify(buf) == ef.VerifyResult(True, "ok")
    assert len(buf) == ef.header_nbytes(len(TOKENS)) + 4096


def test_header_size_is_aligned_and_fits_the_tokens():
    for n in (0, 1, 6, 7, 100, 4096):
        size = ef.header_nbytes(n)
        assert size % ef.ALIGN == 0 and size >= ef.FIXED_NBYTES + 4 * n
    assert ef.FIXED_NBYTES == 40


def test_empty_payload_and_no_tokens():
    buf, _ = _entry(tokens=[], payload_nbytes=0)
    assert _verify(buf, tokens=[], payload_nbytes=0).ok


@pytest.mark.parametrize("where", [0, 1000, 4095])
def test_a_flipped_payload_byte_is_caught(where):
    buf, _ = _entry()
    buf[ef.header_nbytes(7) + where] ^= 0x01
    r = _verify(buf)
    assert (r.ok, r.cause) == (False, ef.CHECKSUM)


def test_a_changed_stored_token_is_caught():
    buf, _ = _entry()
    buf[ef.FIXED_NBYTES + 4 * 3] ^= 0x10
    r = _verify(buf)
    assert (r.ok, r.cause) == (False, ef.TOKEN_MISMATCH)
    assert "at 3" in r.detail


def test_other_expected_tokens_are_caught():
    buf, _ = _entry()
    assert _verify(buf, tokens=TOKENS[:-1] + [8]).cause == ef.TOKEN_MISMATCH
    assert _verify(buf, tokens=TOKENS[:-1]).cause == ef.HEADER_MISMATCH  # count differs


def test_another_virtual_start_is_caught():
    buf, _ = _entry()
    assert _verify(buf, start=START + 1).cause == ef.HEADER_MISMATCH
    buf[16] ^= 0x01  # the stored start
    assert _verify(buf).cause == ef.HEADER_MISMATCH


def test_another_payload_size_is_caught():
    buf, _ = _entry()
    assert _verify(buf, payload_nbytes=4095).cause == ef.HEADER_MISMATCH


@pytest.mark.parametrize("keep", [0, 10, ef.FIXED_NBYTES, 300, -1])
def test_truncation_is_caught(keep):
    buf, _ = _entry()
    r = _verify(buf[:keep])
    assert (r.ok, r.cause) == (False, ef.TRUNCATED)


def test_trailing_bytes_are_caught():
    buf, _ = _entry()
    assert _verify(buf + b"\0").cause == ef.HEADER_MISMATCH


def test_bad_magic_and_version():
    buf, _ = _entry()
    bad = bytearray(buf)
    bad[0:4] = b"XXXX"
    assert _verify(bad).cause == ef.BAD_MAGIC
    bad = bytearray(buf)
    bad[4] = 2
    assert _verify(bad).cause == ef.BAD_VERSION


def test_token_ids_beyond_32_bits_are_refused():
    with pytest.raises(ValueError, match="32 bits"):
        ef.encode_header(ef.EntryHeader(1, 0, (1 << 32,), 0, 0))


# -- a value scattered over buffers (a read straight into pool rows, issue 39) ----


def _scattered(buf, cuts):
    head = ef.header_nbytes(len(TOKENS))
    edges = [head, *(head + c for c in cuts), len(buf)]
    return memoryview(buf)[:head], [
        memoryview(buf)[a:b] for a, b in zip(edges, edges[1:])
    ]


@pytest.mark.parametrize("cuts", [[], [1], [1000, 1001, 3000], [4095]])
def test_a_scattered_value_verifies_as_the_whole_one(cuts):
    buf, _ = _entry()
    header, parts = _scattered(buf, cuts)
    assert ef.verify_parts(header, parts, TOKENS, START, 4096) == ef.VerifyResult(
        True, "ok"
    )


@pytest.mark.parametrize("where", [0, 1000, 1001, 4095])
def test_a_flipped_byte_in_any_part_is_caught(where):
    buf, _ = _entry()
    buf[ef.header_nbytes(7) + where] ^= 0x01
    header, parts = _scattered(buf, [1000, 1001, 3000])
    r = ef.verify_parts(header, parts, TOKENS, START, 4096)
    assert (r.ok, r.cause) == (False, ef.CHECKSUM)
    assert (r.ok, r.cause) == (lambda w: (w.ok, w.cause))(_verify(buf))


def test_scattered_parts_of_another_length_are_caught():
    buf, _ = _entry()
    header, parts = _scattered(buf, [1000])
    assert ef.verify_parts(header, parts[:1], TOKENS, START, 4096).cause == ef.TRUNCATED
    longer = [*parts, memoryview(b"\0")]
    assert (
        ef.verify_parts(header, longer, TOKENS, START, 4096).cause == ef.HEADER_MISMATCH
    )
    buf[ef.FIXED_NBYTES + 4] ^= 0x10  # a stored token
    assert (
        ef.verify_parts(header, parts, TOKENS, START, 4096).cause == ef.TOKEN_MISMATCH
    )
