# SPDX-License-Identifier: Apache-2.0
"""A recorder of the chunk cache connector's scheduler hooks, driven by vLLM's own
Scheduler with no model (issue 51, deliverable 1).

`Transcript` wraps the hooks of the scheduler's connector instance and writes, per
step, every call's arguments that matter and its return: matched tokens, prefill
gaps, allocations, the metadata built (loads, stores, the store's fetches and puts),
finished requests, internal requests (ids and prompts), refusals with their
messages, and the stats increments. The model runner's part is a
`ModelRunnerOutput` as in vLLM's scheduler tests; the workers' store report is
played by the scenario (`on_step`).

Ids of internal requests end in 16 hex digits of a content key, and the key's
namespace names the model by its local path: each distinct run of 16 hex digits is
renamed `#0`, `#1`, ... in order of appearance, so that a transcript is the same
in every checkout.
"""

from __future__ import annotations

import dataclasses
import json
import re
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.conftest import models_dir

BLOCK = 16
SINK = 1
_HEX16 = re.compile(r"[0-9a-f]{16}")


@dataclasses.dataclass(frozen=True)
class SchedulerShape:
    """What a scenario's scheduler is built with."""

    recompute: int = 0
    one_step: bool = True
    num_gpu_blocks: int = 40
    pool_fraction: float = 0.5
    max_load: int = 16384
    store: str | None = None
    sliding_window: int | None = None
    priority: bool = False
    # Tokens per step (None: vLLM's default); a small budget prefills children in
    # pieces, so that one can be aborted half way.
    max_batched: int | None = None


def make_scheduler(shape: SchedulerShape, monkeypatch) -> Any:
    """VLLM's Scheduler with the chunk cache connector (as vLLM's
    tests/v1/core/utils.py builds one: an engine config, a KV cache config, no
    model)."""
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )
    from vllm.v1.structured_output import StructuredOutputManager

    monkeypatch.setenv("CHUNK_CACHE_RECOMPUTE_ONE_STEP", "1" if shape.one_step else "0")
    extra: dict[str, Any] = {}
    if shape.store is not None:
        extra["chunk_store"] = shape.store
    if shape.max_batched is not None:
        extra["max_num_batched_tokens"] = shape.max_batched
    config = EngineArgs(
        model=str(models_dir() / "tiny-llama"),
        dtype="float32",
        enforce_eager=True,
        max_model_len=1024,
        enable_chunk_cache=True,
        chunk_recompute_tokens=shape.recompute,
        enable_prefix_caching=True,
        chunk_pool_fraction=shape.pool_fraction,
        max_chunk_load_tokens=shape.max_load,
        scheduling_policy="priority" if shape.priority else "fcfs",
        **extra,
    ).create_engine_config()
    config.cache_config.block_size = BLOCK
    config.cache_config.num_gpu_blocks = shape.num_gpu_blocks
    init_none_hash(sha256)
    common = dict(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32)
    spec = (
        SlidingWindowSpec(sliding_window=shape.sliding_window, **common)
        if shape.sliding_window
        else FullAttentionSpec(**common)
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=shape.num_gpu_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)],
    )
    return Scheduler(
        config,
        kv_cache_config,
        StructuredOutputManager(config),
        block_size=BLOCK,
        log_stats=False,
    )


def make_request(
    rid: str, token_ids: list[int], layout=None, priority: int = 0, max_tokens: int = 1
):
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    return Request(
        rid,
        token_ids,
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        None,
        priority=priority,
        chunk_layout=layout,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )


def prompt(*parts: list[int]) -> tuple[list[int], tuple[int, ...]]:
    """A chunked prompt's token ids and its layout (each segment's length)."""
    return [t for p in parts for t in p], tuple(len(p) for p in parts)


def _plain(value: Any) -> Any:
    """JSON-able form of hook values (dataclasses, tuples, enums, bytes)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)
        }
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {
            str(k): _plain(v)
            for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))
        }
    if isinstance(value, (set, frozenset)):
        return sorted(_plain(v) for v in value)
    if isinstance(value, bytes):
        return value.hex()
    if hasattr(value, "value") and hasattr(value, "name"):  # an Enum
        return _plain(value.value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def engine_step(scheduler) -> Any:
    """One step as EngineCore.step runs it (engine_step_outputs); its scheduler
    output."""
    return engine_step_outputs(scheduler)[0]


def engine_step_outputs(scheduler) -> tuple[Any, dict[int, Any]]:
    """One step as EngineCore.step runs it: the connector's children added (patch
    0006), schedule, then the model runner's answer (a token for every request whose
    prompt is computed after this step, nothing for a prefill chunk). Returns the
    scheduler output and what update_from_output gives the clients (their
    EngineCoreOutputs by client index)."""
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.outputs import ModelRunnerOutput

    # NOTE: EngineCore's own method, on the two attributes it reads.
    EngineCore._add_internal_requests(
        types.SimpleNamespace(
            _internal_request_connector=scheduler.connector, scheduler=scheduler
        )
    )
    out = scheduler.schedule()
    ids = list(out.num_scheduled_tokens)
    sampled = []
    for rid in ids:
        r = scheduler.requests[rid]
        done = r.num_computed_tokens >= r.num_prompt_tokens  # advanced by schedule()
        sampled.append([5] if done else [])
    to_clients = scheduler.update_from_output(
        out,
        ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={rid: i for i, rid in enumerate(ids)},
            sampled_token_ids=sampled,
        ),
    )
    return out, to_clients


class Transcript:
    """Records the connector hooks of one scheduler, step by step."""

    HOOKS = (
        "get_num_new_matched_tokens",
        "get_prefill_gap",
        "update_state_after_alloc",
        "build_connector_meta",
        "request_finished",
        "take_internal_requests",
        "take_failed_requests",
        "update_connector_output",
        "reset_cache",
    )

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.connector = scheduler.connector
        self.steps: list[dict[str, Any]] = []
        self._events: list[Any] = []
        self._names: dict[str, str] = {}
        for hook in self.HOOKS:
            setattr(
                self.connector, hook, self._wrap(hook, getattr(self.connector, hook))
            )
        # NOTE: vLLM 0.32's update_from_output takes the scheduler side's stats
        # itself (0.23's does not): every take of a step is kept and summed as
        # vLLM sums them (counters added, the latest gauges), so both bases
        # record the step's increments.
        self._stats_taken: list[dict[str, Any]] = []
        take_stats = self.connector.get_kv_connector_stats

        def get_kv_connector_stats():
            stats = take_stats()
            if stats is not None:
                self._stats_taken.append(dict(stats.data))
            return stats

        self.connector.get_kv_connector_stats = get_kv_connector_stats

    # ------------------------------------------------------------ naming

    def _rename(self, text: str) -> str:
        def sub(m: re.Match) -> str:
            return self._names.setdefault(m.group(0), f"#{len(self._names)}")

        return _HEX16.sub(sub, text)

    def _norm(self, value: Any) -> Any:
        if isinstance(value, str):
            return self._rename(value)
        if isinstance(value, list):
            return [self._norm(v) for v in value]
        if isinstance(value, dict):
            return {self._rename(k): self._norm(v) for k, v in value.items()}
        return value

    # ---------------------------------------------------------- recording

    def _wrap(self, hook: str, fn: Callable) -> Callable:
        def recorded(*args, **kwargs):
            out = fn(*args, **kwargs)
            self._events.append(self._norm([hook, *self._describe(hook, args, out)]))
            return out

        return recorded

    def _describe(self, hook: str, args: tuple, out: Any) -> list[Any]:
        if hook in ("get_num_new_matched_tokens", "get_prefill_gap"):
            request, num_computed = args
            return [request.request_id, num_computed, _plain(out)]
        if hook == "update_state_after_alloc":
            request, blocks, num_external = args
            return [request.request_id, list(blocks.get_block_ids()[0]), num_external]
        if hook == "build_connector_meta":
            meta = out
            store = None
            if meta.store is not None:
                store = {
                    "epoch": meta.store.epoch,
                    "fetches": _plain(meta.store.fetches),
                    "puts": _plain(meta.store.puts),
                }
            return [
                {
                    "loads": _plain(meta.loads),
                    "stores": _plain(meta.stores),
                    "store": store,
                }
            ]
        if hook == "request_finished":
            request, _ = args
            return [request.request_id, request.status.name, _plain(out)]
        if hook == "take_internal_requests":
            return [
                [
                    {
                        "id": r.request_id,
                        "prompt": list(r.prompt_token_ids),
                        "priority": r.priority,
                        "salt": r.cache_salt,
                        "lora": None
                        if r.lora_request is None
                        else r.lora_request.lora_name,
                    }
                    for r in out
                ]
            ]
        if hook == "take_failed_requests":
            return [_plain(out)] if out else []
        if hook == "reset_cache":
            return [out]
        if hook == "update_connector_output":
            (output,) = args
            return [_plain(getattr(output, "kv_connector_worker_meta", None))]
        raise AssertionError(hook)

    # ------------------------------------------------------------- driving

    def step(self, on_step: Callable[[Any], Any] | None = None) -> Any:
        """One step as EngineCore.step runs it: internal requests added (patch 0006),
        schedule, the model runner's answer (a token for every request whose prompt
        is computed after this step), the workers' store report if `on_step` makes
        one from the scheduler output, then the connector's stats."""
        sched = self.scheduler
        out = engine_step(sched)
        report = on_step(out) if on_step is not None else None
        if report is not None:
            sched.connector.update_connector_output(
                types.SimpleNamespace(kv_connector_worker_meta=report)
            )
        stats = type(sched.connector.get_kv_connector_stats())(data={})
        for taken in self._stats_taken:  # in the order taken: later gauges win
            stats.aggregate(type(stats)(data=taken))
        self._stats_taken = []
        data = {k: v for k, v in stats.data.items() if not k.endswith("_seconds") and v}
        self.steps.append(
            self._norm(
                {
                    "scheduled": _plain(dict(out.num_scheduled_tokens)),
                    "preempted": sorted(out.preempted_req_ids or ()),
                    "hooks": _finishes_sorted(self._events),
                    "stats": _plain(data),
                }
            )
        )
        self._events = []
        return out

    def note(self, text: str) -> None:
        """A scenario's own action between steps (an abort, a reset): recorded
        with the hooks it calls, in the next step's record."""
        self._events.append(["note", text])


def _finishes_sorted(events: list[Any]) -> list[Any]:
    """Events with each run of consecutive `request_finished` calls in id order.

    NOTE: the parents refused for one child are kept in a set, so the order the
    scheduler finishes them in follows string hashing (PYTHONHASHSEED)."""
    out: list[Any] = []
    run: list[Any] = []
    for event in events + [None]:
        if event is not None and event[0] == "request_finished":
            run.append(event)
            continue
        out.extend(sorted(run, key=lambda e: e[1]))
        run = []
        if event is not None:
            out.append(event)
    return out


def check_golden(path: Path, transcript: list[dict[str, Any]], update: bool) -> None:
    text = json.dumps(transcript, indent=1, sort_keys=False) + "\n"
    if update or not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        raise AssertionError(
            f"wrote {path}: review it, then rerun without CHUNK_TRANSCRIPT_UPDATE"
        )
    want = json.loads(path.read_text())
    got = json.loads(text)
    for i, (w, g) in enumerate(zip(want, got)):
        assert g == w, f"step {i} differs:\nwant {json.dumps(w)}\ngot  {json.dumps(g)}"
    assert len(got) == len(want)
