"""GPU check of the chunk cache's data path with Llama-3-8B shapes (no engine).

* a device-resident chunk pool and a FlashAttention-layout paged KV cache;
* load: PositionRemapper gathers pool rows, rotates K by the position delta
  (fp32) and writes K/V with vLLM's own cache-write op
  (torch.ops._C_cache_ops.reshape_and_cache_flash, what FlashAttentionImpl
  .do_kv_cache_update calls); checked against a float64 reference, every
  layer's loop run under torch.cuda.set_sync_debug_mode("error") (any host
  synchronisation raises);
* fused: the same load through the fused Triton kernel, all 32 layers in one
  launch (vllm/v1/worker/fused_chunk_load.py), which must write the same bytes as the
  load above (compared at every written slot of every layer), same sync check;
* capture: index_copy_ of a batch's K/V rows into the pool, same checks;
* bytes/s of all three against the device's measured copy bandwidth.

Run (device with vLLM importable): python benchmarks/gpu_remap.py
"""

from __future__ import annotations

import statistics
import sys

import torch

LAYERS, KV_HEADS, HEAD, BLOCK = 32, 8, 128, 16
POOL_ROWS, KV_BLOCKS = 65536, 8192
DTYPE = torch.bfloat16


def timed(fn, reps=20, warm=3) -> float:
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def copy_bandwidth() -> float:
    src = torch.randn(1 << 29, device="cuda", dtype=torch.float32)  # 2 GiB
    dst = torch.empty_like(src)
    t = timed(lambda: dst.copy_(src), reps=10)
    return 2 * src.nbytes / t


def main() -> int:
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    from vllm.v1.worker.position_remapper import PositionRemapper, RemapRows, RopeRotation

    dev = torch.device("cuda")
    print("device:", torch.cuda.get_device_name(), "torch", torch.__version__)
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        rope = RotaryEmbedding(HEAD, HEAD, 8192, 500000.0, True, torch.float32)
    rotation = RopeRotation(rope)
    g = torch.Generator(device=dev).manual_seed(0)
    pool_k = [torch.randn(POOL_ROWS, KV_HEADS, HEAD, device=dev, dtype=DTYPE, generator=g)
              for _ in range(LAYERS)]
    pool_v = [torch.randn(POOL_ROWS, KV_HEADS, HEAD, device=dev, dtype=DTYPE, generator=g)
              for _ in range(LAYERS)]
    caches = [torch.full((KV_BLOCKS, 2, BLOCK, KV_HEADS, HEAD), float("nan"), device=dev,
                         dtype=DTYPE) for _ in range(LAYERS)]
    scale = torch.ones((), device=dev, dtype=torch.float32)

    def write_rows(name, key, value, slots):
        cache = caches[int(name)]
        torch.ops._C_cache_ops.reshape_and_cache_flash(
            key, value, cache[:, 0], cache[:, 1], slots, "auto", scale, scale)

    remapper = PositionRemapper(rotation, write_rows)
    results = []
    from vllm.v1.worker.fused_chunk_load import FusedGroup, PagedLayer, fused_load

    # As the worker: every layer in one launch per step.
    group = FusedGroup.of(pool_k, pool_v, [PagedLayer(c[:, 0], c[:, 1]) for c in caches])
    for n_rows in (1024, 4096, 16384, 65536):
        # 4 segments at shuffled pool places, to a contiguous run of slots,
        # deltas up to ~8k positions in both directions.
        seg = n_rows // 4
        starts = torch.randperm(POOL_ROWS // seg, generator=torch.Generator().manual_seed(n_rows))[:4] * seg
        src = torch.cat([torch.arange(s, s + seg) for s in starts.tolist()])
        deltas = torch.cat([torch.full((seg,), d) for d in (8000, -123, 4097, 0)])
        first_slot = 1000 * BLOCK + 3
        dst = torch.arange(first_slot, first_slot + n_rows)
        # As the worker: one cos/sin row per stretch (formed on the host from
        # the stretches' deltas, sent once per step), each row's stretch index.
        host_deltas = torch.tensor([8000, -123, 4097, 0])
        stretch_index = torch.arange(4).repeat_interleave(seg)
        packed = torch.stack([src, dst, deltas, stretch_index]).pin_memory().to(
            dev, non_blocking=True)
        rows = RemapRows(src_rows=packed[0], dst_slots=packed[1], deltas=packed[2],
                         stretch_index=packed[3], stretch_deltas=host_deltas)

        def step():
            stretches = rotation.stretch_cos_sin(host_deltas, dev)  # once per step
            for layer in range(LAYERS):
                remapper.remap_layer(str(layer), pool_k[layer], pool_v[layer], rows,
                                     stretches)

        step()  # warm-up
        torch.cuda.synchronize()
        for cache in caches:
            cache.fill_(float("nan"))  # poison: every checked row must be written
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        step()  # raises if anything in the per-step loop synchronises
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        # Correctness (every layer, fresh random data): float64 reference.
        worst_rel, v_exact = 0.0, True
        for layer in range(LAYERS):
            k = pool_k[layer][src.to(dev)].double()
            ang = deltas.to(dev).double()[:, None] * rotation.inv_freq.double().to(dev)
            cos, sin = ang.cos()[:, None], ang.sin()[:, None]
            x1, x2 = k[..., : HEAD // 2], k[..., HEAD // 2:]
            ref = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
            slots = dst.to(dev)
            got_k = caches[layer][slots // BLOCK, 0, slots % BLOCK].double()
            got_v = caches[layer][slots // BLOCK, 1, slots % BLOCK]
            assert not torch.isnan(got_k).any(), "unwritten rows"
            worst_rel = max(worst_rel, float((got_k - ref).norm() / ref.norm()))
            v_exact &= bool(torch.equal(got_v, pool_v[layer][src.to(dev)]))
        t = timed(step)
        # Useful bytes: read K,V rows from the pool, write them to the cache.
        useful = LAYERS * 4 * n_rows * KV_HEADS * HEAD * DTYPE.itemsize
        results.append(("load", n_rows, t, useful / t, worst_rel, v_exact))

        # Fused: same rows, one kernel per layer; the same bytes at every slot.
        slots = dst.to(dev)
        written = [c[slots // BLOCK, :, slots % BLOCK].clone() for c in caches]
        def fused_step():
            stretches = rotation.stretch_cos_sin(host_deltas, dev)  # once per step
            fused_load(group, rows.src_rows, rows.dst_slots, rows.stretch_index,
                       (stretches.cos, stretches.sin), True, HEAD)

        fused_step()
        torch.cuda.synchronize()
        for cache in caches:
            cache.fill_(float("nan"))
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        fused_step()
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        same = all(torch.equal(c[slots // BLOCK, :, slots % BLOCK].view(torch.int16),
                               w.view(torch.int16)) for c, w in zip(caches, written))
        del written
        tf = timed(fused_step)
        results.append(("fused", n_rows, tf, useful / tf, worst_rel if same else 1.0, same))

        # Capture: a batch of n_rows tokens, rows picked by index, into the pool.
        batch_k = torch.randn(n_rows + 37, KV_HEADS, HEAD, device=dev, dtype=DTYPE)
        batch_v = torch.randn_like(batch_k)
        pick = torch.randperm(n_rows + 37, device=dev)[:n_rows]
        dst_rows = (torch.arange(n_rows, device=dev) + 5 * seg) % POOL_ROWS

        def capture():
            for layer in range(LAYERS):
                pool_k[layer].index_copy_(0, dst_rows, batch_k.index_select(0, pick))
                pool_v[layer].index_copy_(0, dst_rows, batch_v.index_select(0, pick))

        torch.cuda.set_sync_debug_mode("error")
        capture()
        torch.cuda.set_sync_debug_mode("default")
        ok = bool(torch.equal(pool_k[7][dst_rows], batch_k[pick]))
        tc = timed(capture)
        results.append(("capture", n_rows, tc, useful / tc, 0.0, ok))

    bw = copy_bandwidth()
    print(f"device-to-device copy: {bw / 1e12:.2f} TB/s (bytes read + written)")
    print(f"{'path':8} {'rows':>6} {'ms/step(32 layers)':>19} {'useful TB/s':>12} "
          f"{'% of copy':>9} {'K rel.err':>10} {'V/rows exact':>12}")
    for kind, n, t, rate, err, exact in results:
        print(f"{kind:8} {n:6d} {t * 1e3:19.3f} {rate / 1e12:12.3f} {100 * rate / bw:9.1f} "
              f"{err:10.2e} {str(exact):>12}")
    bad = [r for r in results if not r[5] or r[4] > 1e-2]
    print("no host sync in the per-layer loops (set_sync_debug_mode=error): OK")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
