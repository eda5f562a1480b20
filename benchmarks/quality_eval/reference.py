# SPDX-License-Identifier: Apache-2.0
"""Quality under the HF reference: one transformers forward per (question,
configuration) over an extended sequence with its 4D mask.

The engine equals this reference for the modes (the e2e suite's invariant), so the
mode numbers here are what the engine would give (boundary recompute is built in
the engine too, `--chunk-recompute-tokens`; the other levers exist only here).
Scores: the gold continuation's log-likelihood (teacher forcing) and exact match,
which under greedy decoding is: every gold token is the argmax after the previous
ones, and the argmax after the last does not continue the word.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tests.chunk_isolation_mask import IsolatedSequence, build_isolated_sequence
from vllm.v1.core.chunk_structures import ChunkedPrompt

from .levers import (
    build_lever_sequence,
    context_scale_bias,
    first_k,
    question_aware,
    question_chunks,
    top_fraction,
)
from .prompts import EncodedQuestion, ends_word

# The layer whose KV deviation selects CacheBlend's tokens. Layer 0's K/V depend
# only on the token and its position, so they never deviate; layer 1 is the first
# that does and the cheapest to obtain in an engine (one layer over all tokens),
# the choice CacheBlend makes.
SELECTION_LAYER = 1


@dataclass(frozen=True)
class Score:
    gold_logprob: float  # sum over the gold tokens
    exact: bool
    recomputed: int      # chunk tokens recomputed (0 for the plain modes)
    chunk_tokens: int


@dataclass(frozen=True)
class LeverGrid:
    modes: tuple[str, ...] = ("sink", "none")
    boundary_k: tuple[int, ...] = (4, 8, 16)
    fractions: tuple[float, ...] = (0.1, 0.25)
    # APE's context scaling factors (nothing recomputed).
    scales: tuple[float, ...] = ()
    # Question-aware recompute (issue 33): fractions r of chunk tokens ranked by the
    # question's attention, each with every `question_first` (first tokens of each
    # chunk forced into the budget; 0 = attention alone).
    question_fractions: tuple[float, ...] = ()
    question_first: tuple[int, ...] = (0,)
    # Question-aware boundary recompute: fractions spent on the first tokens of the
    # chunks the question attends to most (`question_chunks`).
    question_chunk_fractions: tuple[float, ...] = ()


class ReferenceScorer:
    def __init__(self, model_dir: str, sink_token_id: int, batch: int = 6):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        # SDPA takes the same additive 4D mask as eager and is faster on CPU
        # (max |logit diff| vs eager ~7e-5 in float32 on this model).
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
        self.sink_token_id = sink_token_id
        # Most sequences per forward (memory: ~T^2 mask entries per sequence).
        self.batch = batch
        self._kv: dict[str, torch.Tensor] = {}
        attn = self.model.model.layers[SELECTION_LAYER].self_attn
        attn.k_proj.register_forward_hook(lambda m, i, o: self._kv.__setitem__("k", o))
        attn.v_proj.register_forward_hook(lambda m, i, o: self._kv.__setitem__("v", o))

    @torch.inference_mode()
    def _forward(self, seqs: list[IsolatedSequence], n_tail: int,
                 biases: list[torch.Tensor] | None = None
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per sequence: log-probs of its last n_tail rows, and layer-1 [k|v] of its
        real rows. One padded batch: on 2 shared cores a batch of 5 ran ~2x faster
        per sequence than one at a time. `biases`: an additive [T, T] logit bias per
        sequence on its allowed entries (APE's scaling)."""
        size = max(len(s.token_ids) for s in seqs)
        ids = torch.zeros(len(seqs), size, dtype=torch.int64)
        pos = torch.zeros(len(seqs), size, dtype=torch.int64)
        # Padding rows see only themselves; no real row sees padding.
        allowed = torch.eye(size, dtype=torch.bool).repeat(len(seqs), 1, 1, 1)
        for b, s in enumerate(seqs):
            n = len(s.token_ids)
            ids[b, :n] = torch.tensor(s.token_ids)
            pos[b, :n] = s.position_ids
            allowed[b, 0, :n, :n] = s.allowed[0, 0]
        mask = torch.zeros(allowed.shape)
        for b, bias in enumerate(biases or []):
            n = bias.shape[0]
            mask[b, 0, :n, :n] = bias
        mask = mask.masked_fill(~allowed, torch.finfo(torch.float32).min)
        hidden = self.model.model(input_ids=ids, position_ids=pos,
                                  attention_mask=mask).last_hidden_state
        out = []
        for b, s in enumerate(seqs):
            n = len(s.token_ids)
            # The LM head only on the scored rows: it is ~12% of a full forward here.
            logits = self.model.lm_head(hidden[b, n - n_tail:n]).double()
            # k_proj output is pre-RoPE; both sides are at the same real position,
            # so the rotation (orthogonal) does not change the deviation's norm.
            real = s.real_rows
            kv = torch.cat([self._kv["k"][b, real], self._kv["v"][b, real]], dim=-1)
            out.append((torch.log_softmax(logits, dim=-1), kv))
        return out

    @torch.inference_mode()
    def question_attention(self, prompt: ChunkedPrompt, mode: str) -> torch.Tensor:
        """The ranking pass of the question-aware lever: one forward of `prompt` under
        `mode`'s isolation (every chunk with its isolated KV at its real position, as a
        deployment has them cached; no answer tokens), and per final-sequence token the
        attention probability the question's tokens give it, summed over the question's
        tokens, every head and every layer. Private copies get none (the question never
        sees them). Eager attention: SDPA does not return the probabilities."""
        seq = build_isolated_sequence(prompt, mode, sink_token_id=self.sink_token_id)
        source = seq.source_index
        question = prompt.question_span
        rows = torch.nonzero((source >= question.start) & (source < question.end)).flatten()
        per_layer: list[torch.Tensor] = []

        def capture(module, args, output) -> None:
            # output[1]: probabilities [batch, heads, queries, keys].
            per_layer.append(output[1][0][:, rows].sum(dim=(0, 1)))

        hooks = [layer.self_attn.register_forward_hook(capture)
                 for layer in self.model.model.layers]
        self.model.set_attn_implementation("eager")
        try:
            self.model.model(input_ids=torch.tensor([seq.token_ids]),
                             position_ids=seq.position_ids[None],
                             attention_mask=seq.additive_mask())
        finally:
            self.model.set_attn_implementation("sdpa")
            for hook in hooks:
                hook.remove()
        total = torch.stack(per_layer).sum(0)
        real = seq.real_rows
        scores = torch.zeros(len(prompt.token_ids), dtype=total.dtype)
        scores[source[real]] = total[real]
        return scores

    def _score(self, item: EncodedQuestion, logprobs: torch.Tensor, recomputed: int) -> Score:
        gold = item.gold
        lp = sum(float(logprobs[t, g]) for t, g in enumerate(gold))
        greedy = [int(r.argmax()) for r in logprobs]
        exact = greedy[:len(gold)] == list(gold) and ends_word(
            self.tokenizer.decode([greedy[len(gold)]]))
        return Score(lp, exact, recomputed, item.num_chunk_tokens)

    def evaluate(self, item: EncodedQuestion, modes: tuple[str, ...],
                 grid: LeverGrid | None) -> dict[str, Score]:
        """Scores keyed "full", "<mode>", "<mode>+first<K>", "<mode>+blend<r>",
        "<mode>+qa<r>" / "<mode>+qa<r>+first<f>" / "<mode>+qchunk<r>" (question-aware),
        "<mode>+scale<S>"."""
        prompt: ChunkedPrompt = item.prompt
        gold = list(item.gold)
        n_tail = len(gold) + 1
        out: dict[str, Score] = {}
        # Stage 1: full causal attention and every plain mode, one batch.
        base = {"full": _causal(prompt.token_ids + gold)}
        for mode in dict.fromkeys(modes + (grid.modes if grid else ())):
            base[mode] = build_isolated_sequence(prompt, mode, extra_token_ids=gold,
                                                 sink_token_id=self.sink_token_id)
        results = dict(zip(base, self._forward(list(base.values()), n_tail)))
        full_kv = results["full"][1]
        out["full"] = self._score(item, results["full"][0], item.num_chunk_tokens)
        deviation: dict[str, torch.Tensor] = {}
        for mode in base:
            if mode in modes:
                out[mode] = self._score(item, results[mode][0], 0)
            # Per real token: squared distance of its layer-1 K and V from full attention.
            deviation[mode] = ((results[mode][1] - full_kv) ** 2).sum(-1)
        if grid is None:
            return out
        # Stage 2: the levers (CacheBlend's tokens come from stage 1's deviation).
        levers = {}
        for mode in grid.modes:
            variants = [(f"{mode}+first{k}", first_k(prompt, k)) for k in grid.boundary_k]
            variants += [(f"{mode}+blend{round(r * 100)}",
                          top_fraction(prompt, deviation[mode], r)) for r in grid.fractions]
            if grid.question_fractions or grid.question_chunk_fractions:
                # The ranking pass: the question against the chunks' isolated KV.
                attention = self.question_attention(prompt, mode)
                variants += [(_qa_name(mode, r, f), question_aware(prompt, attention, r, f))
                             for f in grid.question_first for r in grid.question_fractions]
                variants += [(f"{mode}+qchunk{r * 100:g}", question_chunks(prompt, attention, r))
                             for r in grid.question_chunk_fractions]
            for name, recompute in variants:
                levers[name] = build_lever_sequence(prompt, mode, recompute,
                                                    extra_token_ids=gold,
                                                    sink_token_id=self.sink_token_id)
        names = list(levers)
        for i in range(0, len(names), self.batch):
            part = names[i:i + self.batch]
            for name, (logprobs, _) in zip(part, self._forward(
                    [levers[n].seq for n in part], n_tail)):
                out[name] = self._score(item, logprobs, levers[name].num_recomputed)
        # Stage 3: APE's context scaling on each mode's own sequence.
        for mode in grid.modes if grid.scales else ():
            seqs = [base[mode]] * len(grid.scales)
            biases = [context_scale_bias(prompt, base[mode], s) for s in grid.scales]
            for s, (logprobs, _) in zip(grid.scales, self._forward(seqs, n_tail, biases)):
                out[f"{mode}+scale{s:g}"] = self._score(item, logprobs, 0)
        return out


def _qa_name(mode: str, fraction: float, first: int) -> str:
    return f"{mode}+qa{fraction * 100:g}" + (f"+first{first}" if first else "")


def _causal(ids: list[int]) -> IsolatedSequence:
    """Plain causal attention as an IsolatedSequence (so it batches with the rest)."""
    n = len(ids)
    return IsolatedSequence(token_ids=ids, position_ids=torch.arange(n),
                            allowed=torch.ones(n, n, dtype=torch.bool).tril()[None, None],
                            source_index=torch.arange(n))
