"""The chunk cache through `vllm serve` (SmolLM2-135M-Instruct, float32):
exactness of concurrent completions and of chat against the HF isolation-mask
reference, one child per distinct missing segment, Prometheus metrics, the pool
back to idle, and HTTP 400 for bad chunked prompts (issue 4, acceptance 1, 3, 4, 5).
At the end, the README's smoke test: the server's start-up lines, plain completions
and chat that answer, and a bad flag value that fails start-up with a message (it
shared no server of its own: one fewer start-up, ~45 s on a 2-core AVX2 machine).
"""

from __future__ import annotations

import random
import re
import subprocess
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.conftest import models_dir
from tests.e2e.chunk_reference import Layout, Reference, compare, random_text
from tests.e2e.server import SERVE_ARGS, VLLM, start_server

pytestmark = pytest.mark.e2e

MODEL = str(models_dir() / "SmolLM2-135M-Instruct")
MODE = "sink"
# float32 on both sides; SmolLM2 has 30 layers (vs 4 for the tiny Llama), so
# rounding differences accumulate more: still ~1e-4 observed, 2e-3 allowed.
TOL = 2e-3
MAX_CHUNKS = 6
MAX_CHUNK_TOKENS = 300


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server(
        MODEL,
        [
            "--enable-chunk-cache",
            "--served-model-name",
            "smollm2",
            "--chunk-context",
            MODE,
            "--max-chunks",
            str(MAX_CHUNKS),
            "--max-chunk-tokens",
            str(MAX_CHUNK_TOKENS),
            "--seed",
            "0",
            "--enable-prompt-tokens-details",
            # For the chat `documents` tests' RAG template.
            "--trust-request-chat-template",
        ],
        tmp_path_factory.mktemp("serve") / "serve.log",
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference():
    return Reference(MODEL)


def metrics(server) -> dict[str, float]:
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(
            r"^vllm:chunk_cache_(\w+?)(?:_total)?\{[^}]*\} ([0-9.e+-]+)$", line
        )
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def complete(server, prompt, n=3, **extra):
    body = {
        "model": "smollm2",
        "prompt": prompt,
        "max_tokens": n,
        "temperature": 0,
        "logprobs": 5,
        "return_tokens_as_token_ids": True,
        "ignore_eos": True,
    }
    body.update(extra)
    return server.post("/v1/completions", body)


def _ids(tokens):
    return [int(t.split(":", 1)[1]) for t in tokens]


class _Lp:
    def __init__(self, logprob, rank=None):
        self.logprob, self.rank = logprob, rank


def check_completion(reference, prompt, body):
    choice = body["choices"][0]
    tokens = _ids(choice["logprobs"]["tokens"])
    top = [
        {int(k.split(":", 1)[1]): _Lp(v, 1) for k, v in d.items()}
        for d in choice["logprobs"]["top_logprobs"]
    ]
    ref = reference.next_token_logprobs(prompt, MODE, tokens)
    return compare(ref, tokens, top, TOL)


def test_concurrent_requests_share_chunks_and_match_the_reference(server, reference):
    rng = random.Random("server-concurrency")
    docs = [random_text(rng, rng.randint(20, 60)) for _ in range(4)]
    layouts = []
    for i in range(16):
        chunks = rng.sample(docs, rng.randint(2, 3))
        layouts.append(
            Layout("You answer from the documents.", chunks, f"Question {i}: why?")
        )
    before = metrics(server)
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda lay: complete(server, lay.prompt), layouts))
    diffs = []
    for layout, (status, body) in zip(layouts, results):
        assert status == 200, body
        prompt = reference.chunked_prompt(layout)
        diffs.append(check_completion(reference, prompt, body)["max_diff"])
        # Each response's cached-token count includes the reused chunk tokens.
        assert (
            body["usage"]["prompt_tokens_details"]["cached_tokens"]
            == prompt.question_span.start
        )
    after = metrics(server)
    used_docs = {c for lay in layouts for c in lay.chunks}
    # One child per distinct missing segment: the system prompt + each document.
    assert (
        after["child_computes"] - before.get("child_computes", 0) == len(used_docs) + 1
    )
    assert after["misses"] - before.get("misses", 0) == len(used_docs) + 1
    assert after["pool_entries_pinned"] == 0
    assert after["pool_blocks_used"] > 0
    print("max |logprob diff|:", max(diffs))


def test_chat_messages_with_separators_match_the_reference(server, reference):
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": "first doc text ## second doc text ## What do they say?",
        },
    ]
    status, body = server.post(
        "/v1/chat/completions",
        {
            "model": "smollm2",
            "messages": messages,
            "max_tokens": 3,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 5,
            "ignore_eos": True,
        },
    )
    assert status == 200, body
    text = reference.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    parts = text.split("##")
    layout = Layout(
        parts[0].rstrip(), [p.strip() for p in parts[1:-1]], parts[-1].lstrip()
    )
    prompt = reference.chunked_prompt(layout)
    content = body["choices"][0]["logprobs"]["content"]
    tokens = [
        reference.tokenizer.convert_tokens_to_ids(
            reference.tokenizer.convert_ids_to_tokens(
                reference.tokenizer.encode(c["token"], add_special_tokens=False)
            )[0]
        )
        for c in content
    ]
    ref = reference.next_token_logprobs(prompt, MODE, tokens)
    for step, c in enumerate(content):
        assert abs(c["logprob"] - float(ref[step][tokens[step]])) <= TOL
        assert float(ref[step][tokens[step]]) >= float(ref[step].max()) - TOL


@pytest.mark.parametrize(
    "prompt,message",
    [
        ("system ## ## question", "segment 1 is empty"),
        ("##", "is empty"),  # segment 0 or 1, depending on whether a BOS is added
        ("sys " + " ## doc" * (MAX_CHUNKS + 1) + " ## q", "more than --max-chunks"),
        (
            "sys ## " + "word " * (MAX_CHUNK_TOKENS + 10) + " ## q",
            "more than --max-chunk-tokens",
        ),
    ],
)
def test_bad_chunked_prompts_get_http_400(server, prompt, message):
    status, body = complete(server, prompt)
    assert status == 400, body
    assert message in body["error"]["message"]
    # The server keeps serving.
    status, body = complete(server, "sys ## a short document ## q")
    assert status == 200, body


def test_prompt_logprobs_on_a_chunked_prompt_get_http_400(server):
    status, body = complete(server, "sys ## doc ## q", prompt_logprobs=1)
    assert status == 400, body
    assert "prompt_logprobs is not supported" in body["error"]["message"]


def check_plain_completion(reference, text, body):
    """The completion equals plain causal attention over the prompt text."""
    choice = body["choices"][0]
    tokens = _ids(choice["logprobs"]["tokens"])
    ids = reference.tokenizer.encode(text)
    with torch.no_grad():
        logits = reference.model(input_ids=torch.tensor([ids + tokens])).logits[0]
    ref = torch.log_softmax(logits.double(), -1)[len(ids) - 1 :]
    top = [
        {int(k.split(":", 1)[1]): _Lp(v, 1) for k, v in d.items()}
        for d in choice["logprobs"]["top_logprobs"]
    ]
    return compare(ref, tokens, top, TOL)


def test_prompt_without_separator_is_plain_vllm(server, reference):
    text = "The capital of France is"
    status, body = complete(server, text)
    assert status == 200, body
    check_plain_completion(reference, text, body)


def test_stats_log_line_reports_the_chunk_cache(server):
    import time

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and "hit_rate=" not in server.log():
        complete(server, "sys ## a short document ## q")
        time.sleep(2)
    line = [ln for ln in server.log().splitlines() if "KV Transfer metrics" in ln][-1]
    for key in (
        "hits=",
        "misses=",
        "hit_rate=",
        "tokens_reused=",
        "child_computes=",
        "evictions=",
        "refused_requests=",
        "pool_blocks_used=",
        "pool_blocks_total=",
    ):
        assert key in line, line


def test_client_disconnect_leaves_nothing_pinned(server):
    import http.client
    import json
    import time

    rng = random.Random("disconnect")
    prompt = Layout("sys", [random_text(rng, 40), random_text(rng, 30)], "go on").prompt
    for read_first in (True, False):  # mid-generation, and before the first token
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        conn.request(
            "POST",
            "/v1/completions",
            json.dumps(
                {
                    "model": "smollm2",
                    "prompt": prompt,
                    "max_tokens": 400,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": True,
                }
            ),
            {"Content-Type": "application/json"},
        )
        if read_first:
            resp = conn.getresponse()
            assert resp.status == 200
            resp.fp.readline()  # the first streamed event
        conn.close()
    # Let the engine notice the disconnects, then run one more request so that a
    # step reports the pool gauges.
    deadline = time.monotonic() + 60
    while True:
        time.sleep(1)
        status, _ = complete(server, "sys ## a short document ## q")
        assert status == 200
        m = metrics(server)
        if m["pool_entries_pinned"] == 0 or time.monotonic() > deadline:
            break
    assert m["pool_entries_pinned"] == 0
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        running = [
            ln
            for ln in r.read().decode().splitlines()
            if ln.startswith("vllm:num_requests_running{")
        ]
    assert running and all(float(ln.rsplit(" ", 1)[1]) == 0 for ln in running)


# ------------------------------------------------- documents as structured input


def segments_of(layout: Layout) -> list[str]:
    return [layout.system, *layout.chunks, layout.question]


def test_prompt_segments_reuse_the_separator_forms_chunks_and_match_the_reference(
    server, reference
):
    """The same documents through the separator and through `prompt_segments`
    have the same chunk keys: the second form computes nothing new, in another
    order, and both answers equal the isolation reference."""
    rng = random.Random("segments")
    docs = [random_text(rng, 30), random_text(rng, 25), random_text(rng, 20)]
    first = Layout("You answer from the documents.", docs, "Which is first?")
    status, body = complete(server, first.prompt)
    assert status == 200, body
    check_completion(reference, reference.chunked_prompt(first), body)
    before = metrics(server)
    second = Layout(first.system, [docs[2], docs[0], docs[1]], "Which is last?")
    status, body = complete(server, None, prompt_segments=segments_of(second))
    assert status == 200, body
    prompt = reference.chunked_prompt(second)
    check_completion(reference, prompt, body)
    after = metrics(server)
    assert after["child_computes"] == before["child_computes"]
    assert after["hits"] - before.get("hits", 0) == 4  # the system prompt, 3 documents
    assert (
        body["usage"]["prompt_tokens_details"]["cached_tokens"]
        == prompt.question_span.start
    )


def test_a_document_with_the_separator_in_it_is_one_chunk(server, reference):
    layout = Layout(
        "sys", ["# Notes ## Section two ## more", "plain text"], "Summarise."
    )
    status, body = complete(server, None, prompt_segments=segments_of(layout))
    assert status == 200, body
    prompt = reference.chunked_prompt(layout)
    assert len(prompt.spans) == 4  # system, two documents, question
    check_completion(reference, prompt, body)


def test_prompt_segments_stream_echo_n_and_salt(server):
    layout = Layout("sys", ["alpha beta gamma", "delta epsilon"], "Continue:")
    segments = segments_of(layout)
    # echo: the prompt comes back as its segments' text, then the completion
    # (without logprobs: echo would ask for the prompt's, which cached
    # segments do not have; refused with a 400 like prompt_logprobs).
    status, body = server.post(
        "/v1/completions",
        {
            "model": "smollm2",
            "prompt_segments": segments,
            "echo": True,
            "n": 2,
            "temperature": 0.8,
            "seed": 1,
            "max_tokens": 3,
        },
    )
    assert status == 200, body
    assert sorted(c["index"] for c in body["choices"]) == [0, 1]
    for choice in body["choices"]:
        assert "alpha beta gamma" in choice["text"] and "Continue:" in choice["text"]
    # Streaming: events arrive, the last one finishes.
    import http.client
    import json

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    conn.request(
        "POST",
        "/v1/completions",
        json.dumps(
            {
                "model": "smollm2",
                "prompt_segments": segments,
                "max_tokens": 4,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
        ),
        {"Content-Type": "application/json"},
    )
    resp = conn.getresponse()
    assert resp.status == 200
    events = [ln for ln in resp.read().decode().splitlines() if ln.startswith("data: ")]
    conn.close()
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"
    # Another tenant's salt: its own namespace, so its own children.
    before = metrics(server)
    status, body = complete(
        server, None, prompt_segments=segments, cache_salt="tenant-z"
    )
    assert status == 200, body
    assert metrics(server)["child_computes"] - before["child_computes"] == 3


@pytest.mark.parametrize(
    "extra,message",
    [
        ({"prompt_segments": []}, "at least 2 segments"),
        ({"prompt_segments": ["only the question"]}, "at least 2 segments"),
        ({"prompt_segments": ["sys", "", "q"]}, "segment 1 is empty"),
        (
            {"prompt_segments": ["sys", *(["doc"] * (MAX_CHUNKS + 1)), "q"]},
            "more than --max-chunks",
        ),
        (
            {"prompt_segments": ["sys", "word " * (MAX_CHUNK_TOKENS + 10), "q"]},
            "more than --max-chunk-tokens",
        ),
        ({"prompt_segments": ["sys", 3, "q"]}, "prompt_segments"),
        ({"prompt_segments": ["sys", "q"], "prompt": "sys ## q"}, "do not send prompt"),
        (
            {"prompt_segments": ["sys", "q"], "split_chunks": False},
            "split_chunks=false",
        ),
    ],
)
def test_bad_prompt_segments_get_http_400_and_pin_nothing(server, extra, message):
    body = {"model": "smollm2", "max_tokens": 2}
    body.update(extra)
    assert_400(server, "/v1/completions", body, message)
    status, _ = complete(server, "sys ## a short document ## q")
    assert status == 200
    assert_nothing_pinned(server)


def assert_400(server, path: str, body: dict, message: str) -> None:
    status, out = server.post(path, body)
    assert status == 400, out
    assert message in out["error"]["message"], out


def assert_nothing_pinned(server) -> None:
    # A plain request's steps report the pool gauges with nothing in flight.
    status, _ = complete(server, "The capital of France is")
    assert status == 200
    assert metrics(server)["pool_entries_pinned"] == 0


RAG_TEMPLATE = (
    "System: {{ messages[0].content }}\n"
    "{% for d in documents %}Document {{ loop.index }}: {{ d.title }}\n{{ d.text }}\n"
    "{% endfor %}User: {{ messages[-1].content }}\nAssistant:"
)


def test_chat_documents_are_chunks_where_the_template_renders_them(server, reference):
    rng = random.Random("server chat documents")
    docs = [
        {"title": "One", "text": random_text(rng, 20)},
        {"title": "Two", "text": random_text(rng, 15)},
    ]
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What do they say?"},
    ]
    request = {
        "model": "smollm2",
        "messages": messages,
        "documents": docs,
        "chat_template": RAG_TEMPLATE,
        "max_tokens": 3,
        "temperature": 0,
        "ignore_eos": True,
    }
    before = metrics(server)
    status, body = server.post("/v1/chat/completions", request)
    assert status == 200, body
    # System, two documents and the words between them: four new chunks.
    assert metrics(server)["misses"] - before.get("misses", 0) == 4
    # Again with the documents swapped: only the new words between them and
    # the new system segment ("Document 1: " now precedes the other title) miss.
    before = metrics(server)
    status, body = server.post(
        "/v1/chat/completions", dict(request, documents=docs[::-1])
    )
    assert status == 200, body
    assert metrics(server)["hits"] - before.get("hits", 0) >= 2  # both documents
    question = reference.tokenizer.encode(
        "\nUser: What do they say?\nAssistant:", add_special_tokens=False
    )
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == body["usage"][
        "prompt_tokens"
    ] - len(question)


@pytest.mark.parametrize(
    "extra,message",
    [
        ({}, "does not render 'documents'"),  # SmolLM2's own template ignores them
        ({"documents": []}, "non-empty list"),
        ({"documents": [{"text": ""}]}, "documents[0] is empty"),
        (
            {
                "chat_template": RAG_TEMPLATE.replace("{{ d.text }}", "").replace(
                    "{{ d.title }}", "{% if loop.index == 1 %}{{ d.title }}{% endif %}"
                )
            },
            "drops documents[1]",
        ),
        (
            {
                "chat_template": RAG_TEMPLATE,
                "documents": [
                    {"title": "t", "text": f"doc {i}"} for i in range(MAX_CHUNKS)
                ],
            },
            "more than --max-chunks",
        ),  # documents and the words between them count
        (
            {
                "chat_template": RAG_TEMPLATE,
                "documents": [
                    {"title": "t", "text": "word " * (MAX_CHUNK_TOKENS + 10)}
                ],
            },
            "more than --max-chunk-tokens",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "d", "chunk": "yes"},
                            {"type": "text", "text": "q"},
                        ],
                    }
                ],
                "documents": None,
            },
            "chunk must be true or false",
        ),
    ],
)
def test_bad_chat_documents_get_http_400(server, extra, message):
    request = {
        "model": "smollm2",
        "max_tokens": 2,
        "messages": [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "q"},
        ],
        "documents": [{"title": "a", "text": "first"}, {"title": "b", "text": "x"}],
    }
    request.update(extra)
    assert_400(server, "/v1/chat/completions", request, message)
    # Refused while rendering: nothing reached the engine, nothing is pinned.
    assert_nothing_pinned(server)


def test_a_chat_with_documents_and_split_chunks_false_is_served_as_stock(server):
    """Issue 30, finding 4. Before: HTTP 400 "this model's chat template does not
    render 'documents'" (SmolLM2's template ignores them) where stock vLLM answers: the
    documents were marked whatever the request asked. Now rendered as without the chunk
    cache: the prompt has the tokens of the same chat without documents."""
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Where is the tower? ## Paris."},
    ]
    plain = {
        "model": "smollm2",
        "messages": messages,
        "max_tokens": 2,
        "temperature": 0,
        "split_chunks": False,
    }
    status, body = server.post(
        "/v1/chat/completions",
        dict(
            plain,
            documents=[{"title": "a", "text": "first"}, {"title": "b", "text": "x"}],
        ),
    )
    assert status == 200, body
    status, without = server.post("/v1/chat/completions", plain)
    assert status == 200, without
    assert body["usage"]["prompt_tokens"] == without["usage"]["prompt_tokens"]
    assert body["choices"][0]["message"] == without["choices"][0]["message"]


def test_chat_content_parts_marked_chunk_match_the_reference(server, reference):
    """Documents as content parts marked "chunk": each is a chunk where the
    (SmolLM2 ChatML) template renders it, the newline vLLM joins parts with a
    small chunk of its own, the last part and the template's tail the question."""
    rng = random.Random("content parts")
    docs = [random_text(rng, 15), random_text(rng, 12)]
    content = [{"type": "text", "text": d, "chunk": True} for d in docs]
    content.append({"type": "text", "text": "What do they say?"})
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": content},
    ]
    status, body = server.post(
        "/v1/chat/completions",
        {
            "model": "smollm2",
            "messages": messages,
            "max_tokens": 3,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 5,
            "ignore_eos": True,
        },
    )
    assert status == 200, body
    tok = reference.tokenizer
    joined = [
        messages[0],
        {"role": "user", "content": "\n".join([*docs, "What do they say?"])},
    ]
    text = tok.apply_chat_template(joined, tokenize=False, add_generation_prompt=True)
    head, tail = text.split(docs[0], 1)
    pieces = [head, docs[0], "\n", docs[1], tail.split(docs[1], 1)[1]]
    assert "".join(pieces) == text
    lengths = [len(tok.encode(p, add_special_tokens=False)) for p in pieces]
    ids = tok.encode(text, add_special_tokens=False)
    assert sum(lengths) == len(ids)
    from vllm.v1.core.chunk_structures import ChunkedPrompt

    prompt = ChunkedPrompt.from_lengths(ids, lengths)
    content = body["choices"][0]["logprobs"]["content"]
    tokens = [
        tok.convert_tokens_to_ids(
            tok.convert_ids_to_tokens(tok.encode(c["token"], add_special_tokens=False))[
                0
            ]
        )
        for c in content
    ]
    ref = reference.next_token_logprobs(prompt, MODE, tokens)
    for step, c in enumerate(content):
        assert abs(c["logprob"] - float(ref[step][tokens[step]])) <= TOL
    assert (
        body["usage"]["prompt_tokens_details"]["cached_tokens"]
        == prompt.question_span.start
    )


def test_the_openai_client_example_runs_against_the_server(server):
    """examples/documents_openai_client.py, as the README tells a newcomer to run it
    (here against this module's server): both requests answered, the hit counter
    printed."""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    out = subprocess.run(
        [sys.executable, str(REPO / "examples" / "documents_openai_client.py")],
        env={
            **os.environ,
            "OPENAI_BASE_URL": server.url + "/v1",
            "SERVED_MODEL": "smollm2",
        },
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 3 and all(line.startswith("'") for line in lines[:2]), (
        out.stdout
    )
    hits = float(lines[2].removeprefix("chunk cache hits: "))
    assert hits >= 2  # the second request's two documents at least


# ------------------------------------------------------------ serve smoke


def test_logs_the_chunk_cache_settings(server):
    assert "Chunk cache enabled: separator='##'" in server.log()


def test_logs_where_captures_run(server):
    """Issue 21: after the forward from the children's paged blocks wherever the CPU
    backend's cache reads back what it wrote (its vec/vec16 layouts), in the attention
    hook where a start-up self-check finds it packed (AMX): one or the other on every
    layer, whichever this machine's ISA gives, and never a failed check."""
    line = re.search(r"Chunk cache: captures run (.*)", server.log())
    assert line, "start-up line missing"
    assert re.match(
        r"after the forward from the child's paged blocks on all 30 layer\(s\)$"
        r"|in the attention hook on 30 layer\(s\): self-check: \d+ of \d+ bytes "
        r"read back differ \(CPU_ATTN packs this cache\)$",
        line.group(1).strip(),
    ), line


def test_completions_answer(server):
    status, body = server.post(
        "/v1/completions",
        {
            "model": "smollm2",
            "prompt": "The capital of France is",
            "max_tokens": 8,
            "temperature": 0,
        },
    )
    assert status == 200, body
    assert "Paris" in body["choices"][0]["text"]


def test_chat_completions_answer(server):
    status, body = server.post(
        "/v1/chat/completions",
        {
            "model": "smollm2",
            "max_tokens": 20,
            "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
        },
    )
    assert status == 200, body
    assert "Paris" in body["choices"][0]["message"]["content"]


def test_bad_chunk_cache_value_fails_start_up_with_a_message(server, tmp_path):
    # `server` is requested only so the two engines never start at the same time.
    proc = subprocess.run(
        [
            VLLM,
            "serve",
            MODEL,
            *SERVE_ARGS,
            "--enable-chunk-cache",
            "--max-chunks",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    assert "--max-chunks must be >= 1" in proc.stdout + proc.stderr
