"""A pure-torch DeepSeek-V3.2 (MLA + the DSA lightning indexer), and the chunk cache's
sparse data path run on its rows.

No CPU backend of vLLM runs sparse attention (vLLM 0.32's CpuPlatform: "Sparse Attention
is not supported on CPU"; 0.23 has no MLA on the CPU), so the sparse argument runs here,
on a forward written from the weights in vLLM's layouts, whose per-token rows are
exactly what a sparse-MLA cache holds per layer:

* `kv_c` (kv_lora_rank, RMS-normed, no position) and `k_pe` (GPT-J interleaved, rotated
  at the token's position with vLLM's own DeepSeek YaRN rope object): MLA's latent row;
* `index_k` (index_head_dim): the indexer key `LayerNorm(wk h)` with its first
  qk_rope_head_dim values rotated by vLLM's own indexer rope (neox: `indexer_rope_emb`).

Each query scores the keys it may see with the indexer (`sum_h w_h relu(q_h . k) /
sqrt(d)`, `w = weights_proj(h) / sqrt(heads)`: vLLM's `Indexer` and HF's
`DeepseekV32Indexer`), keeps the top `index_topk`, and attends (MLA, keys expanded per
head) to those only. The forward surfaces each layer's selection, so a test compares
selected token sets, not only logits. tests/e2e/test_sparse_reference.py checks it
against HF transformers' DeepseekV32 (its logits, and its indexer's own top-k through a
forward hook), causal and under the 4D isolation mask.

`SparseCacheEmulation` then runs the chunk cache's data path on those rows: each chunk
computed as its child request would be (its private context, then the chunk, at 0..),
its rows kept as the entry; a request assembles its cache from the system segment's rows
and each chunk's entry with `kv_c` copied, `k_pe` moved by `reposition_latent_rows` and
`index_k` by `reposition_indexer_keys` (the fork's code, vLLM's rope objects); the
question and generated tokens select and attend over that assembled cache.

NOTE: HF's `q_a_layernorm`/`kv_a_layernorm` use RMSNorm's default eps (1e-6), vLLM's use
`rms_norm_eps` (1e-5 in the tiny model, 1e-6 in DeepSeek's checkpoints); this follows
HF.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from vllm.v1.core.chunk_structures import ChunkedPrompt
from vllm.v1.worker.indexer_keys import IndexerKeyLayout, reposition_indexer_keys
from vllm.v1.worker.mla_latent import LatentRowLayout, reposition_latent_rows
from vllm.v1.worker.position_remapper import RopeRotation

from tests.chunk_isolation_mask import build_isolated_sequence


@dataclass
class LayerRows:
    """One layer's cache rows for n tokens, in vLLM's layouts."""

    kv_c: torch.Tensor  # [n, kv_lora_rank]
    k_pe: torch.Tensor  # [n, qk_rope_head_dim], GPT-J interleaved, rotated
    index_k: torch.Tensor  # [n, index_head_dim], first qk_rope_head_dim rotated (neox)

    @staticmethod
    def cat(parts: list[LayerRows]) -> LayerRows:
        return LayerRows(
            *(
                torch.cat([getattr(p, f) for p in parts])
                for f in ("kv_c", "k_pe", "index_k")
            )
        )

    def rows(self, start: int, end: int | None = None) -> LayerRows:
        return LayerRows(
            self.kv_c[start:end], self.k_pe[start:end], self.index_k[start:end]
        )


@dataclass
class Forward:
    logits: torch.Tensor  # [S, vocab] float32
    rows: list[LayerRows]  # per layer, the S new tokens' rows
    selected: list[torch.Tensor]  # per layer [S, P + S] bool: selected and visible


def vllm_ropes(config: dict):
    """(MLA rope, indexer rope) as vLLM's DeepseekV2Attention builds them for V3.2
    (deepseek_v2.py: `get_rope(qk_rope_head_dim, ..., is_neox_style=False)` and
    `indexer_rope_emb`, neox unless `indexer_rope_interleave`; YaRN renamed
    deepseek_yarn). Needs a current vLLM config (CustomOp)."""
    from vllm.model_executor.layers.rotary_embedding import get_rope

    params = copy.deepcopy(config["rope_parameters"])
    if params["rope_type"] != "default":
        params["rope_type"] = "deepseek_yarn"
    build = lambda neox: get_rope(
        config["qk_rope_head_dim"],  # noqa: E731
        max_position=config["max_position_embeddings"],
        rope_parameters=copy.deepcopy(params),
        is_neox_style=neox,
    )
    return build(False), build(not config.get("indexer_rope_interleave", False))


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def fp8_ue8m0_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """X [..., 128] as vLLM's CUDA indexer caches and scores it, dequantized: one scale
    per 128 values, max(amax, 1e-4) / 448 rounded up to a power of two ("ue8m0"), values
    as float8_e4m3fn (`indexer_k_quant_and_cache`,
    csrc/libtorch_stable/cache_kernels.cu; the query's `per_token_group_quant_fp8(...,
    128, use_ue8m0=True)` the same but for its epsilon). Written from the kernel's
    source: a reference of its arithmetic, not the op."""
    groups = x.float().unflatten(-1, (-1, 128))
    scale = groups.abs().amax(-1, keepdim=True).clamp(min=1e-4) / 448.0
    scale = torch.exp2(torch.ceil(torch.log2(scale)))
    return ((groups / scale).to(torch.float8_e4m3fn).float() * scale).flatten(-2)


class SparseDeepseek:
    """The tiny DeepSeek-V3.2's forward from its safetensors, float32.

    `index_quant`: what the indexer's keys and queries go through before scoring (None:
    unquantized, HF's definition; `fp8_ue8m0_roundtrip`: vLLM's CUDA fp8 indexer)."""

    index_quant: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __init__(self, model_dir: str | Path, mla_rope, indexer_rope):
        from safetensors.torch import load_file

        model_dir = Path(model_dir)
        self.config = json.loads((model_dir / "config.json").read_text())
        self.w = load_file(str(model_dir / "model.safetensors"))
        self.mla_rope, self.indexer_rope = mla_rope, indexer_rope
        c = self.config
        self.rank, self.rope_dim = c["kv_lora_rank"], c["qk_rope_head_dim"]
        self.nope, self.v_dim = c["qk_nope_head_dim"], c["v_head_dim"]
        self.heads = c["num_attention_heads"]
        self.index_heads, self.index_dim = c["index_n_heads"], c["index_head_dim"]
        self.topk = c["index_topk"]
        scale = (self.nope + self.rope_dim) ** -0.5
        rp = c["rope_parameters"]
        if rp.get("rope_type", "default") != "default" and rp.get("mscale_all_dim"):
            scale *= _yarn_mscale(rp["factor"], rp["mscale_all_dim"]) ** 2
        self.scale = scale
        self.latent = LatentRowLayout(self.rank, self.rope_dim)
        self.index_layout = IndexerKeyLayout(self.index_dim, self.rope_dim)

    def _p(self, name: str) -> torch.Tensor:
        return self.w[name]

    def _rope(self, rope, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """X [n, heads, rope_dim] rotated at `positions` by vLLM's rope object."""
        _, out = rope.forward_native(positions, torch.zeros_like(x), x.clone())
        return out

    def rows_of(self, i: int, h: torch.Tensor, positions: torch.Tensor) -> LayerRows:
        """Layer i's cache rows of hidden states h (after input_layernorm)."""
        p = f"model.layers.{i}.self_attn."
        kv = h @ self._p(p + "kv_a_proj_with_mqa.weight").T
        kv_c = _rms(kv[:, : self.rank], self._p(p + "kv_a_layernorm.weight"), 1e-6)
        k_pe = self._rope(self.mla_rope, positions, kv[:, None, self.rank :])[:, 0]
        k = F.layer_norm(
            h @ self._p(p + "indexer.wk.weight").T,
            (self.index_dim,),
            self._p(p + "indexer.k_norm.weight"),
            self._p(p + "indexer.k_norm.bias"),
            1e-6,
        )
        k_rot = self._rope(self.indexer_rope, positions, k[:, None, : self.rope_dim])[
            :, 0
        ]
        return LayerRows(kv_c, k_pe, torch.cat((k_rot, k[:, self.rope_dim :]), -1))

    def select(
        self,
        i: int,
        h: torch.Tensor,
        q_resid: torch.Tensor,
        positions: torch.Tensor,
        keys: torch.Tensor,
        allowed: torch.Tensor,
    ) -> torch.Tensor:
        """[S, T] bool: the top-k of the visible keys each query selects."""
        p = f"model.layers.{i}.self_attn.indexer."
        s = h.shape[0]
        q = (q_resid @ self._p(p + "wq_b.weight").T).view(
            s, self.index_heads, self.index_dim
        )
        q = torch.cat(
            (
                self._rope(self.indexer_rope, positions, q[..., : self.rope_dim]),
                q[..., self.rope_dim :],
            ),
            -1,
        )
        if self.index_quant is not None:
            # NOTE: the cache holds keys quantized when written; quantizing every key at
            # use is the same values (per-key scales), for fresh and loaded keys alike.
            q, keys = self.index_quant(q), self.index_quant(keys)
        scores = F.relu(torch.einsum("shd,td->sht", q, keys)) * self.index_dim**-0.5
        weights = (h @ self._p(p + "weights_proj.weight").T) * self.index_heads**-0.5
        index = torch.einsum("sh,sht->st", weights, scores)
        index = index.masked_fill(~allowed, float("-inf"))
        k = min(self.topk, index.shape[-1])
        chosen = torch.zeros_like(allowed).scatter(
            -1, index.topk(k, dim=-1).indices, True
        )
        return chosen & allowed

    def attention(
        self,
        i: int,
        h: torch.Tensor,
        positions: torch.Tensor,
        past: LayerRows | None,
        allowed: torch.Tensor,
    ) -> tuple[torch.Tensor, LayerRows, torch.Tensor]:
        p = f"model.layers.{i}.self_attn."
        s = h.shape[0]
        new = self.rows_of(i, h, positions)
        rows = LayerRows.cat([past, new]) if past is not None else new
        q_resid = _rms(
            h @ self._p(p + "q_a_proj.weight").T,
            self._p(p + "q_a_layernorm.weight"),
            1e-6,
        )
        q = (q_resid @ self._p(p + "q_b_proj.weight").T).view(s, self.heads, -1)
        q_nope = q[..., : self.nope]
        q_pe = self._rope(self.mla_rope, positions, q[..., self.nope :])
        selected = self.select(i, h, q_resid, positions, rows.index_k, allowed)
        kv = (rows.kv_c @ self._p(p + "kv_b_proj.weight").T).view(
            -1, self.heads, self.nope + self.v_dim
        )
        k_nope, v = kv[..., : self.nope], kv[..., self.nope :]
        logits = (
            torch.einsum("shd,thd->hst", q_nope, k_nope)
            + torch.einsum("shd,td->hst", q_pe, rows.k_pe)
        ) * self.scale
        logits = logits.masked_fill(~selected[None], float("-inf"))
        out = torch.einsum("hst,thd->shd", logits.softmax(-1), v).reshape(s, -1)
        return out @ self._p(p + "o_proj.weight").T, new, selected

    def _mlp(self, prefix: str, x: torch.Tensor) -> torch.Tensor:
        gate = x @ self._p(prefix + "gate_proj.weight").T
        up = x @ self._p(prefix + "up_proj.weight").T
        return (F.silu(gate) * up) @ self._p(prefix + "down_proj.weight").T

    def _moe(self, i: int, x: torch.Tensor) -> torch.Tensor:
        p = f"model.layers.{i}.mlp."
        c = self.config
        scores = (x @ self._p(p + "gate.weight").T).sigmoid()
        # NOTE: one expert group (n_group 1): the group choice selects every expert.
        assert c["n_group"] == 1
        choice = (
            (scores + self._p(p + "gate.e_score_correction_bias"))
            .topk(c["num_experts_per_tok"], dim=-1)
            .indices
        )
        weights = scores.gather(1, choice)
        if c["norm_topk_prob"]:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        weights = weights * c["routed_scaling_factor"]
        out = self._mlp(p + "shared_experts.", x)
        for e in range(c["n_routed_experts"]):
            rows, slot = torch.where(choice == e)
            if rows.numel():
                out = out.index_add(
                    0,
                    rows,
                    self._mlp(f"{p}experts.{e}.", x[rows]) * weights[rows, slot, None],
                )
        return out

    @torch.no_grad()
    def forward(
        self,
        ids: list[int],
        positions: list[int] | torch.Tensor,
        allowed: torch.Tensor | None = None,
        past: list[LayerRows] | None = None,
    ) -> Forward:
        """`ids` at `positions` after `past` rows (per layer, P tokens); `allowed` [S, P
        + S] (None: every past row and causal among the new tokens)."""
        s = len(ids)
        n_past = 0 if past is None else past[0].kv_c.shape[0]
        positions = torch.as_tensor(positions, dtype=torch.int64)
        if allowed is None:
            allowed = torch.cat(
                (
                    torch.ones(s, n_past, dtype=torch.bool),
                    torch.ones(s, s, dtype=torch.bool).tril(),
                ),
                -1,
            )
        x = self._p("model.embed_tokens.weight")[torch.tensor(ids)]
        eps = self.config["rms_norm_eps"]
        rows, selected = [], []
        for i in range(self.config["num_hidden_layers"]):
            p = f"model.layers.{i}."
            h = _rms(x, self._p(p + "input_layernorm.weight"), eps)
            out, new, sel = self.attention(
                i, h, positions, None if past is None else past[i], allowed
            )
            rows.append(new)
            selected.append(sel)
            x = x + out
            h = _rms(x, self._p(p + "post_attention_layernorm.weight"), eps)
            dense = i < self.config["first_k_dense_replace"]
            x = x + (self._mlp(p + "mlp.", h) if dense else self._moe(i, h))
        x = _rms(x, self._p("model.norm.weight"), eps)
        return Forward(x @ self._p("lm_head.weight").T, rows, selected)


@dataclass
class Tail:
    """The question (and generated tokens) of one request: log-probabilities of their
    last len(generated) + 1 rows, and each layer's selection over the final sequence."""

    logprobs: torch.Tensor  # [len(generated) + 1, vocab] float64
    selected: list[torch.Tensor]  # per layer [len(tail), len(final sequence)] bool


def isolation_reference(
    model: SparseDeepseek,
    prompt: ChunkedPrompt,
    mode: str,
    generated: list[int],
    sink: int | None,
) -> Tail:
    """The definition: one forward over the extended sequence under the 4D isolation
    mask (chunk_isolation_mask), the tail's selections mapped to final-sequence
    columns."""
    seq = build_isolated_sequence(
        prompt, mode, extra_token_ids=generated, sink_token_id=sink
    )
    out = model.forward(seq.token_ids, seq.position_ids, allowed=seq.allowed[0, 0])
    tail = len(prompt.token_ids) - prompt.spans[-1].start + len(generated)
    real = seq.real_rows
    for sel in out.selected:
        # The question sees no private copy: nothing selected off the final sequence.
        private = torch.ones(sel.shape[-1], dtype=torch.bool)
        private[real] = False
        assert not sel[-tail:, private].any()
    logits = out.logits[-(len(generated) + 1) :].double()
    return Tail(
        torch.log_softmax(logits, -1), [sel[-tail:][:, real] for sel in out.selected]
    )


# (rows of one layer for a chunk's entry, deltas [n]) -> the rows written at the real
# positions.
MoveRows = Callable[[LayerRows, torch.Tensor], LayerRows]


class SparseCacheEmulation:
    """One pool of chunk entries (per layer latent and indexer key rows) over the
    model."""

    def __init__(
        self,
        model: SparseDeepseek,
        mla_rotation: RopeRotation,
        indexer_rotation: RopeRotation,
    ):
        self.model = model
        self.mla_rotation, self.indexer_rotation = mla_rotation, indexer_rotation
        self.pool: dict[tuple[tuple[int, ...], tuple[int, ...]], list[LayerRows]] = {}
        self.computed_chunks = 0

    def entry(self, context: list[int], chunk: list[int]) -> list[LayerRows]:
        """The chunk's rows as its child computes them (context then chunk at 0..;
        stored_start = len(context)): computed once, then reused."""
        key = (tuple(context), tuple(chunk))
        if key not in self.pool:
            ids = context + chunk
            out = self.model.forward(ids, list(range(len(ids))))
            self.pool[key] = [rows.rows(len(context)) for rows in out.rows]
            self.computed_chunks += 1
        return self.pool[key]

    def move(self, rows: LayerRows, deltas: torch.Tensor) -> LayerRows:
        """The load: kv_c copied, k_pe and the indexer key's rope slice rotated."""
        latent = torch.cat((rows.kv_c, rows.k_pe), -1)
        kv_c, k_pe = reposition_latent_rows(
            self.model.latent, self.mla_rotation, latent, deltas
        )
        index_k = reposition_indexer_keys(
            self.model.index_layout, self.indexer_rotation, rows.index_k, deltas
        )
        return LayerRows(kv_c, k_pe, index_k)

    def run(
        self,
        prompt: ChunkedPrompt,
        context_of: Callable[[ChunkedPrompt], list[int]],
        generated: list[int],
        move: MoveRows | None = None,
    ) -> Tail:
        move = move or self.move
        spans, ids = prompt.spans, prompt.token_ids
        system = ids[spans[0].start : spans[0].end]
        parts = [
            [rows] for rows in self.model.forward(system, list(range(len(system)))).rows
        ]
        context = context_of(prompt)
        for span in spans[1:-1]:
            entry = self.entry(context, ids[span.start : span.end])
            deltas = torch.full((span.end - span.start,), span.start - len(context))
            for layer, stored in zip(parts, entry):
                layer.append(move(stored, deltas))
        past = [LayerRows.cat(p) for p in parts]
        tail = ids[spans[-1].start :] + list(generated)
        start = spans[-1].start
        out = self.model.forward(tail, list(range(start, start + len(tail))), past=past)
        logits = out.logits[-(len(generated) + 1) :].double()
        return Tail(torch.log_softmax(logits, -1), out.selected)
