"""Where the milliseconds of a chunked all-hit request go (issue 60, deliverable 3): one
engine, the all-hit request and its floor (the question alone) interleaved, each phase's
unprofiled wall clock, CUDA events around the load and the forward, counts of blocks and
rows, then one torch-profiler trace of each with vLLM's own scopes on, kept as files.

    python3 tools/gpu/phase_clock.py MODEL [--sizes 8192,32768] [--reps 10] [--block-size N]
        [--dtype bfloat16] [--trace-dir DIR [--trace-sizes 32768]] [--eager] [--plan]

MODEL: a model directory (weights are not read: load_format="dummy"). --plan prints the
engine arguments and the phases as JSON and starts nothing. Output: one JSON line per size
(`"phase_clock": true`, medians in ms), a table per size, its counts, and one line
`above the floor` that ranks the phases by what the all-hit request spends over the floor.

How: the engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) and this
script replaces methods of the engine's own objects (the LLM, LLMEngine, EngineCore, its
Scheduler, the model runner, the worker's KV connector) by timed wrappers of the same
methods. Nothing in vLLM is patched; a method this vLLM does not have is an error naming it.
Phases (their methods, vLLM 0.23):
  add path   LLM._render_and_add_requests: render (LLM._preprocess_cmpl_one: the
             tokenisation and the chunk cache's split), process_inputs
             (InputProcessor.process_inputs), request + block hashing
             (EngineCore.preprocess_add_request), scheduler admission (Scheduler.add_request)
  schedule   Scheduler.schedule (the chunk cache's plan and connector metadata included:
             connector meta = the scheduler's KV connector's build_connector_meta)
  execute    GPUModelRunner.execute_model: state update (_update_states), input preparation
             (_prepare_inputs), attention metadata (_build_attention_metadata), the load
             (the connector's start_load_kv), the forward (_model_forward), the capture
             (wait_for_save), the rest of execute_model
  sample     GPUModelRunner.sample_tokens (its _sample and _bookkeeping_sync)
  output     Scheduler.update_from_output, OutputProcessor.process_outputs
  other      the request's wall time minus all of the above (LLM's loop, the engine step's
             own code, the executor's future)
On the CPU runner (a subclass of GPUModelRunner) the same methods run; the CUDA events are
reported as "n/a on cpu" there.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

# (phase, owner, method): owner names one of the objects found in `_owners`.
PHASES = (
    ("add", "llm", "_render_and_add_requests"),
    ("add.render", "llm", "_preprocess_cmpl_one"),
    ("add.process_inputs", "input_processor", "process_inputs"),
    ("add.request_hashing", "core", "preprocess_add_request"),
    ("add.admission", "scheduler", "add_request"),
    ("schedule", "scheduler", "schedule"),
    ("schedule.connector_meta", "scheduler_connector", "build_connector_meta"),
    ("execute", "runner", "execute_model"),
    ("execute.state_update", "runner", "_update_states"),
    ("execute.prepare_inputs", "runner", "_prepare_inputs"),
    ("execute.attn_metadata", "runner", "_build_attention_metadata"),
    ("execute.load", "worker_connector", "start_load_kv"),
    ("execute.forward", "runner", "_model_forward"),
    ("execute.capture", "worker_connector", "wait_for_save"),
    ("sample", "runner", "sample_tokens"),
    ("sample.sample", "runner", "_sample"),
    ("sample.bookkeeping", "runner", "_bookkeeping_sync"),
    ("output.update_from_output", "scheduler", "update_from_output"),
    ("output.process_outputs", "output_processor", "process_outputs"),
)
# The phases that get CUDA events (device time) beside their wall clock.
DEVICE_TIMED = ("execute.load", "execute.forward")
TOP = ("add", "schedule", "execute", "sample", "output.update_from_output",
       "output.process_outputs")


@dataclass
class Clock:
    """Per request: wall seconds per phase, calls per phase, CUDA event pairs."""
    cuda: bool
    wall: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    events: dict[str, list] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)

    def reset(self) -> None:
        self.wall, self.calls, self.events, self.counts = {}, {}, {}, {}

    def wrap(self, obj, attr: str, phase: str) -> None:
        inner = getattr(obj, attr)
        timed_device = self.cuda and phase in DEVICE_TIMED
        clock = self

        def timed(*args, **kwargs):
            if timed_device:
                import torch
                start, end = torch.cuda.Event(enable_timing=True), \
                    torch.cuda.Event(enable_timing=True)
                start.record()
            t = time.perf_counter()
            try:
                result = inner(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t
                clock.wall[phase] = clock.wall.get(phase, 0.0) + dt
                clock.calls[phase] = clock.calls.get(phase, 0) + 1
                if timed_device:
                    end.record()
                    clock.events.setdefault(phase, []).append((start, end))
            clock.observe(phase, args, result)
            return result

        # NOTE: an instance attribute shadows the class's method for this object only.
        setattr(obj, attr, timed)

    def observe(self, phase: str, args, result) -> None:
        """Counts: the steps, the tokens they scheduled, and the chunk cache's loads."""
        c = self.counts
        if phase == "schedule":
            c["steps"] = c.get("steps", 0) + 1
            c["scheduled_tokens"] = c.get("scheduled_tokens", 0) + int(
                getattr(result, "total_num_scheduled_tokens", 0) or 0)
        elif phase == "schedule.connector_meta":
            for load in getattr(result, "loads", None) or ():
                c["loaded_requests"] = c.get("loaded_requests", 0) + 1
                c["load_blocks"] = c.get("load_blocks", 0) + len(load.block_ids)
                c["load_stretches"] = c.get("load_stretches", 0) + len(load.stretches)
                c["load_rows"] = c.get("load_rows", 0) + sum(s.num_rows for s in load.stretches)
            c["stores"] = c.get("stores", 0) + len(getattr(result, "stores", None) or ())

    def device_ms(self) -> dict[str, float]:
        if not self.cuda:
            return {}
        import torch
        torch.cuda.synchronize()
        return {phase: sum(s.elapsed_time(e) for s, e in pairs)
                for phase, pairs in self.events.items()}


def _owners(llm) -> dict[str, object]:
    engine = llm.llm_engine
    core = engine.engine_core.engine_core  # InprocClient -> EngineCore
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
    if not has_kv_transfer_group():
        raise SystemExit("phase_clock: no KV connector in this process: the chunk cache is off "
                         "or the engine core is not in-process")
    return {"llm": llm, "input_processor": engine.input_processor,
            "output_processor": engine.output_processor, "core": core,
            "scheduler": core.scheduler, "scheduler_connector": core.scheduler.connector,
            "runner": core.model_executor.driver_worker.worker.model_runner,
            "worker_connector": get_kv_transfer_group()}


def install(llm, clock: Clock) -> None:
    owners = _owners(llm)
    missing = [f"{type(owners[o]).__name__}.{m}" for _, o, m in PHASES
               if not callable(getattr(owners[o], m, None))]
    if missing:  # NOTE: refused, not skipped: a table without a phase would mislead.
        raise SystemExit(f"phase_clock: this vLLM has no {', '.join(missing)}: the phase "
                         "table cannot be made (tools/gpu/phase_clock.py PHASES)")
    for phase, owner, method in PHASES:
        clock.wrap(owners[owner], method, phase)


def engine_kwargs(args) -> dict:
    kwargs = dict(model=args.model, load_format="dummy", dtype=args.dtype,
                  max_model_len=max(args.sizes) + 1024, seed=0, enforce_eager=args.eager,
                  max_num_seqs=64, enable_chunk_cache=True, enable_prefix_caching=True)
    if args.gpu_memory_utilization:
        kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    if args.block_size:
        kwargs["block_size"] = args.block_size
    return kwargs


def _row(samples: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted({k for s in samples for k in s})
    return {k: round(statistics.median(s.get(k, 0.0) for s in samples), 3) for k in keys}


def _derived(wall: dict[str, float], total: float) -> dict[str, float]:
    """ms per phase plus the remainders: execute's and sample's rest, and `other`."""
    ms = {k: 1e3 * v for k, v in wall.items()}
    ms["ttft"] = 1e3 * total
    ex = ms.get("execute", 0.0)
    ms["execute.rest"] = ex - sum(ms.get(p, 0.0) for p in (
        "execute.state_update", "execute.prepare_inputs", "execute.attn_metadata",
        "execute.load", "execute.forward", "execute.capture"))
    ms["sample.rest"] = ms.get("sample", 0.0) - ms.get("sample.sample", 0.0) - \
        ms.get("sample.bookkeeping", 0.0)
    ms["add.rest"] = ms.get("add", 0.0) - sum(ms.get(p, 0.0) for p in (
        "add.render", "add.process_inputs", "add.request_hashing", "add.admission"))
    ms["other"] = ms["ttft"] - sum(ms.get(p, 0.0) for p in TOP)
    return ms


ORDER = ("ttft", "add", "add.render", "add.process_inputs", "add.request_hashing",
         "add.admission", "add.rest", "schedule", "schedule.connector_meta", "execute",
         "execute.state_update", "execute.prepare_inputs", "execute.attn_metadata",
         "execute.load", "execute.forward", "execute.capture", "execute.rest", "sample",
         "sample.sample", "sample.bookkeeping", "sample.rest", "output.update_from_output",
         "output.process_outputs", "other")


def table(size: int, rows: dict[str, dict], devices: dict[str, dict], cuda: bool) -> str:
    names = list(rows)
    lines = [f"size {size}: medians in ms (wall, unprofiled){'' if cuda else '; CUDA events n/a on cpu'}",
             f"{'phase':28s}" + "".join(f"{n:>12s}" for n in names)]
    for p in ORDER:
        lines.append(f"{p:28s}" + "".join(f"{rows[n].get(p, 0.0):12.3f}" for n in names))
    for p in DEVICE_TIMED:
        cells = "".join((f"{devices[n].get(p, 0.0):12.3f}" if cuda else f"{'n/a on cpu':>12s}")
                        for n in names)
        lines.append(f"{p + ' (cuda events)':28s}" + cells)
    return "\n".join(lines)


LEAVES = ("add.render", "add.process_inputs", "add.request_hashing", "add.admission", "add.rest",
          "schedule", "execute.state_update", "execute.prepare_inputs", "execute.attn_metadata",
          "execute.load", "execute.forward", "execute.capture", "execute.rest", "sample",
          "output.update_from_output", "output.process_outputs", "other")


def above_floor(size: int, block: int, rows: dict[str, dict], devices: dict[str, dict],
                cuda: bool) -> str:
    """The all-hit request's medians minus the floor's, per phase that adds up to the TTFT
    (`schedule` holds its connector metadata), largest first."""
    hit, floor = rows["all-hit"], rows["floor"]
    gap = hit.get("ttft", 0.0) - floor.get("ttft", 0.0)
    diffs = sorted(((hit.get(p, 0.0) - floor.get(p, 0.0), p) for p in LEAVES), reverse=True)
    parts = [f"{p} {d:+.2f}" for d, p in diffs if abs(d) >= 0.005][:8]
    dev = ("; cuda events load %.2f / forward %.2f ms (floor forward %.2f)" % (
        devices["all-hit"].get("execute.load", 0.0), devices["all-hit"].get("execute.forward", 0.0),
        devices["floor"].get("execute.forward", 0.0)) if cuda else "; cuda events n/a on cpu")
    return (f"above the floor {size} b{block}: all-hit {hit.get('ttft', 0.0):.2f} ms, floor "
            f"{floor.get('ttft', 0.0):.2f} ms, gap {gap:.2f} ms = " + ", ".join(parts) + dev)


@contextlib.contextmanager
def _scopes(on: bool):
    """vLLM's record_function scopes: on only under the profiler (the clocks stay unprofiled).
    NOTE: vllm.v1.utils caches its choice in _PROFILER_FUNC at the first call."""
    import vllm.v1.utils as vutils
    import torch
    before = vutils._PROFILER_FUNC
    vutils._PROFILER_FUNC = torch.profiler.record_function if on else contextlib.nullcontext
    try:
        yield
    finally:
        vutils._PROFILER_FUNC = before


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--sizes", default="8192,32768",
                    type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--block-size", type=int, default=0, help="0: vLLM's default")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.0)
    ap.add_argument("--trace-dir", default="", help="where the profiler traces go (gzip JSON)")
    ap.add_argument("--trace-sizes", default="", type=lambda s: [int(x) for x in s.split(",") if x],
                    help="the sizes traced (default: every size)")
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--plan", action="store_true", help="print the plan and exit")
    args = ap.parse_args(argv)
    if args.reps < 1 or min(args.sizes) < 64:
        ap.error("--reps >= 1 and every size >= 64 tokens")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CUSTOM_SCOPES_FOR_PROFILING"] = "1"
    kwargs = engine_kwargs(args)
    if args.plan:
        print(json.dumps({"plan": True, "engine": kwargs, "sizes": args.sizes, "reps": args.reps,
                          "phases": [p for p, _, _ in PHASES], "device_timed": DEVICE_TIMED,
                          "trace_dir": args.trace_dir or None,
                          "trace_sizes": args.trace_sizes or args.sizes}))
        return 0

    import torch
    from common import DOC_TOKENS, document, words
    from vllm import LLM, SamplingParams

    t0 = time.time()
    llm = LLM(**kwargs)
    cuda = torch.cuda.is_available() and \
        llm.llm_engine.vllm_config.device_config.device.type == "cuda"
    block = llm.llm_engine.vllm_config.cache_config.block_size
    print(json.dumps({"phase_clock_engine": True, "start_up_s": round(time.time() - t0, 1),
                      "block_size": block, "cuda_events": cuda, "vllm": _vllm_version()}),
          flush=True)
    clock = Clock(cuda=cuda)
    install(llm, clock)
    tok = llm.get_tokenizer()
    rng = random.Random(0)
    one = SamplingParams(max_tokens=1, temperature=0.0)

    def timed(prompt: str) -> tuple[dict[str, float], dict[str, float], dict[str, int], object]:
        clock.reset()
        t = time.perf_counter()
        out = llm.generate([prompt], one, use_tqdm=False)[0]
        total = time.perf_counter() - t
        return _derived(clock.wall, total), clock.device_ms(), dict(clock.counts), out

    for size in args.sizes:
        docs = [document(rng, tok) for _ in range(max(1, (size - 64) // DOC_TOKENS))]

        def prompt(question: str) -> str:
            order = rng.sample(range(len(docs)), len(docs))
            return " ## ".join(["answer from the documents", *[docs[i] for i in order],
                                "question: " + question])

        with _scopes(False):
            for _ in range(2):  # warm-up: every document is seen, the pool fills
                timed(prompt(words(rng, 12)))
            samples = {"all-hit": [], "floor": []}
            devs = {"all-hit": [], "floor": []}
            counts, outs = {}, {}
            for _ in range(args.reps):
                for name, p in (("all-hit", prompt(words(rng, 12))),
                                ("floor", "question: " + words(rng, 12))):
                    ms, dev, cnt, out = timed(p)
                    samples[name].append(ms)
                    devs[name].append(dev)
                    counts[name], outs[name] = cnt, out
        rows = {n: _row(s) for n, s in samples.items()}
        devices = {n: _row(d) if cuda else {} for n, d in devs.items()}
        for name in rows:
            out = outs[name]
            n_prompt = len(out.prompt_token_ids)
            counts[name].update(prompt_tokens=n_prompt, cached_tokens=out.num_cached_tokens or 0,
                                block_size=block, prompt_blocks=math.ceil(n_prompt / block))
        print(table(size, rows, devices, cuda), flush=True)
        for name in rows:
            print(f"counts {name}: " + ", ".join(f"{k} {v}" for k, v in counts[name].items()),
                  flush=True)
        print(json.dumps({"phase_clock": True, "size": size, "docs": len(docs), "reps": args.reps,
                          "block_size": block, "ms": rows,
                          "cuda_event_ms": devices if cuda else "n/a on cpu",
                          "counts": counts}), flush=True)
        print(above_floor(size, block, rows, devices, cuda), flush=True)
        if args.trace_dir and (not args.trace_sizes or size in args.trace_sizes):
            _traces(Path(args.trace_dir), size, block, cuda, {
                "all-hit": prompt(words(rng, 12)), "floor": "question: " + words(rng, 12)},
                llm, one)
    return 0


def _traces(out: Path, size: int, block: int, cuda: bool, prompts: dict[str, str], llm,
            one) -> None:
    """One profiled request of each kind, vLLM's scopes on; the chrome traces gzip'd."""
    from torch.profiler import ProfilerActivity, profile
    out.mkdir(parents=True, exist_ok=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    for name, p in prompts.items():
        with _scopes(True), profile(activities=acts) as prof:
            llm.generate([p], one, use_tqdm=False)
        raw = out / f"trace-{name}-{size}-b{block}.json"
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as f, gzip.open(str(raw) + ".gz", "wb") as g:
            g.write(f.read())
        raw.unlink()
        scopes = sorted({e.key for e in prof.key_averages()
                         if e.key.startswith(("gpu_model_runner:", "llm_engine step:"))})
        print(f"trace {name} {size}: {raw.name}.gz ({(out / (raw.name + '.gz')).stat().st_size} "
              f"bytes); vLLM scopes in it: {', '.join(scopes) or 'NONE'}", flush=True)


def _vllm_version() -> str:
    import vllm
    return getattr(vllm, "__version__", "?")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
