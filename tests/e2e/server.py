"""A real `vllm serve` process on 127.0.0.1 for end-to-end tests (one per test
module)."""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

# The process itself (start, health wait, stop) has one owner, shared with the
# benchmarks; they import their common module as scripts do.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from common import ServeProcess, free_port  # noqa: E402

VLLM = str(Path(sys.executable).with_name("vllm"))
# The README's serve defaults, minus the port (tests pick a free one).
SERVE_ARGS = [
    "--host",
    "127.0.0.1",
    "--dtype",
    "float32",
    "--enforce-eager",
    "--max-model-len",
    "4096",
]
__all__ = ["SERVE_ARGS", "VLLM", "Server", "free_port", "start_server"]


class Server(ServeProcess):
    """A test's server: the process and JSON posts that return the status with the
    body."""

    def post(self, path: str, body: dict, timeout: float = 300) -> tuple[int, dict]:
        req = urllib.request.Request(
            self.url + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")


def start_server(
    model: str, extra: list[str], log_path: Path, timeout: float = 600
) -> Server:
    # NOTE: the KV space the offline engines get (engine.py): without it vLLM's CPU
    # worker asks for 92% of the NUMA node's memory, which the page cache of a busy 24
    # GiB machine can leave short (seen: 15.2 of 17.1 GiB available, 15.7 asked).
    env = (
        {}
        if "VLLM_CPU_KVCACHE_SPACE" in os.environ
        else {"VLLM_CPU_KVCACHE_SPACE": "4"}
    )
    return Server.start(model, [*SERVE_ARGS, *extra], log_path, timeout, env=env)
