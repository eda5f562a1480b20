"""A real `vllm serve` process on 127.0.0.1 for end-to-end tests (one per test module)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

VLLM = str(Path(sys.executable).with_name("vllm"))
# The README's serve defaults, minus the port (tests pick a free one).
SERVE_ARGS = ["--host", "127.0.0.1", "--dtype", "float32", "--enforce-eager",
              "--max-model-len", "4096"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def post(self, path: str, body: dict, timeout: float = 300) -> tuple[int, dict]:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def start_server(model: str, extra: list[str], log_path: Path, timeout: float = 600) -> Server:
    port = free_port()
    log = open(log_path, "w")
    # NOTE: the KV space the offline engines get (engine.py): without it vLLM's CPU worker
    # asks for 92% of the NUMA node's memory, which the page cache of a busy 24 GiB machine
    # can leave short (seen: 15.2 of 17.1 GiB available, 15.7 asked).
    env = {**os.environ}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    proc = subprocess.Popen([VLLM, "serve", model, *SERVE_ARGS, "--port", str(port), *extra],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    server = Server(proc, port, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited {proc.returncode}:\n{server.log()[-4000:]}")
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=5) as r:
                if r.status == 200:
                    return server
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(2)
    server.stop()
    raise TimeoutError(f"vllm serve did not become healthy in {timeout} s:\n{server.log()[-4000:]}")
