"""A chunked request through a CPU engine under vllm-ascend's balance scheduler.

Run in a subprocess by test_ascend_schedulers.py with the stub `torch_npu` and the
patched vllm-ascend tree on PYTHONPATH (vLLM stays on its CPU platform). vllm-ascend's
own plugin entry point applies its platform patches first (patch_balance_schedule
rebinds vLLM's Scheduler to BalanceScheduler), as in every process on an NPU; with
`enable_balance_scheduling` its schedule() is its own copy of vLLM's, not vLLM's.
Prints one JSON line: what the engine did within a bounded number of steps.

    python ascend_scheduler_run.py MODEL
"""

import json
import sys
import types

# vllm-ascend reads its build's SoC from a generated module (A2 here).
_build_info = types.ModuleType("vllm_ascend._build_info")
_build_info.__device_type__ = "A2"
sys.modules["vllm_ascend._build_info"] = _build_info

MAX_STEPS = 200


def main(model: str) -> None:
    import vllm_ascend

    # vllm-ascend's platform patches, then its connectors.
    vllm_ascend.register_connector()
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model,
        dtype="float32",
        enforce_eager=True,
        max_model_len=1024,
        seed=0,
        enable_chunk_cache=True,
        additional_config={"enable_balance_scheduling": True},
    )
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompts = [
        "the system prompt ## the first document about rivers ## a second one about "
        "cities ## the question is",
        "another system ## the first document about rivers ## the question is",
    ]
    result = {
        "scheduler": f"{type(scheduler).__module__}.{type(scheduler).__name__}",
        "balance": scheduler._balance_enabled,
        "outputs": [],
    }
    for prompt in prompts:  # one at a time: the second one hits the first's chunk
        llm._add_completion_requests(prompts=[prompt], params=params, use_tqdm=False)
        for step in range(MAX_STEPS):
            finished = [o for o in engine.step() if o.finished]
            if finished:
                out = finished[0].outputs[0]
                result["outputs"].append(
                    {
                        "steps": step + 1,
                        "token_ids": list(out.token_ids),
                        "finish_reason": out.finish_reason,
                    }
                )
                break
        else:
            result["outputs"].append(
                {
                    "steps": None,
                    "waiting": len(scheduler.waiting),
                    "running": len(scheduler.running),
                }
            )
            break
    stats = scheduler.connector.chunk_scheduler.manager.stats()
    result["stats"] = {
        "child_computes": stats.child_computes,
        "hits": stats.hits,
        "tokens_loaded": stats.tokens_loaded,
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
