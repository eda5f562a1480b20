"""Hardening of the chunk cache through `vllm serve` (SmolLM2-135M-Instruct, float32,
a small chunk pool): issue 7's findings reproduced against a real server, then a
bounded soak (>= 150 requests, concurrency 16, priority scheduling, client aborts, bad
inputs, evictions, a cache reset that preempts every running request, and an RL
trainer's step mid-stream: weights reloaded in place through `POST /collective_rpc`,
then a reset).

Findings covered here (the others have unit tests):
1. a client salt shaped like the old layout salt selects no layout (no forged layouts);
2. a chunk-prompt 400 logs no traceback;
3. a request whose segments can never fit the pool is refused with a 400 naming the
   numbers and the flag, never served with full causal attention;
10. in `sink` mode the same documents hit after a system prompt with another first
    token.
"""

from __future__ import annotations

import http.client
import json
import random
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import models_dir
from tests.e2e.chunk_reference import Layout, Reference, compare, random_text
from tests.e2e.server import start_server
from tests.e2e.test_chunk_cache_server import _ids, _Lp, check_plain_completion
from tests.e2e.test_chunk_cache_server import metrics as _metrics

pytestmark = pytest.mark.e2e

MODEL = str(models_dir() / "SmolLM2-135M-Instruct")
MODE = "sink"
TOL = 2e-3  # as in test_chunk_cache_server.py (float32, 30 layers)
# 0.03 GiB at 45 KiB per token (30 layers x K+V x 3 heads x 64 x fp32) = 699 rows
# = 43 blocks of 16 rows: the largest soak request fits, the corpus does not
# (evictions).
POOL_GIB = 0.03
TRACEBACK_MARKERS = (
    "Traceback (most recent call last)",
    "Exception in ASGI application",
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # Dev mode: the soak resets the caches mid-stream (POST /reset_prefix_cache).
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_SERVER_DEV_MODE", "1")
        s = start_server(
            MODEL,
            [
                "--enable-chunk-cache",
                "--served-model-name",
                "smollm2",
                "--chunk-context",
                MODE,
                "--chunk-pool-size-gib",
                str(POOL_GIB),
                "--max-chunks",
                "8",
                "--seed",
                "0",
                "--scheduling-policy",
                "priority",
            ],
            tmp_path_factory.mktemp("serve") / "serve.log",
        )
    yield s
    s.stop()


def reset_caches(server) -> int:
    """VLLM's cache reset with the connector's, running requests preempted."""
    req = urllib.request.Request(
        server.url
        + "/reset_prefix_cache?reset_external=true&reset_running_requests=true",
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.status


def reload_weights(server) -> int:
    """Dev mode: reload the checkpoint in place on every worker (the same
    weights: the soak's answers keep one reference; the engine test checks
    that KV of really different weights is never served after a reset)."""
    request = urllib.request.Request(
        server.url + "/collective_rpc",
        data=json.dumps({"method": "reload_weights"}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=300) as r:
        return r.status


@pytest.fixture(scope="module")
def reference():
    return Reference(MODEL)


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


def check_chunked(reference, layout, body):
    choice = body["choices"][0]
    tokens = _ids(choice["logprobs"]["tokens"])
    top = [
        {int(k.split(":", 1)[1]): _Lp(v, 1) for k, v in d.items()}
        for d in choice["logprobs"]["top_logprobs"]
    ]
    ref = reference.next_token_logprobs(reference.chunked_prompt(layout), MODE, tokens)
    return compare(ref, tokens, top, TOL)


def metrics(server) -> dict[str, float]:
    """The chunk-cache metrics; a counter not incremented yet is not exported."""
    return {
        "hits": 0.0,
        "misses": 0.0,
        "in_flight_joins": 0.0,
        "child_computes": 0.0,
        "evictions": 0.0,
        **_metrics(server),
    }


def lookups(m: dict) -> float:
    return m["hits"] + m["misses"] + m["in_flight_joins"]


def test_a_salt_shaped_like_a_layout_selects_nothing(server, reference):
    """Finding 1: the layout is not carried in cache_salt, so no client salt can
    choose isolation spans or enter another tenant's chunk namespace."""
    text = "The capital of France is a city that many people visit every year"
    n = len(reference.tokenizer.encode(text))
    # (0.32 refuses "/" in a salt: the old transport format, written with ":".)
    forged = f"vllm-chunk-cache:v1:{n - 5},2,3:=tenantB"
    before = metrics(server)
    status, body = complete(server, text, cache_salt=forged)
    assert status == 200, body
    after = metrics(server)
    assert lookups(after) == lookups(before)
    assert after["child_computes"] == before["child_computes"]
    # And the answer is plain causal attention over the prompt.
    check_plain_completion(reference, text, body)


def test_chunk_prompt_400_logs_no_traceback(server):
    """Finding 2: a bad chunked prompt is a validation error like vLLM's own."""
    start = len(server.log())
    status, body = complete(server, "system ## ## question")
    assert status == 400, body
    assert "segment 1 is empty" in body["error"]["message"]
    time.sleep(1)
    new_log = server.log()[start:]
    assert not any(m in new_log for m in TRACEBACK_MARKERS), new_log[-3000:]


def test_segments_larger_than_the_pool_are_refused_not_served_causally(
    server, reference
):
    """Finding 3: never a silent change of semantics."""
    rng = random.Random("oversize")
    docs = [random_text(rng, 200) for _ in range(4)]  # ~2000 tokens > 699 pool rows
    before = metrics(server)
    status, body = complete(server, Layout("sys", docs, "q").prompt)
    assert status == 400, body
    message = body["error"]["message"]
    assert "chunk pool" in message and "--chunk-pool" in message, message
    after = metrics(server)
    assert after["child_computes"] == before["child_computes"]


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_documents_hit_after_a_system_prompt_with_another_first_token(
    server, reference, api
):
    """Finding 10: the sink is a constant of the deployment, not the first token."""
    rng = random.Random(f"sink-{api}")
    a, b = random_text(rng, 30), random_text(rng, 25)
    systems = ["Answer from the documents.", "Be brief."]
    assert (
        reference.tokenizer.encode(systems[0])[0]
        != reference.tokenizer.encode(systems[1])[0]
    )
    for i, system in enumerate(systems):
        before = metrics(server)
        if api == "completions":
            layout = Layout(system, [a, b] if i == 0 else [b, a], "what is it")
            status, body = complete(server, layout.prompt)
            assert status == 200, body
            check_chunked(reference, layout, body)
        else:
            status, body = server.post(
                "/v1/chat/completions",
                {
                    "model": "smollm2",
                    "max_tokens": 3,
                    "temperature": 0,
                    "messages": [
                        {"role": "system", "content": system},
                        {"role": "user", "content": f"## {a} ## {b} ## what is it"},
                    ],
                },
            )
            assert status == 200, body
        after = metrics(server)
        if i == 1:
            # The two documents hit; only the new system prompt (and, for chat,
            # the rendered head) is computed.
            assert after["hits"] - before["hits"] >= 2, (before, after)


# ------------------------------------------------------------------------ soak

# NOTE: 96 requests (160 before: 58 s on a 2-core AVX2 machine) still put a reset, a
# weights reload, bad and aborted requests and evictions of the 0.03 GiB pool under 16
# in flight; the 500-request fleet soak is in the slow tier (test_chunk_store_soak.py).
SOAK_REQUESTS = 96
SOAK_CONCURRENCY = 16


def _abort_mid_request(server, prompt) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request(
        "POST",
        "/v1/completions",
        json.dumps(
            {
                "model": "smollm2",
                "prompt": prompt,
                "max_tokens": 200,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
        ),
        {"Content-Type": "application/json"},
    )
    resp = conn.getresponse()
    resp.fp.readline()
    conn.close()


def test_soak_keeps_the_server_exact_and_idle_after(server, reference):
    rng = random.Random("soak")
    corpus = [random_text(rng, rng.randint(8, 50)) for _ in range(24)]
    systems = [
        "Answer from the documents.",
        "Be brief.",
        "You are a helpful assistant.",
    ]
    jobs = []
    for i in range(SOAK_REQUESTS):
        kind = rng.random()
        if i == SOAK_REQUESTS // 3:
            jobs.append(("reset", None))
        elif i == 2 * SOAK_REQUESTS // 3:
            jobs.append(("weights", None))
        elif kind < 0.08:
            jobs.append(("bad", rng.choice(["sys ## ## q", "##", "a ## " * 12 + "q"])))
        elif kind < 0.16:
            jobs.append(
                (
                    "abort",
                    Layout(rng.choice(systems), rng.sample(corpus, 2), "go").prompt,
                )
            )
        else:
            layout = Layout(
                rng.choice(systems),
                rng.sample(corpus, rng.randint(1, 3)),
                f"question {i}?",
            )
            jobs.append(("ok", layout))
    # Priority scheduling: a later, more urgent request preempts running ones.
    priorities = [rng.choice([0, 0, 1, -1]) for _ in jobs]

    def run(i):
        kind, payload = jobs[i]
        if kind == "reset":
            return kind, payload, reset_caches(server), None
        if kind == "weights":
            # An RL trainer's step: weights reloaded in place while requests run,
            # then every cache reset.
            return kind, payload, (reload_weights(server), reset_caches(server)), None
        if kind == "abort":
            _abort_mid_request(server, payload)
            return kind, payload, None, None
        prompt = payload if kind == "bad" else payload.prompt
        status, body = complete(server, prompt, n=2, priority=priorities[i])
        return kind, payload, status, body

    with ThreadPoolExecutor(SOAK_CONCURRENCY) as pool:
        results = list(pool.map(run, range(len(jobs))))
    assert all(s == 200 for k, _, s, _ in results if k == "reset")
    assert all(s == (200, 200) for k, _, s, _ in results if k == "weights")
    assert server.log().count("chunk cache reset:") == 2

    answered = [(p, b) for k, p, s, b in results if k == "ok" and s == 200]
    assert all(s == 400 for k, _, s, _ in results if k == "bad")
    assert len(answered) == sum(1 for k, *_ in results if k == "ok"), [
        (s, b) for k, _, s, b in results if k == "ok" and s != 200
    ][:3]
    for layout, body in random.Random("sample").sample(answered, 12):
        check_chunked(reference, layout, body)
    m = metrics(server)
    assert m["evictions"] > 0, m

    # Idle: nothing pinned, no chunked request alive, nothing running or waiting.
    deadline = time.monotonic() + 60
    while True:
        status, _ = complete(server, "sys ## a short document ## q", n=1)
        assert status == 200
        m = metrics(server)
        with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        busy = [
            ln
            for ln in text.splitlines()
            if ln.startswith(
                ("vllm:num_requests_running{", "vllm:num_requests_waiting{")
            )
            and float(ln.rsplit(" ", 1)[1]) != 0
        ]
        if (
            m["pool_entries_pinned"] == 0 and m["live_requests"] == 0 and not busy
        ) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert m["pool_entries_pinned"] == 0 and m["live_requests"] == 0 and not busy, (
        m,
        busy,
    )
    assert server.proc.poll() is None
    log = server.log()
    assert not any(marker in log for marker in TRACEBACK_MARKERS), [
        ln for ln in log.splitlines() if "Error" in ln
    ][:10]
