# SPDX-License-Identifier: Apache-2.0
"""Micro-benchmarks of the chunk-cache core modules (not a test).

Prints: parser throughput on a 128K-token prompt (token level and string
level), content hashing tokens/s, and the remap (gather + RoPE delta +
write) throughput as a ratio to a plain tensor copy of the same bytes.

    python benchmarks/bench_core.py [--device cpu|cuda] [--dtype bfloat16]
        [--heads 3 --head-size 64 --rows 3200] [--repeat 20] [--remap-only]
"""

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.renderers.chunk_prompt_parser import ChunkedPromptParser
from vllm.v1.core.chunk_hash_index import ChunkNamespace, compute_chunk_hash
from vllm.v1.worker.position_remapper import PositionRemapper, RemapRows, RopeRotation

PROMPT_TOKENS = 128 * 1024
SEGMENT_TOKENS = 2048


def best_of(fn: Callable[[], object], repeat: int = 5, sync=lambda: None) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return min(times)


class ByteTokenizer:
    """Byte-level toy tokenizer: one token per UTF-8 byte, BOS = 256."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [256, *ids] if add_special_tokens else ids


def bench_parser() -> None:
    num_segments = PROMPT_TOKENS // SEGMENT_TOKENS
    parser = ChunkedPromptParser("##", max_chunks=500, max_chunk_tokens=4096)
    sep_ids = [300, 301]
    gen = torch.Generator().manual_seed(0)
    body = torch.randint(0, 256, (num_segments, SEGMENT_TOKENS), generator=gen)
    token_ids: list[int] = []
    for i, seg in enumerate(body.tolist()):
        token_ids += (sep_ids if i else []) + seg
    seconds = best_of(lambda: parser.parse_token_ids(token_ids, sep_ids))
    print(f"parser (token ids, list input): {len(token_ids)} tokens, "
          f"{num_segments} segments: {seconds * 1e3:.2f} ms "
          f"= {len(token_ids) / seconds / 1e6:.1f} M tokens/s")
    as_tensor = torch.tensor(token_ids)
    seconds = best_of(lambda: parser.parse_token_ids(as_tensor, sep_ids))
    print(f"parser (token ids, tensor input): {seconds * 1e3:.2f} ms "
          f"= {len(token_ids) / seconds / 1e6:.1f} M tokens/s")

    text = "##".join("x" * SEGMENT_TOKENS for _ in range(num_segments))
    tokenizer = ByteTokenizer()
    seconds = best_of(lambda: parser.parse_text(text, tokenizer))
    print(f"parser (string, byte tokenizer): {len(text)} chars: "
          f"{seconds * 1e3:.2f} ms = {PROMPT_TOKENS / seconds / 1e6:.1f} M tokens/s "
          "(tokenizer time included)")


def bench_hash() -> None:
    digest = ChunkNamespace("model", "bfloat16", "tok").digest()
    segments = torch.randint(0, 150000, (PROMPT_TOKENS // SEGMENT_TOKENS,
                                         SEGMENT_TOKENS)).tolist()
    context = [1]

    def run():
        for seg in segments:
            compute_chunk_hash(seg, context, digest)

    seconds = best_of(run)
    print(f"hashing (xxh3-128, list[int] input, {SEGMENT_TOKENS}-token segments):"
          f" {PROMPT_TOKENS / seconds / 1e6:.1f} M tokens/s")


@dataclass(frozen=True)
class RemapTiming:
    """Best-of seconds for one layer's rows, and the bytes moved (K+V)."""

    plain_copy: float
    gather_write: float
    remap: float
    nbytes: int
    # The same remap with the CPU fast path turned off (the generic,
    # device-independent rotation; the same path as `remap` off the CPU).
    remap_generic: float = 0.0

    def line(self, seconds: float) -> str:
        return (f"{seconds * 1e3:8.2f} ms ({self.nbytes / seconds / 1e9:5.1f} GB/s) "
                f"= {seconds / self.plain_copy:.2f}x copy "
                f"({self.plain_copy / seconds:.0%} of copy throughput)")


def bench_remap(device: str, dtype: torch.dtype, heads: int = 8, head_size: int = 128,
                rows: int = 16384, repeat: int = 5) -> RemapTiming:
    rope = get_rope(head_size, 32768, True, {"rope_type": "default"}, torch.float32)
    pool_k = torch.randn(rows, heads, head_size, device=device).to(dtype)
    pool_v = torch.randn_like(pool_k)
    paged_k = torch.zeros_like(pool_k)
    paged_v = torch.zeros_like(pool_v)

    def write_rows(layer_name, key, value, slot_mapping):
        paged_k.index_copy_(0, slot_mapping, key)
        paged_v.index_copy_(0, slot_mapping, value)

    perm = torch.randperm(rows, device=device)
    # 8 segments of rows // 8 rows, one delta each (as a load plan has).
    segment = max(rows // 8, 1)
    deltas = (torch.arange(rows) // segment * segment + 5).to(device)
    remap_rows = RemapRows(src_rows=perm, dst_slots=torch.arange(rows, device=device),
                           deltas=deltas)
    remapper = PositionRemapper(RopeRotation(rope), write_rows)
    generic = PositionRemapper(RopeRotation(rope, use_cpu_kernel=False), write_rows)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    remap = best_of(lambda: remapper.remap_layer("l", pool_k, pool_v, remap_rows),
                    repeat, sync=sync)
    remap_generic = best_of(
        lambda: generic.remap_layer("l", pool_k, pool_v, remap_rows), repeat, sync=sync)
    # NOTE: the plain copy reads and writes the same bytes as the remap: K and V
    # rows from one tensor into another (the remap also writes them once).
    plain = best_of(lambda: (paged_k.copy_(pool_k), paged_v.copy_(pool_v)), repeat,
                    sync=sync)
    copy_only = PositionRemapper(None, write_rows)
    gather = best_of(lambda: copy_only.remap_layer("l", pool_k, pool_v, remap_rows),
                     repeat, sync=sync)
    # Our part alone: gather + rotation, the write left out (in the engine it
    # is the backend's own op, outside the remapper).
    no_write = PositionRemapper(remapper.rotation, lambda *args: None)
    gather_rope = best_of(lambda: no_write.remap_layer("l", pool_k, pool_v, remap_rows),
                          repeat, sync=sync)
    timing = RemapTiming(plain, gather, remap, 2 * pool_k.numel() * pool_k.element_size(),
                         remap_generic)
    print(f"remap ({device}, {dtype}, {rows} rows x {heads} heads x {head_size}, "
          f"{timing.nbytes / 2**20:.0f} MiB K+V per layer):")
    print(f"  plain copy          {timing.line(plain)}")
    print(f"  gather+write        {timing.line(gather)}")
    print(f"  gather+rope         {timing.line(gather_rope)}  (no write)")
    if remapper.rotation.rotates_in_place(pool_k.device):
        print(f"  gather+rope+write   {timing.line(remap_generic)}  (generic rotation)")
    print(f"  gather+rope+write   {timing.line(remap)}"
          + ("  (CPU in-place kernel)" if remapper.rotation.rotates_in_place(pool_k.device)
             else ""))
    return timing


def main() -> None:
    arg_parser = argparse.ArgumentParser(description=__doc__)
    arg_parser.add_argument("--device", default="cpu")
    arg_parser.add_argument("--dtype", default="bfloat16")
    arg_parser.add_argument("--heads", type=int, default=8)
    arg_parser.add_argument("--head-size", type=int, default=128)
    arg_parser.add_argument("--rows", type=int, default=16384)
    arg_parser.add_argument("--repeat", type=int, default=5,
                            help="best of N timings per line (more on a shared machine)")
    arg_parser.add_argument("--remap-only", action="store_true")
    args = arg_parser.parse_args()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    if not args.remap_only:
        bench_parser()
        bench_hash()
    with set_current_vllm_config(VllmConfig()):
        bench_remap(args.device, getattr(torch, args.dtype), args.heads, args.head_size,
                    args.rows, args.repeat)


if __name__ == "__main__":
    main()
