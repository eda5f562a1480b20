# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the chunk cache can serve: the one owner of its start-up refusals.

A set-up under which a load or a capture would not be exact is refused at
start-up, by name, where vLLM first knows it: `check_config` (the engine
config), `kv_cache_block_size` (the KV cache groups, in the scheduler) and
`check_attention_layer` (each built layer, in the worker).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

CONNECTOR_NAME = "ChunkCacheConnector"
# kv_connector_extra_config key: whether captures may run in the attention hook.
CAPTURE_IN_ATTENTION = "capture_in_attention"
# --kv-cache-dtype values that keep K/V unquantized: rows read back as written.
UNQUANTIZED_KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32")

# Config keys of models that skip RoPE on some layers (NoPE layers).
_NOPE_CONFIG_KEYS = ("no_rope_layers", "use_rope_layers", "nope_layer_interval")


def check_config(vllm_config: VllmConfig) -> None:
    """Refuse engine options and model kinds the chunk cache cannot serve."""
    if vllm_config.cache_config.kv_offloading_size is not None:
        raise ValueError(
            "--enable-chunk-cache cannot be combined with --kv-offloading-size: "
            "both need vLLM's single KV connector slot"
        )
    _check_kv_transfer_config(vllm_config.kv_transfer_config)
    model_config = vllm_config.model_config
    if model_config is not None:
        _check_model_kind(model_config)
    if getattr(vllm_config, "speculative_config", None) is not None:
        raise ValueError(
            "--enable-chunk-cache does not support speculative decoding "
            "(--speculative-config): drafter layers would attend to chunks the "
            "cache never loaded into them"
        )
    _check_parallelism(getattr(vllm_config, "parallel_config", None))
    from vllm.platforms import current_platform

    if getattr(current_platform, "device_type", None) == "npu":
        _check_ascend_options(vllm_config)


def _check_ascend_options(vllm_config: VllmConfig) -> None:
    """vllm-ascend's options under which a load or a capture would not be exact
    (read in vllm-ascend 0.23.0.post1, never executed; the connector's kv_both
    role switches on its PD-only branches: docs/ascend.md)."""
    additional = getattr(vllm_config, "additional_config", None)
    additional = additional if isinstance(additional, dict) else {}
    xlite = additional.get("xlite_graph_config") or {}
    if isinstance(xlite, dict) and xlite.get("enabled", False):
        mode = "full" if xlite.get("full_mode", False) else "decode-only"
        raise ValueError(
            f"--enable-chunk-cache does not support vllm-ascend's xlite graph mode "
            f"(additional_config xlite_graph_config.enabled, {mode} mode): xlite "
            "computes attention in its own runtime, outside vLLM's attention layers, "
            "so the chunk cache could neither capture nor load a segment's KV"
        )
    hamming = additional.get("hamming_sparse") or {}
    if additional.get("enable_hamming_sparse") or (
        isinstance(hamming, dict) and hamming.get("enabled")
    ):
        raise ValueError(
            "--enable-chunk-cache does not support vllm-ascend's hamming sparse "
            "attention (additional_config hamming_sparse / enable_hamming_sparse): "
            "decode picks key blocks by hashes the attention forward writes, and "
            "loaded rows get none, so it would select blocks by stale hashes"
        )
    parallel_config = getattr(vllm_config, "parallel_config", None)
    pp = getattr(parallel_config, "pipeline_parallel_size", 1) or 1
    if pp > 1:
        raise ValueError(
            "--enable-chunk-cache does not support pipeline parallelism on Ascend "
            f"NPUs (--pipeline-parallel-size {pp}): its KV connector role (kv_both) "
            "makes vllm-ascend's model runner take a PD producer's branch and skip the "
            "async-scheduling broadcast of sampled tokens to the other stages"
        )
    quant = getattr(vllm_config, "quant_config", None)
    if getattr(quant, "enable_fa_quant", False):
        raise ValueError(
            "--enable-chunk-cache does not support checkpoints with vllm-ascend's "
            "fa_quant (fa_quant_type): as a KV consumer (kv_both) vllm-ascend keeps an "
            "int8/fp8 latent cache, which the chunk cache can neither read back nor "
            "write"
        )
    description = getattr(quant, "quant_description", None)
    description = description if isinstance(description, dict) else {}
    if any(value == "W8A8_MIX" for value in description.values()):
        raise ValueError(
            "--enable-chunk-cache does not support vllm-ascend's W8A8_MIX (PD-mix) "
            "checkpoints: as a KV consumer (kv_both) they would switch to the decode "
            "node's static quantization for every token, unlike the same model served "
            "without the chunk cache"
        )


def _check_kv_transfer_config(current: Any) -> None:
    """Another connector is refused (vLLM has one slot), and so is any other
    --kv-transfer-config setting: the chunk cache writes the config itself."""
    if current is None:
        return
    if current.kv_connector == "MultiConnector":
        raise ValueError(
            "--enable-chunk-cache cannot be combined with --kv-transfer-config "
            "(connector 'MultiConnector'): another connector would load or save "
            "a chunked prompt's chunk-isolated KV as causal KV"
        )
    if current.kv_connector not in (None, CONNECTOR_NAME):
        raise ValueError(
            "--enable-chunk-cache cannot be combined with --kv-transfer-config "
            f"(connector {current.kv_connector!r}): the chunk cache uses vLLM's "
            "single KV connector slot"
        )
    if (
        current.kv_connector == CONNECTOR_NAME
        and CAPTURE_IN_ATTENTION in current.kv_connector_extra_config
    ):
        # The config the chunk cache wrote, built anew (its defaults may differ).
        return
    import dataclasses

    default = type(current)()
    given = [
        f.name
        for f in dataclasses.fields(current)
        if f.name not in ("kv_connector", "kv_role", "engine_id")
        and getattr(current, f.name) != getattr(default, f.name)
    ]
    if current.kv_role not in (None, "kv_both"):
        given.append("kv_role")
    if given:
        raise ValueError(
            "--enable-chunk-cache configures vLLM's KV connector itself, so "
            f"--kv-transfer-config's {', '.join(given)} would be ignored: leave "
            "--kv-transfer-config out"
        )


def _check_model_kind(model_config: Any) -> None:
    runner = getattr(model_config, "runner_type", "generate")
    if runner == "pooling":
        raise ValueError(
            "--enable-chunk-cache does not support pooling models (--runner "
            "pooling: embedding, classification, scoring, reward): a pooled "
            "output covers the whole prompt, which the chunk cache does not "
            "compute"
        )
    hf_config = getattr(model_config, "hf_config", None)
    if getattr(model_config, "use_mla", False) and (
        getattr(hf_config, "index_topk", None) is not None
    ):
        from vllm.platforms import current_platform

        # Sparse MLA starts on vllm-ascend's NPU only (its SFA).
        if getattr(current_platform, "device_name", None) != "npu":
            raise ValueError(
                "--enable-chunk-cache does not support sparse MLA attention yet "
                "(DeepSeek-V3.2's DSA on CUDA: its fp8 indexer key cache, quantized "
                "after the rope, is not translation-invariant; the CPU has no sparse "
                "attention) outside vllm-ascend's SFA with a bf16 indexer cache (its "
                "other variants and AscendDSAImpl refused by name): "
                "docs/design/sparse.md"
            )
    if getattr(model_config, "is_encoder_decoder", False):
        raise ValueError(
            "--enable-chunk-cache does not support encoder-decoder models "
            "(cross-attention KV is not a prompt segment the cache can reuse)"
        )
    if getattr(model_config, "is_multimodal_model", False):
        raise ValueError(
            "--enable-chunk-cache does not support multimodal models yet "
            "(M-RoPE positions are not linear in the token index)"
        )
    if hf_config is not None:
        check_model_config(hf_config)


def _check_parallelism(parallel_config: Any) -> None:
    if parallel_config is None:
        return
    for name, flag in (
        ("decode_context_parallel_size", "--decode-context-parallel-size"),
        ("prefill_context_parallel_size", "--prefill-context-parallel-size"),
    ):
        if (getattr(parallel_config, name, 1) or 1) > 1:
            raise ValueError(
                f"--enable-chunk-cache does not support context parallelism "
                f"({flag} {getattr(parallel_config, name)}): a request's KV is "
                "split across ranks by token, a cached segment is not"
            )
    if (
        getattr(parallel_config, "enable_dbo", False)
        or (getattr(parallel_config, "ubatch_size", 1) or 1) > 1
    ):
        raise ValueError(
            "--enable-chunk-cache does not support dual-batch overlap / micro-batching "
            "(--enable-dbo, --ubatch-size): a step's loads and captures are planned "
            "for the whole batch, not per micro-batch"
        )


def check_model_config(hf_config: Any) -> None:
    """Refuse models whose config selects NoPE layers (some layers skip
    RoPE): the layer-to-rope map could not be trusted."""
    for cfg in (hf_config, getattr(hf_config, "text_config", None)):
        if cfg is None:
            continue
        for key in _NOPE_CONFIG_KEYS:
            if getattr(cfg, key, None) not in (None, [], 0):
                raise ValueError(
                    f"chunk cache does not support models whose config sets {key} "
                    "(layers without RoPE chosen per layer)"
                )


def kv_cache_block_size(kv_cache_config: KVCacheConfig) -> int:
    """The block size of the single KV cache group of full or sliding-window
    attention; every other layout is refused, naming its layers."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(
            f"--enable-chunk-cache supports models with one KV cache group; this "
            f"model has {len(groups)} (e.g. sliding-window or hybrid attention "
            "layers), which the chunk cache cannot re-position yet"
        )
    spec = groups[0].kv_cache_spec
    # Windowed specs and vLLM's null blocks: docs/design/sliding-window.md.
    chunked = getattr(spec, "attention_chunk_size", None)
    served = (FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec)
    if chunked is not None or type(spec) not in served:
        reason = (
            f", chunk size {chunked} (chunked-local attention restarts at absolute "
            "positions)"
            if chunked is not None
            else " (attention-sink, state-space or other layers)"
        )
        layers = groups[0].layer_names
        more = f" and {len(layers) - 2} more" if len(layers) > 2 else ""
        raise ValueError(
            "--enable-chunk-cache supports full and sliding-window attention; the KV "
            f"cache of layer(s) {', '.join(layers[:2])}{more} is "
            f"{type(spec).__name__}{reason}"
        )
    return spec.block_size


# Backends shown to apply a sliding window by position with the chunk cache's
# loads (docs/design/sliding-window.md, docs/gpu.md).
WINDOWED_BACKENDS = (
    "CPUAttentionBackendImpl",
    "TritonAttentionImpl",
    "FlashAttentionImpl",
)


def check_attention_layer(
    name: str, layer: Any, max_model_len: int | None = None
) -> None:
    """Refuse an attention layer whose keys the chunk cache cannot load (a
    window of at least `max_model_len` keys is full attention)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.cache_writers import (
        supported_backends,
        writer_for,
    )
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    if isinstance(layer, MLAAttention):
        _check_latent_layer(name, layer)
        return
    if not isinstance(layer, Attention):
        raise ValueError(
            f"chunk cache supports standard attention layers only; "
            f"{name} is {type(layer).__name__}"
        )
    target = getattr(layer, "kv_sharing_target_layer_name", None)
    if target is not None:
        raise ValueError(
            f"chunk cache does not support KV-sharing layers: {name} reuses the KV "
            f"cache of {target} and computes no keys of its own to capture"
        )
    window = getattr(layer, "sliding_window", None)
    if window is not None and (max_model_len is None or window < max_model_len):
        backend = type(getattr(layer, "impl", None)).__name__
        if backend not in WINDOWED_BACKENDS:
            raise ValueError(
                "chunk cache does not support sliding-window attention "
                f"({name}, window {window}) on the attention backend {backend}: "
                "windowed layers are "
                f"shown exact on {', '.join(WINDOWED_BACKENDS)} only (a window of at "
                "least --max-model-len keys is full attention and is served anywhere)"
            )
    if writer_for(layer.impl) is None:
        raise ValueError(
            f"chunk cache does not support the attention backend of {name} "
            f"({type(layer.impl).__name__}); supported: "
            f"{', '.join(supported_backends())} (choose one with "
            "--attention-backend)"
        )


def _check_latent_layer(name: str, layer: Any) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.cache_writers import (
        latent_writer_for,
        supported_latent_backends,
    )

    writer = latent_writer_for(layer.impl)
    if writer is None:
        raise ValueError(
            f"chunk cache does not support the MLA backend of {name} "
            f"({type(layer.impl).__name__}); supported: "
            f"{', '.join(supported_latent_backends())} ({_choose_instead(layer)}; "
            "the other MLA backends, sparse MLA and Ascend's are not built: "
            "docs/design/mla.md)"
        )
    if getattr(layer, "kv_cache_dtype", "auto") != "auto":
        raise ValueError(
            f"chunk cache supports MLA latent caches in the model dtype only; {name} "
            f"({type(layer.impl).__name__}) has --kv-cache-dtype {layer.kv_cache_dtype}"
        )
    if writer.check_layer is not None:
        writer.check_layer(name, layer)


def _choose_instead(layer: Any) -> str:
    """What to start with instead of the refused MLA backend, by name (vLLM 0.32
    picks AMX_MLA on CPUs with AMX tiles unless CPU_MLA is asked for)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.cache_writers import (
        supported_latent_backends,
    )
    from vllm.platforms import current_platform

    backend = getattr(layer, "attn_backend", None)
    refused = backend.get_name() if backend is not None else type(layer.impl).__name__
    here = supported_latent_backends(current_platform.device_type)
    if not here:
        return "choose one with --attention-backend"
    return (
        f"{refused} is not one of them: on this platform "
        f"({current_platform.device_type}) start with --attention-backend "
        + " or ".join(here)
    )


def check_graph_mode(compilation_config: Any, hooked: dict[str, str]) -> None:
    """Refuse CUDA-graph modes that would record a capture in the attention
    hook (`hooked`: layer -> why, capture_path.py) and replay stale indices."""
    from vllm.config.compilation import CUDAGraphMode

    mode = getattr(compilation_config, "cudagraph_mode", None)
    if not hooked or mode is None or mode == CUDAGraphMode.NONE:
        return
    which = (
        f"layer(s) {sorted(hooked)[:3]} capture in the attention hook "
        f"({next(iter(hooked.values()))})"
    )
    if mode.has_full_cudagraphs():
        raise ValueError(
            f"chunk cache does not support cudagraph_mode={mode.name} here: {which}, "
            "which a full CUDA graph would capture; use PIECEWISE or --enforce-eager"
        )
    if not getattr(compilation_config, "use_inductor_graph_partition", False) and (
        "vllm::unified_attention_with_output"
        not in (getattr(compilation_config, "splitting_ops", None) or [])
    ):
        raise ValueError(
            f"chunk cache needs attention outside the captured CUDA graphs: {which}; "
            "compilation_config.splitting_ops must contain "
            "vllm::unified_attention_with_output (vLLM's default), or use "
            "--enforce-eager"
        )


# CUDA backends whose metadata builders take a step's query runs as rows.
CUDA_QUERY_RUN_BACKENDS = ("FlashAttentionImpl", "TritonAttentionImpl")


def check_query_runs(
    one_step: bool,
    layers: dict[str, Any],
    compilation_config: Any,
    platform: Any,
    speculative_config: Any = None,
    max_num_seqs: int | None = None,
) -> str | None:
    """Refuse what query runs on CUDA cannot run on: an attention backend other
    than FLASH_ATTN / TRITON_ATTN, speculative decoding, or cudagraph_mode FULL
    (full graphs for mixed batches too). Returns the start-up line on CUDA.
    Why one step: docs/design/boundary-recompute.md, section "Why one step"."""
    if not one_step or not platform.is_cuda():
        return None
    how = (
        "--chunk-recompute-tokens in one step (CHUNK_CACHE_RECOMPUTE_ONE_STEP=1) on "
        "CUDA"
    )
    if speculative_config is not None:
        raise ValueError(
            f"{how} does not support speculative decoding (--speculative-config): "
            "draft tokens are scheduled per request and a step of 1 + k tokens per "
            "request may replay a full CUDA graph; unset "
            "CHUNK_CACHE_RECOMPUTE_ONE_STEP for one step per chunk head"
        )
    backends = set()
    for name, layer in layers.items():
        backend = type(getattr(layer, "impl", None)).__name__
        if backend not in CUDA_QUERY_RUN_BACKENDS:
            raise ValueError(
                f"{how} needs FLASH_ATTN or TRITON_ATTN: attention layer {name} runs "
                f"{backend} (choose one with --attention-backend, or unset "
                "CHUNK_CACHE_RECOMPUTE_ONE_STEP for one step per chunk head)"
            )
        backends.add(backend)
    mode = getattr(compilation_config, "cudagraph_mode", None)
    named = ", ".join(sorted(backends)) or "no attention layers"
    if mode is None or mode.name == "NONE":
        return (
            f"every head and the question in one step on {named}, eager (no CUDA "
            "graphs)"
        )
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.core.sched.prefill_runs import max_query_rows

    if mode.mixed_mode() == CUDAGraphMode.FULL:
        raise ValueError(
            f"{how} does not support cudagraph_mode={mode.name}: it replays a full "
            "CUDA graph for mixed prefill-decode batches too, whose attention rows "
            "are fixed at capture (one per request), and a step's query runs "
            "outnumber its requests; use vLLM's default FULL_AND_PIECEWISE (full "
            "graphs for decode batches only), PIECEWISE, FULL_DECODE_ONLY or "
            "--enforce-eager"
        )
    capture = getattr(compilation_config, "max_cudagraph_capture_size", None)
    runs_as = "PIECEWISE" if mode.mixed_mode() == CUDAGraphMode.PIECEWISE else "eager"
    line = (
        f"every head and the question in one step on {named}, "
        f"cudagraph_mode={mode.name}: a step with query runs runs {runs_as}"
        + (f" (eager above {capture} tokens)" if runs_as == "PIECEWISE" else "")
    )
    rows = max_query_rows(max_num_seqs or 0, compilation_config)
    if rows is not None:
        line += (
            f"; its attention rows capped at {rows} per step (FlashAttention 3's "
            "scheduler-metadata buffer under full graphs: later runs wait a step)"
        )
    return line


# Qualified names of scheduler classes whose schedule() calls vLLM's own under
# some configs -> that predicate on the VllmConfig (registered by chunk_cache_npu).
_DELEGATING_SCHEDULERS: dict[str, Callable[[Any], bool]] = {}


def register_delegating_scheduler(
    qualname: str, runs_vllm_schedule: Callable[[Any], bool]
) -> None:
    """`qualname`'s schedule() calls the next one in its MRO (super()) when
    `runs_vllm_schedule(vllm_config)` is true."""
    _DELEGATING_SCHEDULERS[qualname] = runs_vllm_schedule


def _vllm_scheduler(cls: type) -> type | None:
    """VLLM's own Scheduler class in `cls`'s MRO (found by name: a plugin may
    rebind `vllm.v1.core.sched.scheduler.Scheduler`)."""
    for base in getattr(cls, "__mro__", ()):
        if (
            base.__module__ == "vllm.v1.core.sched.scheduler"
            and base.__qualname__ == "Scheduler"
        ):
            return base
    return None


def _foreign_schedule(cls: type, vllm_config: Any) -> type | None:
    """The class whose own schedule() runs instead of vLLM's (compared as
    function objects), or None if vLLM's runs (directly or through
    registered delegating overrides)."""
    original = _vllm_scheduler(cls)
    for base in cls.__mro__:
        if "schedule" not in vars(base):
            continue
        if base is original:
            return None
        rule = _DELEGATING_SCHEDULERS.get(f"{base.__module__}.{base.__qualname__}")
        if rule is None or not rule(vllm_config):
            return base
    return cls


def check_scheduler(vllm_config: VllmConfig) -> None:
    """The scheduler class must be vLLM's or derive from it (its schedule()
    calls the connector). Boundary recompute needs vLLM's own schedule(), which
    asks for prefill gaps: one that replaces it (vllm-ascend's
    SchedulerDynamicBatch, ...) would compute the stretches the cache loads."""
    cls = vllm_config.scheduler_config.get_scheduler_cls()
    name = getattr(cls, "__qualname__", str(cls))
    if not isinstance(cls, type) or _vllm_scheduler(cls) is None:
        raise ValueError(
            f"--enable-chunk-cache needs vLLM's scheduler or a subclass of it; the "
            f"scheduler class {name} is neither"
        )
    if vllm_config.chunk_cache_config.chunk_recompute_tokens == 0:
        return
    foreign = _foreign_schedule(cls, vllm_config)
    if foreign is not None:
        raise ValueError(
            f"--chunk-recompute-tokens needs vLLM's own scheduler; the scheduler "
            f"class {name} runs the schedule() of {foreign.__module__}."
            f"{foreign.__qualname__}, which would not load the cached parts of a "
            "chunk between recomputed ones. Use the default scheduler or "
            "--chunk-recompute-tokens 0"
        )
