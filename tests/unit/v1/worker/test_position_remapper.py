# SPDX-License-Identifier: Apache-2.0
"""Re-positioning keys: K at p rotated by d must equal K computed at p + d.

Truth is vLLM's own rotary-embedding objects from `get_rope`, run in fp32.

Tolerance: atol 2e-3 on K entries of O(1) (randn), positions < 3200. Both
sides round angles in fp32 (vLLM's cos/sin cache holds fp32(p * f)); at
p = 3200 that rounding is ~2e-4 rad, so |error| <= |k| * 2e-4 per term,
an order below the tolerance. A wrong rule (e.g. mscale applied twice, a
wrong base, a wrong style) gives errors of order 1e-1 and more.
"""

import math

import pytest
import torch
import vllm
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
from vllm.model_executor.layers.rotary_embedding.deepseek_scaling_rope import (
    DeepseekScalingRotaryEmbedding,
)
from vllm.model_executor.layers.rotary_embedding.dual_chunk_rope import (
    DualChunkRotaryEmbedding,
)
from vllm.model_executor.layers.rotary_embedding.linear_scaling_rope import (
    LinearScalingRotaryEmbedding,
)
from vllm.v1.core.chunk_cache_manager import ChunkCacheManager
from vllm.v1.core.chunk_structures import (
    ChunkedPrompt,
    ChunkLoadPlan,
    ChunkNamespace,
    SegmentLoad,
    SegmentSpan,
)
from vllm.v1.worker.position_remapper import (
    PositionRemapper,
    RemapRows,
    RemapScratch,
    RopeRotation,
    Rounding,
)

from tests.chunk_manager_views import child_finished, load_plan, store_plan

ATOL = 2e-3
HEAD_SIZE = 64
NUM_HEADS = 2
MAX_POS = 4096

_LONG = [1.0 + 0.1 * i for i in range(32)]
_SHORT = [1.0 + 0.01 * i for i in range(32)]

# (name, rope_parameters, styles); rotary_dim 32 (partial) where noted.
SUPPORTED = [
    ("default", {"rope_type": "default", "rope_theta": 10000}, (True, False)),
    ("partial", {"rope_type": "default", "partial_rotary_factor": 0.5}, (True, False)),
    ("linear", {"rope_type": "linear", "factor": 2.0}, (True, False)),
    ("ntk", {"rope_type": "ntk", "factor": 2.0}, (True, False)),
    (
        "dynamic",
        {"rope_type": "dynamic", "factor": 2.0, "max_trained_positions": 2048},
        (True, False),
    ),
    ("dynamic_alpha", {"rope_type": "dynamic", "alpha": 2.5}, (True, False)),
    (
        "llama3",
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 512,
            "rope_theta": 500000,
        },
        (True, False),
    ),
    (
        "yarn",
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "attn_factor": 1.3,
            "original_max_position_embeddings": 1024,
        },
        (True, False),
    ),
    (
        "yarn_partial",
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "rope_dim": 32,
            "original_max_position_embeddings": 1024,
        },
        (True, False),
    ),
    # DeepSeek's YaRN (MLA's k_pe; GPT-J style in DeepSeek-V2/V3, neox in V3.2's
    # indexer), with mscale != mscale_all_dim: magnitude ~1.037, not 1.
    (
        "deepseek_yarn",
        {
            "rope_type": "deepseek_yarn",
            "factor": 4.0,
            "mscale": 1.0,
            "mscale_all_dim": 0.707,
            "beta_fast": 32,
            "beta_slow": 1,
            "original_max_position_embeddings": 1024,
        },
        (True, False),
    ),
    # LongRoPE is neox-only in vLLM; max_model_len 2048 > 1024 -> long factors.
    (
        "longrope_long",
        {
            "rope_type": "longrope",
            "short_factor": _SHORT,
            "long_factor": _LONG,
            "original_max_position_embeddings": 1024,
        },
        (True,),
    ),
    # original 4096 >= max_model_len 2048 -> short factors, mscale != 1.
    (
        "longrope_short",
        {
            "rope_type": "longrope",
            "short_factor": _SHORT,
            "long_factor": _LONG,
            "short_mscale": 1.25,
            "original_max_position_embeddings": 4096,
        },
        (True,),
    ),
]
CASES = [(name, params, neox) for name, params, styles in SUPPORTED for neox in styles]


def make_rope(params, neox):
    return get_rope(HEAD_SIZE, MAX_POS, neox, dict(params), torch.float32)


def apply_rope(rope, positions, key):
    """K [n, heads * head] -> rotated K [n, heads, head], by vLLM itself."""
    if isinstance(rope, DeepseekScalingRotaryEmbedding):
        key = key.view(key.shape[0], NUM_HEADS, HEAD_SIZE)  # its forward wants heads
    query = torch.zeros_like(key)
    forward = getattr(rope, "forward_native", rope.forward)
    _, out = forward(positions, query, key.clone())
    return out.reshape(-1, NUM_HEADS, HEAD_SIZE)


@pytest.mark.parametrize(
    "name, params, neox",
    CASES,
    ids=[f"{c[0]}-{'neox' if c[2] else 'gptj'}" for c in CASES],
)
def test_rotate_by_delta_equals_rope_at_shifted_position(
    vllm_config_context, name, params, neox
):
    rope = make_rope(params, neox)
    rotation = RopeRotation(rope)
    gen = torch.Generator().manual_seed(0)
    n = 64
    p = torch.randint(0, 1600, (n,), generator=gen)
    d = torch.randint(-1600, 1600, (n,), generator=gen).clamp(min=-p)
    raw = torch.randn(n, NUM_HEADS * HEAD_SIZE, generator=gen)

    stored = apply_rope(rope, p, raw)
    moved = rotation.rotate(stored, d)
    truth = apply_rope(rope, p + d, raw)
    torch.testing.assert_close(moved, truth, atol=ATOL, rtol=0)
    # Sanity: the test would notice if nothing were rotated.
    assert (stored - truth).abs().max() > 0.1


def test_magnitude_is_applied_once(vllm_config_context):
    # NOTE: vLLM 0.23 scales YaRN's magnitude by `attn_factor`; 0.32 takes HF's
    # `attention_factor` as the whole magnitude. Both give (0.1 ln 4 + 1) * 1.3 here.
    params = {
        "rope_type": "yarn",
        "factor": 4.0,
        "attn_factor": 1.3,
        "attention_factor": (0.1 * math.log(4.0) + 1) * 1.3,
        "original_max_position_embeddings": 1024,
    }
    rope = make_rope(params, True)
    rotation = RopeRotation(rope)
    assert rotation.magnitude == pytest.approx(rope.mscale)
    assert rope.mscale > 1.4  # (0.1 ln 4 + 1) * 1.3
    cos, sin = rotation.cos_sin(torch.tensor([0, 5, 1000]))
    # The delta rotation is pure: unit magnitude, zero delta is identity.
    torch.testing.assert_close(cos**2 + sin**2, torch.ones_like(cos))
    key = torch.randn(3, NUM_HEADS, HEAD_SIZE)
    torch.testing.assert_close(
        rotation.rotate(key, torch.zeros(3, dtype=torch.long)), key
    )


def test_bf16_cache_rows_rotate_within_bf16_rounding(vllm_config_context):
    rope = make_rope({"rope_type": "default"}, True)
    rotation = RopeRotation(rope)
    raw = torch.randn(16, NUM_HEADS * HEAD_SIZE)
    p = torch.arange(16) * 37
    stored = apply_rope(rope, p, raw).to(torch.bfloat16)
    moved = rotation.rotate(stored, torch.full((16,), 900))
    assert moved.dtype == torch.bfloat16
    truth = apply_rope(rope, p + 900, raw)
    # Two bf16 roundings (store, result) of O(1) values.
    torch.testing.assert_close(moved.float(), truth, atol=4e-2, rtol=0)


@pytest.mark.parametrize(
    "kwargs, type_name",
    [
        (
            {"rope_parameters": {"rope_type": "default", "mrope_section": [16, 8, 8]}},
            "MRotaryEmbedding",
        ),
        # DeepSeek-V4 rotates the *last* rotary_dim values and keeps an fp32 cache.
        (
            {
                "rope_parameters": {
                    "rope_type": "deepseek_yarn",
                    "factor": 4.0,
                    "is_deepseek_v4": True,
                    "original_max_position_embeddings": 1024,
                }
            },
            "DeepseekV4ScalingRotaryEmbedding",
        ),
        (
            {
                "rope_parameters": {
                    "rope_type": "default",
                    "use_fope": True,
                    "num_key_value_heads": 2,
                    "num_inv_freq": 16,
                    "fope_sep_head": True,
                    "fope_init_factor": 0.1,
                }
            },
            "FourierRotaryEmbedding",
        ),
        ({"rope_parameters": {"rope_type": "proportional"}}, "Gemma4RotaryEmbedding"),
        (
            {
                "rope_parameters": {
                    "rope_type": "xdrope",
                    "alpha": 2.0,
                    "xdrope_section": [8, 8, 8, 8],
                }
            },
            "XDRotaryEmbedding",
        ),
        (
            {"rope_parameters": {"rope_type": "telechat3-yarn", "factor": 2.0}},
            "TeleChat3RoPEScaledRotaryEmbedding",
        ),
    ],
)
def test_unsupported_rope_types_are_refused_by_name(
    vllm_config_context, kwargs, type_name
):
    try:
        rope = get_rope(HEAD_SIZE, MAX_POS, True, dtype=torch.float32, **kwargs)
    except ValueError as e:
        # Rope types come and go between vLLM releases (xdrope and telechat3-yarn exist
        # in 0.23, not in 0.32); a type this vLLM cannot build cannot reach the
        # remapper.
        if "Unknown RoPE scaling type" not in str(e):
            raise
        pytest.skip(f"vLLM {vllm.__version__} has no rope type: {e}")
    assert type(rope).__name__ == type_name
    with pytest.raises(ValueError, match=f"RoPE type {type_name}"):
        RopeRotation(rope)


def test_dual_chunk_rope_is_refused(vllm_config_context):
    # NOTE: DualChunkRotaryEmbedding.__init__ needs a CUDA device; an
    # uninitialised instance still has the exact type that is dispatched on.
    rope = DualChunkRotaryEmbedding.__new__(DualChunkRotaryEmbedding)
    with pytest.raises(ValueError, match="RoPE type DualChunkRotaryEmbedding"):
        RopeRotation(rope)


def test_multi_factor_linear_scaling_is_refused(vllm_config_context):
    rope = LinearScalingRotaryEmbedding(
        HEAD_SIZE, HEAD_SIZE, 1024, 10000, True, [1.0, 2.0], torch.float32
    )
    with pytest.raises(ValueError, match="one factor"):
        RopeRotation(rope)


def test_self_check_catches_frequency_drift(vllm_config_context):
    rope = RotaryEmbedding(HEAD_SIZE, HEAD_SIZE, 1024, 10000, True, torch.float32)
    RopeRotation(rope)  # consistent
    rope.base = 5000  # the cache was built with 10000
    with pytest.raises(ValueError, match="do not match"):
        RopeRotation(rope)


# ------------------------------------------------------------ remapping


class PagedCache:
    """A flat paged K/V store written through `write_rows` (the seam)."""

    def __init__(self, num_slots: int, dtype=torch.float32):
        self.key = torch.zeros(num_slots, NUM_HEADS, HEAD_SIZE, dtype=dtype)
        self.value = torch.zeros_like(self.key)
        self.calls: list[str] = []

    def write_rows(self, layer_name, key, value, slot_mapping):
        self.calls.append(layer_name)
        self.key[slot_mapping] = key
        self.value[slot_mapping] = value


def test_from_load_plan_expands_rows_slots_and_deltas():
    plan = ChunkLoadPlan(
        "r",
        (
            SegmentLoad(b"s" * 16, 0, [5], 2, stored_start=0, dst_start=0),
            SegmentLoad(b"a" * 16, 1, [2, 7], 5, stored_start=1, dst_start=2),
        ),
    )
    dst_slots = torch.arange(100, 110)
    rows = RemapRows.from_load_plan(plan, pool_block_size=4, dst_slots=dst_slots)
    assert rows.src_rows.tolist() == [20, 21, 8, 9, 10, 11, 28]
    assert rows.dst_slots.tolist() == [100, 101, 102, 103, 104, 105, 106]
    assert rows.deltas.tolist() == [0, 0, 1, 1, 1, 1, 1]
    with pytest.raises(ValueError, match="segment 1 ends at position 7"):
        RemapRows.from_load_plan(plan, 4, torch.arange(6))


def test_manager_plan_through_remapper_lands_rope_at_real_positions(
    vllm_config_context,
):
    """Children store K at child positions; the parent's paged cache must
    end up with K exactly as if computed at the real positions."""
    rope = make_rope({"rope_type": "default"}, True)
    block = 4
    manager = ChunkCacheManager(num_pool_blocks=8, block_size=block, sink_token_id=1)
    pool_k = torch.zeros(8 * block, NUM_HEADS, HEAD_SIZE)
    pool_v = torch.zeros_like(pool_k)

    system, doc, question = [1, 2, 3], [10, 11, 12, 13, 14], [30]
    prompt = ChunkedPrompt(
        system + doc + question,
        (SegmentSpan(0, 3), SegmentSpan(3, 8), SegmentSpan(8, 9)),
    )
    gen = torch.Generator().manual_seed(1)
    raw_k = {t: torch.randn(NUM_HEADS * HEAD_SIZE, generator=gen) for t in range(40)}
    raw_v = {t: torch.randn(NUM_HEADS, HEAD_SIZE, generator=gen) for t in range(40)}

    manager.add_request("r", prompt, ChunkNamespace("m", "float32", "t"))
    for child in manager.admit("r").children:
        # What the worker does on store: K after RoPE at child positions.
        store = store_plan(manager, child)
        positions = torch.arange(len(child.token_ids))
        k = apply_rope(
            rope, positions, torch.stack([raw_k[t] for t in child.token_ids])
        )
        v = torch.stack([raw_v[t] for t in child.token_ids])
        rows = torch.tensor(
            [b * block + i for b in store.pool_block_ids for i in range(block)]
        )[: store.num_tokens]
        pool_k[rows] = k[store.src_start :]
        pool_v[rows] = v[store.src_start :]
        child_finished(manager, child.request_id)

    plan = load_plan(manager, "r")
    paged = PagedCache(num_slots=32)
    dst_slots = torch.arange(16, 16 + len(prompt.token_ids))  # block table
    rows = RemapRows.from_load_plan(plan, block, dst_slots)
    remapper = PositionRemapper(RopeRotation(rope), paged.write_rows)
    remapper.remap_layer("layers.0.attn", pool_k, pool_v, rows)

    cached = prompt.token_ids[: prompt.question_span.start]
    truth_k = apply_rope(
        rope, torch.arange(len(cached)), torch.stack([raw_k[t] for t in cached])
    )
    slots = dst_slots[: len(cached)]
    torch.testing.assert_close(paged.key[slots], truth_k, atol=ATOL, rtol=0)
    torch.testing.assert_close(
        paged.value[slots], torch.stack([raw_v[t] for t in cached])
    )
    assert paged.calls == ["layers.0.attn"]
    assert paged.key[:16].abs().sum() == 0  # nothing written elsewhere


def test_layer_without_rope_copies_and_zero_delta_skips_rotation(
    vllm_config_context,
):
    pool_k = torch.randn(8, NUM_HEADS, HEAD_SIZE)
    pool_v = torch.randn(8, NUM_HEADS, HEAD_SIZE)
    rows = RemapRows(
        src_rows=torch.tensor([3, 1]),
        dst_slots=torch.tensor([0, 5]),
        deltas=torch.tensor([7, 7]),
    )
    paged = PagedCache(num_slots=6)
    PositionRemapper(None, paged.write_rows).remap_layer("l", pool_k, pool_v, rows)
    torch.testing.assert_close(paged.key[[0, 5]], pool_k[[3, 1]], atol=0, rtol=0)
    torch.testing.assert_close(paged.value[[0, 5]], pool_v[[3, 1]], atol=0, rtol=0)

    # Zero deltas (the system segment) are copied bit for bit, no rotation.
    rotation = RopeRotation(make_rope({"rope_type": "default"}, True))
    zero = RemapRows(
        src_rows=torch.tensor([2]),
        dst_slots=torch.tensor([4]),
        deltas=torch.tensor([0]),
    )
    PositionRemapper(rotation, paged.write_rows).remap_layer("l", pool_k, pool_v, zero)
    assert torch.equal(paged.key[4], pool_k[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reused_buffers_give_each_layer_and_step_its_own_rows(
    vllm_config_context, dtype
):
    """Two layers and two steps of different sizes through one shared scratch:
    every write equals the rotation of its own rows (a buffer reused too early, or
    sliced to another step's size, would hand a layer another layer's rows)."""
    rotation = RopeRotation(make_rope({"rope_type": "default"}, True))
    pools = {
        name: (
            torch.randn(32, NUM_HEADS, HEAD_SIZE).to(dtype),
            torch.randn(32, NUM_HEADS, HEAD_SIZE).to(dtype),
        )
        for name in ("a", "b")
    }
    written: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def write_rows(name, key, value, slots):
        written.append((name, key.clone(), value.clone(), slots.clone()))

    scratch = RemapScratch()
    remappers = {
        name: PositionRemapper(rotation, write_rows, scratch) for name in pools
    }
    steps = [
        RemapRows(
            src_rows=torch.tensor([5, 9, 2, 30, 17]),
            dst_slots=torch.arange(5),
            deltas=torch.tensor([3, 3, 3, 40, 40]),
        ),
        RemapRows(
            src_rows=torch.tensor([1, 4]),
            dst_slots=torch.tensor([7, 8]),
            deltas=torch.tensor([-1, 12]),
        ),
    ]
    for rows in steps:
        for name, (pool_k, pool_v) in pools.items():
            remappers[name].remap_layer(name, pool_k, pool_v, rows)
    assert [w[0] for w in written] == ["a", "b", "a", "b"]
    for (name, key, value, slots), rows in zip(
        written, [steps[0]] * 2 + [steps[1]] * 2
    ):
        pool_k, pool_v = pools[name]
        expected = rotation.rotate(pool_k[rows.src_rows], rows.deltas)
        assert key.dtype == dtype and key.shape[0] == rows.src_rows.shape[0]
        torch.testing.assert_close(key, expected, atol=0, rtol=0)
        assert torch.equal(value, pool_v[rows.src_rows])
        assert torch.equal(slots, rows.dst_slots)


# ------------------------------------------------- CPU in-place fast path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "name, params, neox",
    CASES,
    ids=[f"{c[0]}-{'neox' if c[2] else 'gptj'}" for c in CASES],
)
def test_cpu_kernel_path_equals_generic_path_bit_for_bit(
    vllm_config_context, name, params, neox, dtype
):
    """The CPU fast path (vLLM's RoPE op, in place on the gathered rows) writes
    exactly what the generic rotate() path writes with the rounding the
    self-check chose: bit for bit, not within a tolerance. Where the op
    reproduces neither rounding the self-check keeps the generic path, so
    this holds on every CPU."""
    rope = make_rope(params, neox)
    fast, generic = RopeRotation(rope), RopeRotation(rope, use_cpu_kernel=False)
    assert not generic.rotates_in_place(torch.device("cpu"))
    assert generic.rounding is Rounding.PRODUCTS
    fast.rotates_in_place(torch.device("cpu"))
    generic.rounding = fast.rounding
    gen = torch.Generator().manual_seed(1)
    pool_k = (4 * torch.randn(96, NUM_HEADS, HEAD_SIZE, generator=gen)).to(dtype)
    pool_v = torch.randn(96, NUM_HEADS, HEAD_SIZE, generator=gen).to(dtype)
    deltas = torch.tensor([0, 3, -700, 2900, 40000]).repeat_interleave(12)
    rows = RemapRows(
        src_rows=torch.randperm(96, generator=gen)[:60],
        dst_slots=torch.arange(60),
        deltas=deltas,
    )
    written = {}
    for label, rotation in (("fast", fast), ("generic", generic)):
        paged = PagedCache(num_slots=60, dtype=dtype)
        remapper = PositionRemapper(rotation, paged.write_rows)
        remapper.remap_layer("l", pool_k, pool_v, rows)
        remapper.remap_layer("l", pool_k, pool_v, rows)  # cached delta table
        written[label] = paged
    assert torch.equal(written["fast"].key, written["generic"].key)
    assert torch.equal(written["fast"].value, written["generic"].value)
    # Which path ran is a property of this machine (vLLM's op rounds like
    # rotate() on some x86 CPUs, not on others): reported, never asserted.
    path = fast.describe_path(torch.device("cpu"))
    print(f"{name}-{'neox' if neox else 'gptj'}: {path}")


def test_cpu_rope_op_is_a_rotation_by_the_delta_on_every_cpu(vllm_config_context):
    """Whatever the machine, vLLM's CPU RoPE op with our per-delta table
    rotates by the delta to within fp32 rounding (so the self-check's only
    question is the last bit); where it is also bit-identical the fast path
    is taken, else the reason names the difference."""
    rotation = RopeRotation(make_rope({"rope_type": "default"}, True))
    taken = rotation.rotates_in_place(torch.device("cpu"))
    path = rotation.describe_path(torch.device("cpu"))
    if "unavailable" in path:  # this vLLM build has no such CPU op
        pytest.skip(path)
    gen = torch.Generator().manual_seed(2)
    key = 4 * torch.randn(40, NUM_HEADS, HEAD_SIZE, generator=gen)
    deltas = torch.tensor([0, 7, -300, 5000]).repeat_interleave(10)
    expected = rotation.rotate(key, deltas)
    in_place = key.clone()
    rotation.rotate_in_place(in_place, deltas)
    torch.testing.assert_close(in_place, expected, atol=1e-5, rtol=1e-6)
    exact = torch.equal(in_place, expected)
    assert taken == exact
    assert ("in place" in path) if exact else ("differs" in path), path
    if not exact:
        pytest.skip(f"fast path not taken on this CPU: {path}")


def test_cpu_kernel_delta_table_follows_in_place_changes(vllm_config_context):
    rotation = RopeRotation(make_rope({"rope_type": "default"}, True))
    if not rotation.rotates_in_place(torch.device("cpu")):
        pytest.skip("vLLM's CPU RoPE op is not used on this machine")
    key = torch.randn(4, NUM_HEADS, HEAD_SIZE)
    deltas = torch.tensor([5, 5, 9, 9])
    first = key.clone()
    rotation.rotate_in_place(first, deltas)
    deltas[2:] = 100  # same tensor, new contents: the table must follow
    second = key.clone()
    rotation.rotate_in_place(second, deltas)
    assert torch.equal(second, rotation.rotate(key, deltas))
    assert not torch.equal(second[2:], first[2:])


def test_cpu_kernel_rotates_tensors_made_under_inference_mode(vllm_config_context):
    """The worker loads under torch.inference_mode, where new tensors have no
    version counter. Before: "Inference tensors do not track version counter"
    at the first load of every engine whose CPU took the in-place path."""
    rotation = RopeRotation(make_rope({"rope_type": "default"}, True))
    taken = rotation.rotates_in_place(torch.device("cpu"))
    if "unavailable" in rotation.describe_path(torch.device("cpu")):
        pytest.skip(rotation.describe_path(torch.device("cpu")))
    with torch.inference_mode():
        key = torch.randn(6, NUM_HEADS, HEAD_SIZE)
        deltas = torch.tensor([3, 3, -40, -40, 900, 900])
        assert deltas.is_inference()
        rotated = key.clone()
        rotation.rotate_in_place(rotated, deltas)
        again = key.clone()
        rotation.rotate_in_place(again, deltas)  # the step's cached table
        expected = rotation.rotate(key, deltas)
    assert torch.equal(again, rotated)
    if taken:
        assert torch.equal(rotated, expected)
    torch.testing.assert_close(rotated, expected, atol=1e-5, rtol=1e-6)


def test_fixed_scratch_never_grows_and_pieces_cover_every_row_in_order(
    vllm_config_context,
):
    """Issue 20, finding 3: the worker's load buffers are allocated once at
    the per-step cap's size (counted in the carve-out); a longer load goes
    through them in pieces and writes exactly what one pass writes."""
    rope = make_rope({"rope_type": "default"}, True)
    gen = torch.Generator().manual_seed(3)
    pool_k = torch.randn(50, NUM_HEADS, HEAD_SIZE, generator=gen)
    pool_v = torch.randn(50, NUM_HEADS, HEAD_SIZE, generator=gen)
    rows = RemapRows(
        src_rows=torch.randperm(50, generator=gen)[:23],
        dst_slots=torch.arange(23),
        deltas=torch.arange(23) * 37 - 400,
    )
    assert [p.num_rows for p in rows.pieces(8)] == [8, 8, 7]
    assert torch.equal(torch.cat([p.deltas for p in rows.pieces(8)]), rows.deltas)
    written = {}
    for label, max_rows in (("one pass", None), ("pieces", 8)):
        paged = PagedCache(num_slots=23, dtype=torch.float32)
        scratch = RemapScratch(max_rows)
        remapper = PositionRemapper(RopeRotation(rope), paged.write_rows, scratch)
        for piece in rows.pieces(max_rows or rows.num_rows):
            remapper.remap_layer("l", pool_k, pool_v, piece)
        written[label] = paged
        if max_rows is not None:
            assert {b.shape[0] for b in scratch._buffers.values()} == {8}
            with pytest.raises(ValueError, match="9 rows exceed the load buffers' 8"):
                scratch.take("key", pool_k, 9)
    assert torch.equal(written["pieces"].key, written["one pass"].key)
    assert torch.equal(written["pieces"].value, written["one pass"].value)
    assert RemapScratch.bytes_per_row(8, 8, torch.float32) == 3 * 8 * 4
    assert RemapScratch.bytes_per_row(8, 8, torch.bfloat16) == 3 * 8 * 2 + 2 * 8 * 4


# ---------------------------------------------- platform registration seam


@pytest.fixture
def rope_rules():
    """register_rope_rule changes module-level tables: restore them."""
    from vllm.v1.worker import position_remapper

    rules = dict(position_remapper._FREQUENCY_RULES)
    pairing = dict(position_remapper._STORED_PAIRING)
    yield position_remapper
    position_remapper._FREQUENCY_RULES.clear()
    position_remapper._FREQUENCY_RULES.update(rules)
    position_remapper._STORED_PAIRING.clear()
    position_remapper._STORED_PAIRING.update(pairing)


class PlatformRope(RotaryEmbedding):
    """A platform's subclass that keeps the parent's angle rule (as
    vllm-ascend's AscendRotaryEmbedding: only its forward's op differs)."""


class PlatformRopeVariant(PlatformRope):
    """A subclass of a registered subclass: not registered itself."""


class DeinterleavingRope(DeepseekScalingRotaryEmbedding):
    """As vllm-ascend's AscendDeepseekScalingRotaryEmbedding: a GPT-J rope
    whose forward de-interleaves q/k (evens, then odds) and rotates
    neox-style, keeping its frequencies in an `inv_freq` buffer."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_buffer(
            "inv_freq", self._compute_inv_freq(self.scaling_factor), persistent=False
        )

    def forward_native(self, positions, query, key, offsets=None):
        if not self.is_neox_style:
            query = torch.cat((query[..., 0::2], query[..., 1::2]), -1)
            key = torch.cat((key[..., 0::2], key[..., 1::2]), -1)
        return self.forward_static(
            positions,
            query,
            key,
            self.head_size,
            self.rotary_dim,
            self.cos_sin_cache,
            True,
        )


def _platform_rope(cls, neox):
    if issubclass(cls, DeepseekScalingRotaryEmbedding):
        return cls(
            HEAD_SIZE,
            HEAD_SIZE,
            1024,
            10000,
            neox,
            4.0,
            torch.float32,
            beta_fast=32,
            beta_slow=1,
            mscale=1.0,
            mscale_all_dim=0.707,
        )
    return cls(HEAD_SIZE, HEAD_SIZE, MAX_POS, 10000, neox, torch.float32)


def _moved_and_truth(rope, rotation):
    gen = torch.Generator().manual_seed(3)
    n = 48
    p = torch.randint(0, 1600, (n,), generator=gen)
    d = torch.randint(-1600, 1600, (n,), generator=gen).clamp(min=-p)
    raw = torch.randn(n, NUM_HEADS * HEAD_SIZE, generator=gen)
    stored = apply_rope(rope, p, raw)
    truth = apply_rope(rope, p + d, raw)
    assert (stored - truth).abs().max() > 0.1
    return stored, d, truth


@pytest.mark.parametrize("neox", [True, False])
def test_platform_subclass_refused_until_registered_then_rotates_as_its_parent(
    vllm_config_context, rope_rules, neox
):
    rope = _platform_rope(PlatformRope, neox)
    with pytest.raises(ValueError, match="PlatformRope"):
        RopeRotation(rope)
    rope_rules.register_rope_rule(PlatformRope, RotaryEmbedding)
    rotation = RopeRotation(rope)
    parent = RopeRotation(_platform_rope(RotaryEmbedding, neox))
    assert rotation.is_neox_style is neox
    assert torch.equal(rotation.inv_freq, parent.inv_freq)
    stored, d, truth = _moved_and_truth(rope, rotation)
    moved = rotation.rotate(stored, d)
    assert torch.equal(moved, parent.rotate(stored, d))  # bit for bit the parent's
    torch.testing.assert_close(moved, truth, atol=ATOL, rtol=0)
    # Exact types only: a subclass of the registered class stays refused.
    with pytest.raises(ValueError, match="PlatformRopeVariant"):
        RopeRotation(_platform_rope(PlatformRopeVariant, neox))


def test_registered_subclass_still_faces_the_cache_self_check(
    vllm_config_context, rope_rules
):
    rope = _platform_rope(PlatformRope, True)
    rope.cos_sin_cache = rope.cos_sin_cache * 1.5  # another magnitude than the rule's
    rope_rules.register_rope_rule(PlatformRope, RotaryEmbedding)
    with pytest.raises(ValueError, match="do not match"):
        RopeRotation(rope)


def test_registration_refuses_what_it_cannot_take(rope_rules):
    with pytest.raises(TypeError):
        rope_rules.register_rope_rule("AscendRotaryEmbedding", RotaryEmbedding)
    with pytest.raises(ValueError, match="no frequency rule"):
        rope_rules.register_rope_rule(PlatformRope, PlatformRopeVariant)


@pytest.mark.parametrize("neox", [True, False])
def test_stored_pairing_override_rotates_keys_as_the_forward_lays_them_out(
    vllm_config_context, rope_rules, neox
):
    rope = _platform_rope(DeinterleavingRope, neox)
    rope_rules.register_rope_rule(
        DeinterleavingRope,
        rope_rules.yarn_from_inv_freq_buffer,
        stored_neox_style=lambda r: True,
    )
    rotation = RopeRotation(rope)
    assert rotation.is_neox_style is True
    assert rotation.magnitude == pytest.approx(float(rope.mscale))
    stored, d, truth = _moved_and_truth(rope, rotation)
    torch.testing.assert_close(rotation.rotate(stored, d), truth, atol=ATOL, rtol=0)
    if not neox:
        # The rope's own style (GPT-J) would pair the wrong values.
        gptj = rotation.with_pairing(False)
        assert gptj.is_neox_style is False and rotation.is_neox_style is True
        assert (gptj.rotate(stored, d) - truth).abs().max() > 0.1
        # Re-interleaved rows (what Ascend's MLA reader returns) need GPT-J.
        inter = torch.stack(
            (stored[..., : HEAD_SIZE // 2], stored[..., HEAD_SIZE // 2 :]), -1
        ).flatten(-2)
        truth_inter = torch.stack(
            (truth[..., : HEAD_SIZE // 2], truth[..., HEAD_SIZE // 2 :]), -1
        ).flatten(-2)
        torch.testing.assert_close(
            gptj.rotate(inter, d), truth_inter, atol=ATOL, rtol=0
        )
    # Unregistered again without an override: the rope's style.
    rope_rules.register_rope_rule(
        DeinterleavingRope, rope_rules.yarn_from_inv_freq_buffer
    )
    assert RopeRotation(rope).is_neox_style is neox
