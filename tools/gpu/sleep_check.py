"""On a GPU: sleep and wake-up with the chunk cache on (issue 30 finding 1, issue 34 item 4).

    python tools/gpu/sleep_check.py MODEL_DIR LEVEL      # LEVEL: 1 or 2

vLLM's GPU worker allocates the KV cache (and everything built in register_kv_caches) in
its CuMem pool; sleep(level>=1) discards that memory, wake_up() maps new, unzeroed memory.
Here: cold and warm requests (warm ones load their documents from the pool through the
fused kernel and the RoPE tables), sleep, wake up (level 2: reload the weights), then the
same layouts again cold and warm, each answer checked against the HF float32 forward under
the chunk-isolation mask with the half-precision bound of
tests/e2e/test_chunk_cache_half_precision.py (worst |logprob diff| over the top-5 of each
step within 3x stock vLLM's worst against the causal forward, measured first on the same
engine without documents). Prints one line per phase and exits non-zero on a failure.
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main(model: str, level: int) -> int:
    from vllm import LLM, SamplingParams

    from tests.e2e.chunk_reference import Layout, Reference, random_text

    reference = Reference(model)
    rng = random.Random(f"sleep {level}")
    docs = [random_text(rng, rng.randint(20, 60)) for _ in range(4)]
    layouts = [Layout("answer from the documents", rng.sample(docs, 3),
                      random_text(rng, 6)) for _ in range(3)]
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=5, ignore_eos=True)
    llm = LLM(model=model, dtype="bfloat16", enable_chunk_cache=True, chunk_context="sink",
              enable_sleep_mode=True, gpu_memory_utilization=0.3, max_model_len=4096, seed=0)

    def worst(layout, out) -> float:
        prompt = reference.chunked_prompt(layout)
        assert list(out.prompt_token_ids) == prompt.token_ids
        completion = out.outputs[0]
        ref = reference.next_token_logprobs(prompt, "sink", list(completion.token_ids))
        return max(abs(lp.logprob - float(ref[step][t]))
                   for step, lps in enumerate(completion.logprobs) for t, lp in lps.items())

    def phase(name: str) -> float:
        outs = llm.generate([layout.prompt for layout in layouts], params, use_tqdm=False)
        w = max(worst(layout, out) for layout, out in zip(layouts, outs))
        cached = [out.num_cached_tokens for out in outs]
        print(f"level {level} {name}: worst |dlogprob| {w:.4g}, cached tokens {cached}",
              flush=True)
        return w

    before = [phase("cold"), phase("warm")]
    llm.sleep(level=level)
    if level == 2:
        llm.wake_up(tags=["weights"])
        llm.collective_rpc("reload_weights")
        llm.wake_up(tags=["kv_cache"])
    else:
        llm.wake_up()
    after = [phase("cold after wake-up"), phase("warm after wake-up")]
    bound = 3 * max(max(before), 1e-3)
    ok = max(after) <= bound
    print(f"level {level}: {'pass' if ok else 'FAIL'} (after wake-up {max(after):.4g}, "
          f"bound {bound:.4g} = 3x the worst before sleeping)", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
