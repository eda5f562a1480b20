"""store_key: every namespace field changes the key; None and "" differ."""

import dataclasses
import re

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.keys import (
    StoreNamespace,
    store_key,
)

NS = StoreNamespace(
    model="/models/SmolLM2-135M-Instruct",
    weights_version="epoch-0",
    kv_dtype="float32",
    kv_layout="L30xH3x64:kv",
    rope="neox:theta=100000",
    compute='{"backends": ["CPU_ATTN"], "device": "cpu"}',
    tp_rank=0,
    tp_size=2,
    pp_rank=0,
    pp_size=2,
    cache_salt=None,
    lora=None,
)
H = 0x0123456789ABCDEF0011223344556677

# One changed value per field (the test below checks every field is listed).
CHANGED = {
    "model": "/models/other",
    "weights_version": "epoch-1",
    "kv_dtype": "bfloat16",
    "kv_layout": "L30xH3x64:k",
    "rope": "neox:theta=10000",
    "compute": '{"backends": ["FLASH_ATTN"], "device": "cuda:NVIDIA H100"}',
    "tp_rank": 1,
    "tp_size": 4,
    "pp_rank": 1,
    "pp_size": 4,
    "cache_salt": "tenant-a",
    "lora": "adapter-1",
}


def test_key_shape():
    key = store_key(NS, H)
    assert re.fullmatch(
        r"chunkcache/v1/SmolLM2-135M-Instruct/[0-9a-f]{32}/"
        r"0123456789abcdef0011223344556677",
        key,
    ), key
    assert store_key(NS, H) == key  # deterministic
    assert store_key(NS, 1).endswith("/" + "0" * 31 + "1")


def test_every_field_is_covered():
    assert set(CHANGED) == {f.name for f in dataclasses.fields(StoreNamespace)}


@pytest.mark.parametrize("field", sorted(CHANGED))
def test_each_field_changes_the_key(field):
    other = dataclasses.replace(NS, **{field: CHANGED[field]})
    assert store_key(other, H) != store_key(NS, H)


@pytest.mark.parametrize("field", ["cache_salt", "lora"])
def test_none_and_empty_string_differ(field):
    assert store_key(dataclasses.replace(NS, **{field: ""}), H) != store_key(
        dataclasses.replace(NS, **{field: None}), H
    )


def test_the_content_hash_changes_the_key():
    assert store_key(NS, H) != store_key(NS, H ^ 1)
    assert store_key(NS, H) != store_key(NS, H ^ (1 << 127))


@pytest.mark.parametrize("bad", [-1, 1 << 128, "abc", 1.0])
def test_bad_hash_is_refused(bad):
    with pytest.raises(ValueError, match="128-bit"):
        store_key(NS, bad)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model": ""}, "model must be a non-empty string"),
        ({"tp_rank": 2}, "0 <= tp_rank < tp_size"),
        ({"pp_rank": -1}, "0 <= pp_rank < pp_size"),
    ],
)
def test_bad_namespace_is_refused(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(NS, **change)


def test_readable_part_cannot_forge_the_digest():
    # Two models whose readable part is the same still get different keys.
    a = dataclasses.replace(NS, model="/a/m o")
    b = dataclasses.replace(NS, model="/b/m_o")
    assert store_key(a, H).split("/")[2] == store_key(b, H).split("/")[2] == "m_o"
    assert store_key(a, H) != store_key(b, H)
