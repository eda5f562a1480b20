"""The chunk cache's MLA data path, run on HF transformers' latent KV cache.

The engine runs the chunk cache's MLA data path only where vLLM has MLA on the CPU
(0.32's CPU_MLA: the DeepSeek rows of test_chunk_cache_exactness.py). Its argument runs
here on both bases, on HF's DeepSeek-V3, which caches exactly MLA's latent row (`kv_c`
after its RMSNorm, and `k_pe` after RoPE, one head for all query heads). This module

* computes each chunk the way a child request would (its private context, then the
  chunk, at positions 0..) and keeps the chunk's latent rows: the pool entry;
* assembles a request's cache from the system segment's rows and each chunk's entry with
  `kv_c` copied and `k_pe` rotated by the delta through the fork's own
  `reposition_latent_rows` with vLLM's own rope object (DeepSeek's YaRN, mscale
  included);
* runs the question and generated tokens over that cache.

docs/design/mla.md says why the result must equal the isolation-mask reference
(chunk_reference.Reference.next_token_logprobs); tests/e2e/test_mla_reference.py checks
it.

Layout note: HF rotates interleaved pairs but stores `k_pe` de-interleaved
([evens | odds]); vLLM stores the interleaved order (GPT-J style). Rows are converted to
vLLM's layout for the rotation and back.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from vllm.v1.core.chunk_structures import ChunkedPrompt
from vllm.v1.worker.mla_latent import LatentRowLayout, reposition_latent_rows
from vllm.v1.worker.position_remapper import RopeRotation

# (k_pe rows [n, rope_dim] in vLLM's layout, deltas [n]) -> moved k_pe rows.
MoveKPe = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def vllm_rope_for(hf_config):
    """The rope vLLM's DeepseekV2/V3 attention builds for this config (deepseek_v2.py:
    `get_rope(qk_rope_head_dim, ..., is_neox_style=False)`, YaRN renamed deepseek_yarn).
    Needs a current vLLM config (CustomOp)."""
    from vllm.model_executor.layers.rotary_embedding import get_rope

    params = copy.deepcopy(hf_config.rope_parameters)
    if params["rope_type"] != "default":
        params["rope_type"] = "deepseek_yarn"
    return get_rope(
        hf_config.qk_rope_head_dim,
        max_position=hf_config.max_position_embeddings,
        rope_parameters=params,
        is_neox_style=False,
    )


def to_vllm_layout(k_pe: torch.Tensor) -> torch.Tensor:
    half = k_pe.shape[-1] // 2
    return torch.stack((k_pe[..., :half], k_pe[..., half:]), dim=-1).flatten(-2)


def to_hf_layout(k_pe: torch.Tensor) -> torch.Tensor:
    return torch.cat((k_pe[..., 0::2], k_pe[..., 1::2]), dim=-1)


class LatentCacheEmulation:
    """One pool of chunk entries (latent rows per layer) over an HF DeepSeek model."""

    def __init__(self, model, rotation: RopeRotation):
        from transformers import DynamicCache

        self._cache_cls = DynamicCache
        self.model = model
        config = model.config
        self.layout = LatentRowLayout(config.kv_lora_rank, config.qk_rope_head_dim)
        self.rotation = rotation
        # (context ids, chunk ids) -> per layer latent rows [n, width] (HF layout).
        self.pool: dict[
            tuple[tuple[int, ...], tuple[int, ...]], list[torch.Tensor]
        ] = {}
        self.computed_chunks = 0

    @torch.no_grad()
    def _latents(self, ids: list[int], positions: list[int], cache=None):
        cache = (
            cache if cache is not None else self._cache_cls(config=self.model.config)
        )
        out = self.model(
            input_ids=torch.tensor([ids]),
            position_ids=torch.tensor([positions]),
            past_key_values=cache,
            use_cache=True,
        )
        return cache, out

    def entry(self, context: list[int], chunk: list[int]) -> list[torch.Tensor]:
        """The chunk's latent rows as its child request computes them: context then
        chunk at positions 0.. (stored_start = len(context)); computed once, then
        reused."""
        key = (tuple(context), tuple(chunk))
        if key not in self.pool:
            cache, _ = self._latents(
                context + chunk, list(range(len(context) + len(chunk)))
            )
            self.pool[key] = [
                torch.cat((layer.keys, layer.values), -1)[0, 0, len(context) :]
                for layer in cache.layers
            ]
            self.computed_chunks += 1
        return self.pool[key]

    def default_move(self, k_pe: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
        rows = torch.cat(
            (torch.zeros(k_pe.shape[0], self.layout.kv_lora_rank), k_pe), -1
        )
        return reposition_latent_rows(self.layout, self.rotation, rows, deltas)[1]

    @torch.no_grad()
    def logprobs(
        self,
        prompt: ChunkedPrompt,
        context_of: Callable[[ChunkedPrompt], list[int]],
        generated: list[int],
        move: MoveKPe | None = None,
    ) -> torch.Tensor:
        """[len(generated) + 1, vocab] float64 log-probabilities, rows as the
        reference's."""
        move = move or self.default_move
        spans = prompt.spans
        ids = prompt.token_ids
        system = ids[spans[0].start : spans[0].end]
        system_cache, _ = self._latents(system, list(range(len(system))))
        rows = [
            [torch.cat((layer.keys, layer.values), -1)[0, 0]]
            for layer in system_cache.layers
        ]
        context = context_of(prompt)
        for span in spans[1:-1]:
            entry = self.entry(context, ids[span.start : span.end])
            deltas = torch.full((span.end - span.start,), span.start - len(context))
            for layer, stored in zip(rows, entry):
                kv_c, k_pe = self.layout.split(stored)
                moved = to_hf_layout(move(to_vllm_layout(k_pe), deltas))
                layer.append(torch.cat((kv_c, moved), -1))
        cache = self._cache_cls(config=self.model.config)
        for i, parts in enumerate(rows):
            latent = torch.cat(parts)[None, None]
            kv_c, k_pe = self.layout.split(latent)
            cache.update(kv_c.contiguous(), k_pe.contiguous(), i)
        tail = ids[spans[-1].start :] + list(generated)
        start = spans[-1].start
        _, out = self._latents(tail, list(range(start, start + len(tail))), cache)
        logits = out.logits[0, -(len(generated) + 1) :].double()
        return torch.log_softmax(logits, dim=-1)
