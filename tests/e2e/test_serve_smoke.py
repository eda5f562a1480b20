"""`vllm serve` of the fork on SmolLM2 with --enable-chunk-cache: starts and answers."""

import subprocess

import pytest

from tests.conftest import models_dir
from tests.e2e.server import SERVE_ARGS, VLLM, start_server

pytestmark = pytest.mark.e2e
MODEL = str(models_dir() / "SmolLM2-135M-Instruct")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server(MODEL, ["--enable-chunk-cache", "--served-model-name", "smollm2"],
                     tmp_path_factory.mktemp("serve") / "serve.log")
    yield s
    s.stop()


def test_logs_the_chunk_cache_settings(server):
    assert "Chunk cache enabled: separator='##'" in server.log()


def test_logs_where_captures_run(server):
    """Issue 21: after the forward from the children's paged blocks wherever the CPU
    backend's cache reads back what it wrote (its vec/vec16 layouts), in the attention
    hook where a start-up self-check finds it packed (AMX): one or the other on every
    layer, whichever this machine's ISA gives, and never a failed check."""
    import re

    line = re.search(r"Chunk cache: captures run (.*)", server.log())
    assert line, "start-up line missing"
    assert re.match(r"after the forward from the child's paged blocks on all 30 layer\(s\)$"
                    r"|in the attention hook on 30 layer\(s\): self-check: \d+ of \d+ bytes "
                    r"read back differ \(CPU_ATTN packs this cache\)$", line.group(1).strip()), line


def test_completions_answer(server):
    status, body = server.post("/v1/completions", {
        "model": "smollm2", "prompt": "The capital of France is", "max_tokens": 8,
        "temperature": 0})
    assert status == 200, body
    assert "Paris" in body["choices"][0]["text"]


def test_chat_completions_answer(server):
    status, body = server.post("/v1/chat/completions", {
        "model": "smollm2", "max_tokens": 20, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    assert status == 200, body
    assert "Paris" in body["choices"][0]["message"]["content"]


def test_bad_chunk_cache_value_fails_start_up_with_a_message(server, tmp_path):
    # `server` is requested only so the two engines never start at the same time.
    proc = subprocess.run([VLLM, "serve", MODEL, *SERVE_ARGS, "--enable-chunk-cache",
                           "--max-chunks", "0"], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "max_chunks must be >= 1" in proc.stdout + proc.stderr
