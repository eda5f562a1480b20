"""The install check of a GPU run (issue 59, deliverable 3): `vllm serve` of the installed
wheel with `--enable-chunk-cache`, then one documents request (`prompt_segments`) and the
same documents in another order, checked; the server is stopped at the end.

    python3 tools/gpu/serve_check.py MODEL [--port 8011] [--timeout 240] [-- VLLM_SERVE_ARGS...]

Checked: the server comes up; both answers are 200 with a completion; the usage counts the
prompt; the chunk cache's own counters (/metrics) show the first request missing its four
segments and the reordered one hitting all four and missing none (the documents reused,
position-independent); the start-up logged
the chunk cache's lines. Prints `serve-check: PASS ...` or `serve-check: FAIL ...` (exit 1)
and the server's chunk-cache lines. The model's weights may be random: the text is not
judged, only that the engine served the documents and reused them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


def _post(port: int, body: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _counter(port: int, name: str) -> float:
    """A counter's value from the server's /metrics (summed over its label sets)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def _words(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choice("abcdefghijklmnopqrstuvwxyz")
                            for _ in range(rng.randint(2, 7))) for _ in range(n))


def main(argv: list[str]) -> int:
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds for the start-up")
    ap.add_argument("--log", default="", help="the server's log (default: a temporary file)")
    args = ap.parse_args(argv)
    log = Path(args.log or f"/tmp/serve-check-{os.getpid()}.log")
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", args.model,
           "--enable-chunk-cache", "--host", "127.0.0.1", "--port", str(args.port),
           "--served-model-name", "m", "--enable-prompt-tokens-details", *extra]
    print("serve-check: " + " ".join(cmd), flush=True)
    t0 = time.time()
    with open(log, "w") as out:
        # NOTE: its own process group, so that the engine core's process goes with it.
        server = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return _check(args, server, log, t0)
    finally:
        try:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(server.pid, signal.SIGKILL)
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines()
                 if "Chunk cache" in ln]
        for ln in lines[:6]:
            print("server: " + ln[ln.find("Chunk cache"):][:160], flush=True)


def _check(args, server, log: Path, t0: float) -> int:
    while True:
        if server.poll() is not None:
            print(f"serve-check: FAIL: the server exited ({server.returncode}) during start-up; "
                  f"last lines:\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:]))
            return 1
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{args.port}/health", timeout=2)
            break
        except (urllib.error.URLError, ConnectionError, OSError):
            if time.time() - t0 > args.timeout:
                print(f"serve-check: FAIL: no /health within {args.timeout:.0f} s")
                return 1
            time.sleep(1)
    print(f"serve-check: server up in {time.time() - t0:.1f} s", flush=True)
    rng = random.Random(0)
    docs = [_words(rng, 260) for _ in range(3)]
    system, question = "Answer from the documents.", "question: " + _words(rng, 10)
    results = []
    # NOTE: a chunked request's cached_tokens counts the rows its children computed for it
    # too (they are loaded, not computed by the request), so reuse is judged by the chunk
    # cache's own counters: the reordered request must hit every segment and miss none.
    counts = []
    for order in ([0, 1, 2], [2, 0, 1]):
        body = {"model": "m", "max_tokens": 4, "temperature": 0,
                "prompt_segments": [system, *[docs[i] for i in order], question]}
        t = time.perf_counter()
        try:
            r = _post(args.port, body)
        except (urllib.error.URLError, OSError) as e:  # HTTPError included: the engine died
            print(f"serve-check: FAIL: documents {order}: {e}; the server's log: {log}")
            return 1
        ms = 1e3 * (time.perf_counter() - t)
        usage = r.get("usage") or {}
        cached = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        text = (r.get("choices") or [{}])[0].get("text")
        results.append((usage.get("prompt_tokens", 0), cached, text, ms))
        counts.append((_counter(args.port, "vllm:chunk_cache_hits_total"),
                       _counter(args.port, "vllm:chunk_cache_misses_total")))
        print(f"serve-check: documents {order}: prompt {usage.get('prompt_tokens')} tokens, "
              f"cached {cached}, {ms:.1f} ms, text {text!r}", flush=True)
    (p1, c1, t1, _), (p2, c2, t2, _) = results
    problems = []
    if not isinstance(t1, str) or not isinstance(t2, str):
        problems.append("a response without a completion")
    if not p1 or not p2:
        problems.append("a usage without prompt tokens")
    (h1, m1), (h2, m2) = counts
    # The system prompt and three documents: 4 segments, all missed first, all hit after.
    if not (m1 >= 4 and h2 - h1 >= 4 and m2 == m1):
        problems.append(f"the reordered documents were not reused (chunk cache hits "
                        f"{h1:.0f} -> {h2:.0f}, misses {m1:.0f} -> {m2:.0f})")
    if not any("Chunk cache" in ln for ln in log.read_text(errors="replace").splitlines()):
        problems.append("no 'Chunk cache' line in the server's log")
    if problems:
        print("serve-check: FAIL: " + "; ".join(problems))
        return 1
    print(f"serve-check: PASS: documents served and reused out of order (chunk cache hits "
          f"{h1:.0f} -> {h2:.0f}, misses {m1:.0f} -> {m2:.0f}; {results[1][3]:.0f} ms "
          f"against {results[0][3]:.0f} ms cold)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
