"""One engine of the half-precision exactness test (test_chunk_cache_half_precision.py),
in this process or in a process of its own (issue 40, deliverable 2).

On a GPU the test's two engines (the chunk cache, then the stock control) cannot share a
process: vLLM's memory profiling of the second engine saw the first's memory come back
("Initial free memory 78.13 GiB, current free memory 78.24 GiB", gpu_worker.py; H100,
2026-11-26, TRITON_MLA and FLASH_ATTN_MLA) and refused to start. So each engine can
run as

    python tests/e2e/half_precision_engine.py REQUEST.json RESULT.json

which starts the engine, generates, prints every output's row (token ids, top logprobs,
cached tokens) at once, writes them to RESULT.json and exits: the process and all its
device memory are gone before the next engine starts. `run_engine` is the same work in
the calling process (the CPU default: no second import of vLLM, CI time unchanged).

REQUEST.json: {"role": "chunk" | "stock", "model", "engine_kwargs",
"prompts": [text with the chunk separator] (chunk) or [[token ids]] (stock),
"batches": [[prompt indices], ...], "num_gen"}, and optionally "recompute" (K) and
"hook_capture" (true: captures in the attention hook). The exactness test runs its
engines this way on a GPU too (test_chunk_cache_exactness.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

if __name__ == "__main__":
    # NOTE: run as a script, this folder is sys.path[0]: its engine.py is imported
    # as it is, not through `tests` (another distribution may install a `tests`).
    from engine import ENGINE_ENV, close_llm, make_llm
else:
    from tests.e2e.engine import ENGINE_ENV, close_llm, make_llm

ROOT = Path(__file__).resolve().parents[2]


def _pool_bytes() -> int:
    """Bytes of the pool tensors the (in-process) worker allocated: K and V of
    standard attention layers, the latent rows of MLA layers."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group()._worker
    return (
        sum(t.nbytes for t in worker.pool_key.values())
        + sum(t.nbytes for t in worker.pool_value.values())
        + sum(latent.pool.nbytes for latent in worker.latent.values())
    )


def _load_buffer_bytes(llm) -> tuple[int, int]:
    """The load buffers' share of the KV budget, and what the worker allocated
    (at most that: its buffers hold --max-chunk-load-tokens rows, never more)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.setup import (
        load_scratch_bytes,
    )

    buffers = get_kv_transfer_group()._worker._scratch._buffers.values()
    return load_scratch_bytes(llm.llm_engine.vllm_config), sum(
        b.nbytes for b in buffers
    )


def _kv_bytes_per_token(llm) -> int:
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.setup import (
        kv_bytes_per_token,
    )

    return kv_bytes_per_token(llm.llm_engine.vllm_config)


def _prompt(role: str, prompt):
    if role == "stock":
        from vllm.inputs import TokensPrompt

        return TokensPrompt(prompt_token_ids=list(prompt))
    return prompt  # the layout's text, segments marked by the separator


def run_engine(request: dict) -> dict:
    """Start the engine `request` describes, generate its batches one after the
    other (greedy, top-5 logprobs), print each output's row as it comes, close the
    engine; the rows and the engine's sizes as plain JSON data."""
    from vllm import SamplingParams

    role = request["role"]
    kwargs = dict(request["engine_kwargs"])
    if role == "chunk":
        # engine_kwargs may set the mode and the rest (the exactness test does).
        kwargs = {
            "enable_chunk_cache": True,
            "chunk_context": "sink",
            "chunk_recompute_tokens": request.get("recompute", 0),
            **kwargs,
        }
    params = SamplingParams(
        max_tokens=request["num_gen"], temperature=0.0, logprobs=5, ignore_eos=True
    )
    if request.get("hook_capture"):
        # Captures in the attention hook on every layer (test_chunk_cache_exactness's
        # "hook" configuration): the worker takes its capture path from this check.
        from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache import (
            capture_path,
        )

        capture_path.self_check = lambda *args: "forced by the test (the hook path)"
    llm = make_llm(request["model"], **kwargs)
    result = {
        "role": role,
        "pid": os.getpid(),
        "outputs": [None] * len(request["prompts"]),
    }
    try:
        for batch in request["batches"]:
            outs = llm.generate(
                [_prompt(role, request["prompts"][i]) for i in batch],
                params,
                use_tqdm=False,
            )
            for i, out in zip(batch, outs):
                completion = out.outputs[0]
                row = {
                    "prompt_token_ids": list(out.prompt_token_ids),
                    "num_cached_tokens": out.num_cached_tokens,
                    "token_ids": list(completion.token_ids),
                    "logprobs": [
                        {str(t): lp.logprob for t, lp in step.items()}
                        for step in completion.logprobs
                    ],
                    "ranks": [
                        {str(t): lp.rank for t, lp in step.items()}
                        for step in completion.logprobs
                    ],
                }
                result["outputs"][i] = row
                # NOTE: printed now, before anything later (the next batch, the other
                # engine, the comparison) can fail.
                print(
                    f"half-precision row: engine={role} prompt={i} prompt_tokens="
                    f"{len(row['prompt_token_ids'])} cached={row['num_cached_tokens']} "
                    f"tokens={row['token_ids']}",
                    flush=True,
                )
        config = llm.llm_engine.vllm_config
        result["kv_blocks"] = config.cache_config.num_gpu_blocks
        # NOTE: 128 tokens on the CPU, 16 for MLA there (CPU_MLA): as the engine chose.
        result["block_size"] = config.cache_config.block_size
        result["kv_token_bytes"] = _kv_bytes_per_token(llm)
        if role == "chunk":
            result["pool_bytes"] = _pool_bytes()
            result["scratch_bytes"], result["scratch_allocated"] = _load_buffer_bytes(
                llm
            )
    finally:
        close_llm(llm)
    return result


def run_engine_in_subprocess(
    request: dict, workdir: Path, timeout: float | None = None
) -> dict:
    """`run_engine` in a fresh Python process (this file as a script); its output
    goes to this process's stdout and stderr as it comes."""
    for k, v in ENGINE_ENV.items():  # the child's budget is the one the caller checks
        os.environ.setdefault(k, v)
    workdir.mkdir(parents=True, exist_ok=True)
    req, res = (
        workdir / f"{request['role']}-request.json",
        workdir / f"{request['role']}.json",
    )
    req.write_text(json.dumps(request))
    res.unlink(missing_ok=True)
    sys.stdout.flush()
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), str(req), str(res)],
        cwd=ROOT,
        timeout=timeout,
    )
    if proc.returncode != 0 or not res.exists():
        raise RuntimeError(
            f"the {request['role']} engine's process failed "
            f"(exit status {proc.returncode}); its output is above"
        )
    return json.loads(res.read_text())


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(
            "usage: half_precision_engine.py REQUEST.json RESULT.json", file=sys.stderr
        )
        return 2
    request = json.loads(Path(argv[0]).read_text())
    result = run_engine(request)
    Path(argv[1]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
