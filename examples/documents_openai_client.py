#!/usr/bin/env python3
"""Documents as a list, through the OpenAI client: `prompt_segments` (the system
prompt first, the question last, the documents between) goes in `extra_body`.

    ./fork serve          # in another terminal: SmolLM2 with the chunk cache
    .cache/venv/bin/python examples/documents_openai_client.py

Another server or model name: OPENAI_BASE_URL=http://host:port/v1 and
SERVED_MODEL=name in the environment.

No separator is needed and none is searched: a document may contain "##" or
anything else. Send the same documents again in another order and they are not
recomputed (`curl -s 127.0.0.1:8000/metrics | grep chunk_cache_hits`).
"""

import os
import re
import urllib.request

from openai import OpenAI

base_url = os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1")
client = OpenAI(base_url=base_url, api_key="unused")
documents = [
    "The Eiffel Tower is in Paris. It was built in 1889.",
    "## Berlin\nThe Brandenburg Gate is in Berlin.",
]
for docs in (documents, documents[::-1]):
    completion = client.completions.create(
        model=os.environ.get("SERVED_MODEL", "SmolLM2-135M-Instruct"),
        prompt=None,  # the whole prompt is in prompt_segments
        max_tokens=6,
        temperature=0,
        extra_body={"prompt_segments": [
            "Answer from the documents.",
            *docs,
            "Question: In which year was the Eiffel Tower built?\n"
            "Answer: The Eiffel Tower was built in",
        ]},
    )
    print(repr(completion.choices[0].text))
with urllib.request.urlopen(base_url.removesuffix("/v1") + "/metrics") as response:
    metrics = response.read().decode()
print("chunk cache hits:", re.search(r"^vllm:chunk_cache_hits_total\{.*\} (\S+)$", metrics,
                                     re.M).group(1))
