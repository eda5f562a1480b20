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

import torch

from common import bench_remap, best_of
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.renderers.chunk_prompt_parser import ChunkedPromptParser
from vllm.v1.core.chunk_hash_index import compute_chunk_hash
from vllm.v1.core.chunk_structures import ChunkNamespace

PROMPT_TOKENS = 128 * 1024
SEGMENT_TOKENS = 2048


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
