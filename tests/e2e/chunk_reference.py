"""The oracle of the chunk-cache e2e tests: one HF transformers forward over the
extended sequence with explicit position ids and the 4D chunk-isolation mask
(ARCHITECTURE.md section 3), built by tests/chunk_isolation_mask.py.

Also a random-layout generator and the comparison of vLLM's greedy tokens and
top-k logprobs against the reference."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
from vllm.v1.core.chunk_structures import ChunkedPrompt, SegmentSpan

from tests.chunk_isolation_mask import build_isolated_sequence

SEP = "##"

_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def random_text(rng: random.Random, num_words: int) -> str:
    words = []
    for _ in range(num_words):
        words.append("".join(rng.choice(_LETTERS) for _ in range(rng.randint(2, 7))))
    return " ".join(words)


@dataclass
class Layout:
    system: str
    chunks: list[str]
    question: str

    @property
    def prompt(self) -> str:
        return f" {SEP} ".join([self.system, *self.chunks, self.question])


def private_context(reference: Reference, mode: str):
    """Prompt -> the private context a chunk's child computes after (none, the
    deployment's sink = the tokenizer's BOS, or the system segment)."""
    sink = reference.tokenizer.bos_token_id

    def context_of(prompt: ChunkedPrompt) -> list[int]:
        system = prompt.spans[0]
        return {
            "none": [],
            "sink": [sink],
            "system": prompt.token_ids[system.start : system.end],
        }[mode]

    return context_of


def layer_windows(config) -> list[int | None]:
    """Each decoder layer's sliding window (None: full attention), read from the
    HF config as transformers' own mask functions read it: `layer_types`
    ("sliding_attention" layers get `sliding_window`), else `sliding_window`
    on every layer unless `use_sliding_window` is False (Mistral, Phi-3)."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is not None:
        # NOTE: only a type that limits what a token sees by distance matters
        # here; others (DeepSeek-V3.2's "indexed_attention": full attention
        # with a token selection, tests/e2e/sparse_reference.py) are full.
        local = {t for t in types if any(w in t for w in ("sliding", "chunk", "local"))}
        unknown = local - {"sliding_attention"}
        if unknown:
            raise ValueError(
                f"reference: layer types {sorted(unknown)} are not modelled"
            )
        return [window if t == "sliding_attention" else None for t in types]
    if window is not None and getattr(config, "use_sliding_window", True) is not False:
        return [window] * n
    return [None] * n


class Reference:
    """HF model + tokenizer in float32, eager attention (additive 4D mask).

    Sliding-window layers (issue 42): transformers uses a custom 4D mask as
    given, on every layer, and its eager attention does not apply the window
    itself, so each windowed layer's attention gets the isolation mask with
    its window applied (IsolatedSequence.windowed), swapped in by a pre-hook
    on that layer's attention module."""

    def __init__(self, model_dir: str):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        self.windows = layer_windows(self.model.config)
        self._layer_masks: list[torch.Tensor | None] = [None] * len(self.windows)
        if any(w is not None for w in self.windows):
            layers = self.model.model.layers
            assert len(layers) == len(self.windows)
            for i, layer in enumerate(layers):
                layer.self_attn.register_forward_pre_hook(
                    self._swap_mask(i), with_kwargs=True
                )

    def _swap_mask(self, index: int):
        def hook(module, args, kwargs):
            mask = self._layer_masks[index]
            if mask is not None:
                assert "attention_mask" in kwargs, (
                    "reference: the layer's mask is not a kwarg"
                )
                kwargs["attention_mask"] = mask
            return args, kwargs

        return hook

    def _forward(self, seq) -> torch.Tensor:
        """Logits [T, vocab] of the extended sequence, each layer under its mask."""
        mask = seq.additive_mask(torch.float32)
        self._layer_masks = [
            None if w is None else seq.additive_mask(torch.float32, w)
            for w in self.windows
        ]
        try:
            out = self.model(
                input_ids=torch.tensor([seq.token_ids]),
                position_ids=seq.position_ids[None],
                attention_mask=mask,
            )
        finally:
            self._layer_masks = [None] * len(self.windows)
        return out.logits[0]

    def chunked_prompt(self, layout: Layout) -> ChunkedPrompt:
        """Per-segment tokenization: special tokens on the first segment only."""
        segments = [layout.system, *layout.chunks, layout.question]
        ids: list[int] = []
        spans = []
        for i, text in enumerate(segments):
            seg = self.tokenizer.encode(text, add_special_tokens=(i == 0))
            spans.append(SegmentSpan(len(ids), len(ids) + len(seg)))
            ids.extend(seg)
        return ChunkedPrompt(token_ids=ids, spans=tuple(spans))

    @torch.no_grad()
    def next_token_logprobs(
        self,
        prompt: ChunkedPrompt,
        mode: str,
        generated: list[int],
        *,
        recompute_tokens: int = 0,
    ) -> torch.Tensor:
        """[len(generated) + 1, vocab] float64 log-probabilities of the token after
        the prompt and after each generated token (teacher forcing on `generated`).
        `recompute_tokens` = K > 0: the boundary-recompute reference (the first K
        tokens of every chunk recomputed, see chunk_isolation_mask)."""
        # The deployment's sink: the tokenizer's BOS token (ChunkCacheConfig's
        # default), whatever the prompt starts with.
        seq = build_isolated_sequence(
            prompt,
            mode,
            extra_token_ids=generated,
            sink_token_id=self.tokenizer.bos_token_id,
            recompute_tokens=recompute_tokens,
        )
        logits = self._forward(seq).double()
        # Rows of the last prompt token and of every generated token: the
        # last len(generated) + 1 rows (the question and generated tokens
        # are the tail of the extended sequence).
        rows = logits[len(seq.token_ids) - len(generated) - 1 :]
        return torch.log_softmax(rows, dim=-1)

    @torch.no_grad()
    def causal_logprobs(
        self, prompt: ChunkedPrompt, generated: list[int]
    ) -> torch.Tensor:
        """Same rows as next_token_logprobs, under plain causal attention."""
        ids = prompt.token_ids + list(generated)
        logits = self.model(input_ids=torch.tensor([ids])).logits[0].double()
        return torch.log_softmax(logits[len(prompt.token_ids) - 1 :], dim=-1)


def compare(
    ref_logprobs: torch.Tensor, token_ids: list[int], logprobs: list[dict], tol: float
) -> dict:
    """Check vLLM's greedy tokens and top-k logprobs against the reference.

    Returns the largest absolute logprob difference and the number of steps
    whose greedy token differs from the reference argmax (allowed only where
    the reference itself has a near-tie within `tol`)."""
    max_diff = 0.0
    exact_argmax = 0
    for step, (tok, lps) in enumerate(zip(token_ids, logprobs)):
        ref = ref_logprobs[step]
        best = float(ref.max())
        assert float(ref[tok]) >= best - tol, (
            f"step {step}: vLLM chose {tok} (ref lp {float(ref[tok]):.6f}), reference "
            f"argmax {int(ref.argmax())} (lp {best:.6f})"
        )
        exact_argmax += int(int(ref.argmax()) == tok)
        kth = float(torch.topk(ref, min(5, ref.numel())).values[-1])
        for t, lp in lps.items():
            diff = abs(lp.logprob - float(ref[t]))
            max_diff = max(max_diff, diff)
            assert diff <= tol, (
                f"step {step}: token {t}: vLLM logprob {lp.logprob:.6f} vs "
                f"reference {float(ref[t]):.6f} (|diff| {diff:.2e} > {tol})"
            )
            if lp.rank is not None and lp.rank <= 5:
                assert float(ref[t]) >= kth - tol, (
                    f"step {step}: vLLM top-5 token {t} is not in the reference top-5"
                )
    return {"max_diff": max_diff, "exact_argmax": exact_argmax, "steps": len(token_ids)}


@dataclass
class ExactnessTally:
    """What a run of random layouts covered and how close it stayed to the reference."""

    layouts: int = 0
    cold: int = 0
    warm: int = 0
    mixed: int = 0
    max_diff: float = 0.0
    exact: int = 0
    steps: int = 0
    # Smallest first-token distance to plain causal attention (the negative control).
    control_min: float = float("inf")
    # Chunks sent before: a layout of only those is warm.
    seen: set[str] = field(default_factory=set, repr=False)

    def add(self, layout: Layout, result: dict, control: float) -> None:
        self.max_diff = max(self.max_diff, result["max_diff"])
        self.exact += result["exact_argmax"]
        self.steps += result["steps"]
        if len(layout.chunks) >= 2:  # (one chunk in "system" mode is causal)
            self.control_min = min(self.control_min, control)
        self.layouts += 1
        warm = all(c in self.seen for c in layout.chunks)
        self.cold += not warm
        self.warm += warm
        self.mixed += int(not warm and any(c in self.seen for c in layout.chunks))

    def sent(self, batch: list[Layout]) -> None:
        for layout in batch:
            self.seen.update(layout.chunks)

    def check(self, layouts: int, min_cold: int, min_warm: int, tol: float) -> None:
        assert (
            self.layouts == layouts and self.cold >= min_cold and self.warm >= min_warm
        )
        assert self.exact >= self.steps - 1
        assert self.max_diff < tol / 10
        assert self.control_min > 10 * tol

    def check_within(
        self, layouts: int, min_cold: int, min_warm: int, bound: float
    ) -> None:
        """Where the dtype has no fixed tolerance (half precision on a GPU): every
        difference within `bound`, measured from stock vLLM in the same run, and the
        causal negative control outside it."""
        assert (
            self.layouts == layouts and self.cold >= min_cold and self.warm >= min_warm
        )
        assert self.max_diff <= bound, (self.max_diff, bound)
        assert self.control_min > bound, (self.control_min, bound)
