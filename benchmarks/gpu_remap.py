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
* bytes/s of all three against the device's measured copy bandwidth;
* --sweep quick|full: the fused load and the fused capture (`fused_capture`,
  all layers in one launch) at 4k and 16k rows under several launch
  geometries (`LaunchGeometry`: rows and heads per program, num_warps), each
  checked to write the bytes of the default geometry (poisoned destinations,
  every written slot / pool row of every layer), in one table with % of the
  copy bandwidth and the best geometry per kernel. quick: rows 4-32 x heads
  1-2 x warps 2-8 around the default (8 x 1 x 4, the best of 2026-11-26's
  sweep on an H100) and the former one-row default, 25 in all (the 11 of
  2026-11-26 took 8 s); full: 57.

Run (device with vLLM importable): python benchmarks/gpu_remap.py
[--sweep quick|full] [--sweep-only]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

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


def step_rows(n_rows: int):
    """A step's rows: 4 segments at shuffled pool places, to a contiguous run
    of slots, deltas up to ~8k positions in both directions; one cos/sin row
    per stretch (host deltas), each row's stretch index."""
    seg = n_rows // 4
    places = torch.randperm(POOL_ROWS // seg, generator=torch.Generator().manual_seed(n_rows))
    starts = places[:4] * seg
    src = torch.cat([torch.arange(s, s + seg) for s in starts.tolist()])
    deltas = torch.cat([torch.full((seg,), d) for d in (8000, -123, 4097, 0)])
    first_slot = 1000 * BLOCK + 3
    dst = torch.arange(first_slot, first_slot + n_rows)
    host_deltas = torch.tensor([8000, -123, 4097, 0])
    stretch_index = torch.arange(4).repeat_interleave(seg)
    return src, dst, deltas, stretch_index, host_deltas


def sweep_geometries(kind: str) -> list:
    """The geometries timed besides the default, around the best measured one
    (8 rows x 1 head x 4 warps on an H100, 2026-11-26; docs/design/fused-load.md):
    quick: rows 4-32 x heads 1-2 x warps 2-8 (24, the default among them), plus
    the former one-row default as the baseline; full: rows 1-32 x heads 1, 2 and
    every KV head x warps 1-8, tiles of at most 64 (row, head) entries."""
    from vllm.v1.worker.fused_chunk_load import ONE_ROW_GEOMETRY, LaunchGeometry

    if kind == "quick":
        tiles = [(r, h) for h in (1, 2) for r in (4, 8, 16, 32)]
        warps = (2, 4, 8)
        extra = [ONE_ROW_GEOMETRY]
    else:
        # NOTE: tiles of at most 64 (row, head) entries: larger ones hold
        # 64 x 128 fp32 values per tensor of the rotation, past the registers.
        tiles = [(r, h) for h in (1, 2, KV_HEADS) for r in (1, 2, 4, 8, 16, 32)
                 if r * h <= 64]
        warps = (1, 2, 4, 8)
        extra = [ONE_ROW_GEOMETRY]
    return extra + [LaunchGeometry(r, h, w) for r, h in tiles for w in warps]


def sweep(kind: str, group, caches, pool_k, pool_v, rotation, bw: float,
          dev: torch.device = torch.device("cuda"), row_counts=(4096, 16384),
          time_fn=timed) -> bool:
    """Times the fused load and capture under each geometry; True if every
    geometry wrote the default geometry's bytes."""
    from vllm.v1.worker.fused_chunk_load import (
        DEFAULT_CAPTURE_GEOMETRY,
        DEFAULT_LOAD_GEOMETRY,
        fused_capture,
        fused_load,
    )

    defaults = {"load": DEFAULT_LOAD_GEOMETRY, "capture": DEFAULT_CAPTURE_GEOMETRY}
    geometries = {kernel: [d] + [g for g in sweep_geometries(kind) if g != d]
                  for kernel, d in defaults.items()}
    rows = []  # (kernel, n_rows, geometry, seconds, same bytes)
    started = time.monotonic()
    useful = {n: LAYERS * 4 * n * KV_HEADS * HEAD * DTYPE.itemsize for n in row_counts}
    print(f"\nlaunch geometry sweep ({kind}, {len(geometries['load'])} geometries a kernel, "
          "first = the kernel's default)")
    print(f"{'kernel':8} {'rows':>6} {'rows/prog':>9} {'heads/prog':>10} {'warps':>5} "
          f"{'ms/step':>8} {'useful TB/s':>11} {'% of copy':>9} {'same bytes':>10}", flush=True)

    def record(kernel, n, g, t, same):
        rows.append((kernel, n, g, t, same))
        print(f"{kernel:8} {n:6d} {g.rows_per_program:9d} {g.heads_per_program:10d} "
              f"{str(g.num_warps or 'dflt'):>5} {t * 1e3:8.3f} {useful[n] / t / 1e12:11.3f} "
              f"{100 * useful[n] / t / bw:9.1f} {str(same):>10}", flush=True)

    for n_rows in row_counts:
        src, dst, _, stretch_index, host_deltas = step_rows(n_rows)
        src, slots, stretch_index = (t.to(dev) for t in (src, dst, stretch_index))
        stretches = rotation.stretch_cos_sin(host_deltas, dev)
        blocks, offsets = slots // BLOCK, slots % BLOCK

        def load(geometry):
            fused_load(group, src, slots, stretch_index, (stretches.cos, stretches.sin), True,
                       HEAD, geometry=geometry)

        def loaded():
            return [c[blocks, :, offsets] for c in caches]

        load(DEFAULT_LOAD_GEOMETRY)
        want = loaded()
        for geometry in geometries["load"]:
            for cache in caches:
                cache.fill_(float("nan"))  # poison: every slot must be written again
            load(geometry)
            same = all(torch.equal(g.view(torch.int16), w.view(torch.int16))
                       for g, w in zip(loaded(), want))
            record("load", n_rows, geometry, time_fn(lambda: load(geometry), reps=10), same)
        del want

        # Capture: the slots just loaded into pool rows elsewhere (as the
        # benchmark's index_copy_ capture above).
        dst_rows = (torch.arange(n_rows, device=dev) + 5 * (n_rows // 4)) % POOL_ROWS

        def capture(geometry):
            fused_capture(group, slots, dst_rows, geometry=geometry)

        def captured():
            return [p[dst_rows] for p in pool_k + pool_v]

        capture(DEFAULT_CAPTURE_GEOMETRY)
        want = captured()
        # The default against the cache itself (vLLM's layout, indexed by torch).
        exact = all(
            torch.equal(want[i].view(torch.int16), c[blocks, 0, offsets].view(torch.int16))
            and torch.equal(want[len(caches) + i].view(torch.int16),
                            c[blocks, 1, offsets].view(torch.int16))
            for i, c in enumerate(caches))
        for geometry in geometries["capture"]:
            for p in pool_k + pool_v:
                p.index_fill_(0, dst_rows, float("nan"))
            capture(geometry)
            same = exact and all(torch.equal(g.view(torch.int16), w.view(torch.int16))
                                 for g, w in zip(captured(), want))
            record("capture", n_rows, geometry, time_fn(lambda: capture(geometry), reps=10), same)
        del want

    print(f"sweep: {time.monotonic() - started:.0f} s")
    for kernel in ("load", "capture"):
        # Best: the highest mean % over the row counts, among the geometries
        # that wrote the default's bytes at every one.
        scores = {}
        for k, n, g, t, same in rows:
            if k == kernel:
                scores.setdefault(g, []).append(100 * useful[n] / t / bw if same else None)
        passing = {g: sum(v) / len(v) for g, v in scores.items() if None not in v}
        best = max(passing, key=passing.get) if passing else None
        default = passing.get(defaults[kernel])
        print(f"best {kernel} geometry: {best} at {passing.get(best, 0):.1f}% of copy "
              f"(mean over {', '.join(map(str, row_counts))} rows; default: "
              f"{'%.1f%%' % default if default is not None else 'failed'})")
    return all(r[4] for r in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sweep", choices=("off", "quick", "full"), default="off",
                        help="time the fused kernels under several launch geometries")
    parser.add_argument("--sweep-only", action="store_true",
                        help="skip the per-layer / fused / capture rows above the sweep")
    args = parser.parse_args(argv)
    if args.sweep_only and args.sweep == "off":
        parser.error("--sweep-only needs --sweep quick or full")

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
    for n_rows in () if args.sweep_only else (1024, 4096, 16384, 65536):
        # As the worker: one cos/sin row per stretch (formed on the host from
        # the stretches' deltas, sent once per step), each row's stretch index.
        src, dst, deltas, stretch_index, host_deltas = step_rows(n_rows)
        seg = n_rows // 4
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
    if args.sweep_only:
        return 0 if sweep(args.sweep, group, caches, pool_k, pool_v, rotation, bw) else 1
    print(f"{'path':8} {'rows':>6} {'ms/step(32 layers)':>19} {'useful TB/s':>12} "
          f"{'% of copy':>9} {'K rel.err':>10} {'V/rows exact':>12}")
    for kind, n, t, rate, err, exact in results:
        print(f"{kind:8} {n:6d} {t * 1e3:19.3f} {rate / 1e12:12.3f} {100 * rate / bw:9.1f} "
              f"{err:10.2e} {str(exact):>12}")
    bad = [r for r in results if not r[5] or r[4] > 1e-2]
    print("no host sync in the per-layer loops (set_sync_debug_mode=error): OK")
    if args.sweep != "off" and not sweep(args.sweep, group, caches, pool_k, pool_v, rotation,
                                         bw):
        bad.append("sweep")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
