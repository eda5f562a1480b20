# SPDX-License-Identifier: Apache-2.0
"""Quality and cost through the real engine (offline `LLM`, float32, eager), one
engine per configuration: stock vLLM (the fork with the flag off) or the chunk
cache in one `--chunk-context` mode.

Per question, in dataset order (the cache starts cold, documents recur):
1. greedy generation of the prompt -> exact match and tokens computed (the request
   as a user would send it, hitting what earlier questions left in the cache); the
   first `timed` questions are sent one at a time and give the TTFT, the rest go as
   one batch (2 shared cores: sequential requests for all would take too long);
2. the gold log-likelihood. `prompt_logprobs` are refused for chunked prompts, so
   for the chunk cache each gold token t is scored by one more request whose
   question segment is extended by gold[:t], with max_tokens=1,
   allowed_token_ids=[gold[t]] and logprobs=0: vLLM returns the *raw* logprob
   (computed before allowed_token_ids masks the logits) of the token it was forced
   to sample - exactly log p(gold[t] | prompt, gold[:t]). The question segment is
   always computed, its documents are hits. Sent as one batch. Stock vLLM scores
   the gold tokens with one `prompt_logprobs` request over prompt + gold (the same
   numbers by definition, one prefill instead of len(gold)).
3. the all-hit TTFT (chunk cache): the timed prompts once more, one at a time.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field

from .prompts import EncodedQuestion, ends_word

ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "4",
    "VLLM_CPU_OMP_THREADS_BIND": "0,1",
    "HF_HUB_OFFLINE": "1",
    # The engine in-process: ~10 s start-up instead of ~45 s.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}
CONFIGS = ("stock", "none", "sink", "system", "sink+first12")


def chunk_cache_args(config: str) -> dict:
    """Engine arguments of a configuration: "stock" (none), a `--chunk-context`
    mode, or "mode+firstK": that mode with boundary recompute of K tokens
    (`--chunk-recompute-tokens K`, the lever built in the engine)."""
    if config == "stock":
        return {}
    mode, _, k = config.partition("+first")
    return dict(enable_chunk_cache=True, chunk_context=mode,
                chunk_recompute_tokens=int(k or 0))


@dataclass
class QuestionResult:
    qid: str
    kind: str
    generated: str
    exact: bool
    gold_logprob: float
    prompt_tokens: int
    # Prompt tokens the request computed itself, plus the tokens of the child
    # requests its missing segments started (context included).
    computed_tokens: int
    # TTFT in the stream (None for questions sent in the batch).
    ttft_s: float | None
    # TTFT of the same prompt again, everything cached (chunk cache only).
    warm_ttft_s: float | None


@dataclass
class EngineRun:
    config: str
    vllm_version: str
    startup_s: float
    results: list[QuestionResult] = field(default_factory=list)


def _child_tokens(config: str, item: EncodedQuestion, seen: set) -> int:
    """Tokens the chunk cache's children compute for this request's missing segments:
    a segment is missing the first time its (context, tokens) key is seen. Exact as
    long as nothing is evicted (the pool holds the whole corpus here; checked by the
    caller against the engine's hit counter)."""
    system = item.segments[0]
    mode = chunk_cache_args(config)["chunk_context"]
    context = {"none": (), "sink": ("sink",), "system": system}[mode]
    total = 0
    for i, seg in enumerate(item.segments[:-1]):
        ctx = () if i == 0 else context
        key = (ctx, seg)
        if key not in seen:
            seen.add(key)
            total += len(seg) + (1 if ctx == ("sink",) else len(ctx))
    return total


def run_config(config: str, model: str, items: list[EncodedQuestion], timed: int,
               progress) -> EngineRun:
    """`timed`: how many questions (the first ones) are sent one at a time for TTFT;
    the rest are sent as one batch (same outputs, far less wall time on 2 cores)."""
    for k, v in ENGINE_ENV.items():
        os.environ.setdefault(k, v)
    import vllm
    from vllm import LLM, SamplingParams, TokensPrompt

    kwargs = dict(model=model, dtype="float32", enforce_eager=True, max_model_len=4096,
                  seed=0, disable_log_stats=False)
    if config == "stock":
        # No prefix caching: every request computes its whole prompt (the prompts
        # share only a system prompt shorter than one 128-token block anyway).
        kwargs.update(enable_prefix_caching=False)
    else:
        kwargs.update(chunk_cache_args(config))
    start = time.perf_counter()
    llm = LLM(**kwargs)
    run = EngineRun(config, vllm.__version__, time.perf_counter() - start)
    sep = llm.get_tokenizer().encode("##", add_special_tokens=False)
    chunked = config != "stock"

    def ids(item: EncodedQuestion, extra=()) -> "TokensPrompt":
        return TokensPrompt(prompt_token_ids=item.chunked_ids(sep, extra) if chunked
                            else item.plain_ids(extra))

    def generate(prompts, params):
        return llm.generate(prompts, params, use_tqdm=False)

    try:
        # 1. Greedy answers, in dataset order: the first `timed` one at a time (TTFT),
        # the rest in one batch. Cold cache at the start; documents recur.
        greedy = []
        for item in items[:timed]:
            greedy += generate([ids(item)], _greedy(SamplingParams, item))
            progress.update(1)
        rest = items[timed:]
        if rest:
            greedy += generate([ids(i) for i in rest], [_greedy(SamplingParams, i) for i in rest])
            progress.update(len(rest))
        # 2. Gold log-likelihoods, one batch (see the module docstring).
        logprobs = _gold_logprobs(generate, ids, chunked, items, SamplingParams)
        # 3. All-hit TTFT: the timed prompts again, everything now cached.
        warm = []
        if chunked:
            for item in items[:timed]:
                out = generate([ids(item)], SamplingParams(max_tokens=1, temperature=0))
                warm.append(out[0].metrics.first_token_latency)
    finally:
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001 - best effort at teardown
            pass
    seen: set = set()
    for n, (item, out, lp) in enumerate(zip(items, greedy, logprobs)):
        text = out.outputs[0].text.lstrip()
        answer = item.question.answer
        computed = item.num_prompt_tokens - (out.num_cached_tokens or 0)
        if chunked:
            computed += _child_tokens(config, item, seen)
        run.results.append(QuestionResult(
            item.question.qid, item.question.kind, out.outputs[0].text,
            text.startswith(answer) and ends_word(text[len(answer):]), lp,
            item.num_prompt_tokens, computed,
            out.metrics.first_token_latency if n < timed else None,
            warm[n] if n < len(warm) else None))
    return run


def _greedy(SamplingParams, item: EncodedQuestion):
    # One token past the answer decides whether the answer word ended there.
    return SamplingParams(max_tokens=len(item.gold) + 1, temperature=0)


def _gold_logprobs(generate, ids, chunked: bool, items, SamplingParams) -> list[float]:
    if not chunked:
        outs = generate([ids(i, i.gold) for i in items],
                        SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
        return [sum(d[g].logprob for d, g in zip(o.prompt_logprobs[-len(i.gold):], i.gold))
                for i, o in zip(items, outs)]
    prompts, params, owner = [], [], []
    for n, item in enumerate(items):
        for t, g in enumerate(item.gold):
            prompts.append(ids(item, item.gold[:t]))
            params.append(SamplingParams(max_tokens=1, temperature=0,
                                         allowed_token_ids=[g], logprobs=0))
            owner.append((n, g))
    totals = [0.0] * len(items)
    for out, (n, g) in zip(generate(prompts, params), owner):
        assert out.outputs[0].token_ids[0] == g, "allowed_token_ids did not force the token"
        totals[n] += out.outputs[0].logprobs[0][g].logprob
    return totals


def summarize(run: EngineRun, kind: str | None = None) -> dict:
    rows = [r for r in run.results if kind is None or r.kind == kind]
    warm = [r.warm_ttft_s for r in rows if r.warm_ttft_s is not None]
    timed = [r.ttft_s for r in rows if r.ttft_s is not None]
    return {
        "n": len(rows),
        "exact_match": sum(r.exact for r in rows) / len(rows),
        "gold_logprob": statistics.fmean(r.gold_logprob for r in rows),
        "prompt_tokens": statistics.fmean(r.prompt_tokens for r in rows),
        "computed_tokens": statistics.fmean(r.computed_tokens for r in rows),
        "ttft_median_s": statistics.median(timed) if timed else None,
        "timed": len(timed),
        "warm_ttft_median_s": statistics.median(warm) if warm else None,
    }
