# SPDX-License-Identifier: Apache-2.0
"""What the chunk cache can serve: the one owner of its start-up refusals.

A set-up under which a load or a capture would not give the chunk-isolation
semantics exactly is refused at start-up with a message naming it, never
served with a warning (or failing at the first request with a message about
something else). The checks run at the three moments where vLLM knows what
they need:

* `check_config`: the engine config (front end and engine core, before
  anything is built): features that change what a step computes;
* `kv_cache_block_size`: the KV cache layout (scheduler, once vLLM grouped
  the layers): one group of full or sliding-window attention;
* `check_attention_layer`: each attention layer (worker, once the model is
  built): standard attention, its own KV cache, a window only on a backend
  shown to apply it by position, a backend whose cache write the load can use.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from vllm.config import VllmConfig

CONNECTOR_NAME = "ChunkCacheConnector"
# kv_connector_extra_config key: whether captures may run in the attention
# hook (then vLLM must keep attention out of full CUDA graphs).
CAPTURE_IN_ATTENTION = "capture_in_attention"
# --kv-cache-dtype values that keep K/V in a model dtype (not quantized): the
# cache's bytes are the rows, so they can be read back and written as is.
UNQUANTIZED_KV_CACHE_DTYPES = (
    "auto",
    "bfloat16",
    "float16",
    "float32",
    "half",
    "float",
)

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
        # NOTE: a drafter (EAGLE, MTP, a draft model) has attention layers of
        # its own that the chunk cache neither captures nor loads, and
        # verification steps schedule tokens the load plan does not know.
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
    (read in vllm-ascend 0.23.0.post1; never executed on an NPU). The chunk
    cache's connector role, kv_both, counts as a PD producer AND consumer
    there, which switches on PD-only branches (docs/ascend.md)."""
    additional = getattr(vllm_config, "additional_config", None)
    additional = additional if isinstance(additional, dict) else {}
    xlite = additional.get("xlite_graph_config") or {}
    if isinstance(xlite, dict) and xlite.get("enabled", False):
        # NOTE: xlite runs the model in its own runtime (xlite_model.forward;
        # in full mode prefill too, in eager mode), never through vLLM's
        # Attention layers: nothing would capture a child's rows, and the
        # pool's zeros would be loaded into its parents.
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
        # NOTE: kvcomp keeps a hash of every key block, written by the
        # attention forward (reshape_and_cache_kvcomp); decode picks its top-k
        # blocks by those hashes. Rows the load writes get none: stale hashes.
        raise ValueError(
            "--enable-chunk-cache does not support vllm-ascend's hamming sparse "
            "attention (additional_config hamming_sparse / enable_hamming_sparse): "
            "decode picks key blocks by hashes the attention forward writes, and "
            "loaded rows get none, so it would select blocks by stale hashes"
        )
    pp = (
        getattr(
            getattr(vllm_config, "parallel_config", None), "pipeline_parallel_size", 1
        )
        or 1
    )
    if pp > 1:
        raise ValueError(
            f"--enable-chunk-cache does not support pipeline parallelism on Ascend NPUs "
            f"(--pipeline-parallel-size {pp}): its KV connector role (kv_both) makes "
            "vllm-ascend's model runner take a PD producer's branch and skip the "
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


def _sparse_mla_platform() -> bool:
    """Whether sparse MLA may start here: on vllm-ascend's NPU platform, whose SFA
    has indexer key writers (docs/design/sparse.md; never executed on an NPU)."""
    from vllm.platforms import current_platform

    return getattr(current_platform, "device_name", None) == "npu"


def _check_kv_transfer_config(current: Any) -> None:
    """Another connector is refused (vLLM has one connector slot); so is any
    setting of a --kv-transfer-config without one, or with ours: the chunk
    cache writes the whole config itself (setup.configure_chunk_cache_connector),
    so such a setting would be dropped without a word."""
    if current is None:
        return
    if current.kv_connector == "MultiConnector":
        # NOTE: MultiConnector forwards the chunk cache's hooks (patch 0019), but
        # its other connectors would load or save a chunked prompt's blocks
        # (chunk-isolated KV) as if they were a causal prefix.
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
        # NOTE: the config the chunk cache wrote (it always sets this key),
        # checked again where the config is built anew. Its defaults may not
        # be today's: kv_buffer_device's follows the platform.
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
        # NOTE: a pooled output (embedding, score, reward) covers every prompt
        # token; the connector reports every token before the question as
        # loaded, so mean or CLS pooling would see the question only, and
        # pooling requests ask vLLM to skip prefix-cache reads, which a load
        # is. Children (SamplingParams) cannot run on a pooling runner either.
        raise ValueError(
            "--enable-chunk-cache does not support pooling models (--runner "
            "pooling: embedding, classification, scoring, reward): a pooled "
            "output covers the whole prompt, which the chunk cache does not "
            "compute"
        )
    hf_config = getattr(model_config, "hf_config", None)
    if (
        getattr(model_config, "use_mla", False)
        and (getattr(hf_config, "index_topk", None) is not None)
        and not _sparse_mla_platform()
    ):
        # NOTE: only vllm-ascend's SFA has indexer key writers (its overlay);
        # there each layer is checked when the worker builds it (LatentLayer.of,
        # chunk_cache_npu.check_sfa_layer). Elsewhere: vLLM's DSA keeps the
        # indexer keys in a cache layer of their own, always fp8, quantized after
        # the rope: not translation-invariant, so not exact (docs/design/sparse.md).
        raise ValueError(
            "--enable-chunk-cache does not support sparse MLA attention yet "
            "(DeepSeek-V3.2's DSA on CUDA: its fp8 indexer key cache, quantized after "
            "the rope, is not translation-invariant; the CPU has no sparse attention) "
            "outside vllm-ascend's SFA with a bf16 indexer cache (its other variants "
            "and AscendDSAImpl refused by name): docs/design/sparse.md"
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
            # NOTE: each rank then holds every n-th token of a request; a load
            # writes whole segments into one rank's blocks.
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
    """The paged block size of the single KV cache group of full or
    sliding-window attention (docs/design/sliding-window.md); refuses every
    other layout, naming its layers and the reason. Whether a window shorter
    than max_model_len is served is decided per layer by
    `check_attention_layer`."""
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
    # NOTE: a sliding window kept in a FullAttentionSpec (vLLM's hybrid
    # allocator off, which a KV connector implies: the layers of a model
    # mixing windowed and full layers) keeps every block; each windowed layer's
    # kernel applies its window by position, which is what the windowed
    # isolation semantics say (docs/design/sliding-window.md). A
    # SlidingWindowSpec (every layer windowed) makes vLLM's SlidingWindowManager
    # replace the blocks out of every later token's window by its null block:
    # nothing a token reads is freed, and a load skips the rows of those
    # blocks (scheduler_adapter._add_loads). Chunked-local attention restarts
    # its window at absolute multiples of the chunk size: not
    # translation-invariant.
    chunked = getattr(spec, "attention_chunk_size", None)
    # MLA's latent cache is full attention too (one latent row per token);
    # its layers are checked by the worker (cache_writers' latent writers).
    if chunked is not None or type(spec) not in (
        FullAttentionSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    ):
        detail = f", chunk size {chunked}" if chunked is not None else ""
        reason = (
            "chunked-local attention restarts at absolute positions"
            if chunked is not None
            else "attention-sink, state-space or other layers"
        )
        layers = groups[0].layer_names
        named = ", ".join(layers[:2]) + (
            f" and {len(layers) - 2} more" if len(layers) > 2 else ""
        )
        raise ValueError(
            "--enable-chunk-cache supports full and sliding-window attention; the KV "
            f"cache of layer(s) {named} is {type(spec).__name__}{detail} ({reason})"
        )
    return spec.block_size


# Backends whose kernels were shown to apply a sliding window by position with
# the chunk cache's loads: CPU_ATTN end to end (the family matrix,
# tests/e2e/test_model_families*.py); TRITON_ATTN's kernel under Triton's
# interpreter on the CPU, on both bases, against a float64 windowed oracle, over a
# step whose rows hold loaded rests and earlier runs
# (tests/unit/v1/worker/test_query_runs_triton_attn.py).
# NOTE (issue 52): TRITON_ATTN and FLASH_ATTN were executed windowed on one H200 on
# 2026-11-28 (tools/gpu/issue40.sh items window-triton and window-fa: a Mistral with
# a 24-key window on every layer, fp16, eager, vLLM 0.23): worst |dlogprob| against
# the HF windowed isolation reference 0.0200 and 0.0180, within 1.01x and 0.93x of
# stock vLLM against the HF causal forward (docs/gpu.md). Compiled graphs were not
# run windowed; the kernel's window mask is the same there.
WINDOWED_BACKENDS = (
    "CPUAttentionBackendImpl",
    "TritonAttentionImpl",
    "FlashAttentionImpl",
)


def check_attention_layer(
    name: str, layer: Any, max_model_len: int | None = None
) -> None:
    """Refuse an attention layer whose keys the chunk cache cannot load. A
    sliding window of at least `max_model_len` keys is full attention."""
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.cache_writers import (
        supported_backends,
        writer_for,
    )

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
        # NOTE: the windowed isolation semantics (docs/design/sliding-window.md)
        # hold where the kernel applies the window by position over a cache
        # that keeps every block: shown on CPU_ATTN; other backends unverified.
        backend = type(getattr(layer, "impl", None)).__name__
        if backend not in WINDOWED_BACKENDS:
            raise ValueError(
                f"chunk cache does not support sliding-window attention ({name}, window "
                f"{window}) on the attention backend {backend}: windowed layers are "
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
        # NOTE: the capture reads the rows back from the cache (the connector
        # gets no kv_c / k_pe), exact only where they are stored unquantized.
        raise ValueError(
            f"chunk cache supports MLA latent caches in the model dtype only; {name} "
            f"({type(layer.impl).__name__}) has --kv-cache-dtype {layer.kv_cache_dtype}"
        )
    if writer.check_layer is not None:
        writer.check_layer(name, layer)


def _choose_instead(layer: Any) -> str:
    """Which backend to start with instead of the refused one: the supported MLA
    backends users of this platform pick by name (issue 59: vLLM 0.32 picks
    AMX_MLA on CPUs with AMX tiles unless CPU_MLA is asked for)."""
    from vllm.platforms import current_platform

    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.cache_writers import (
        supported_latent_backends,
    )

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
    """Refuse CUDA-graph modes under which a capture in the attention hook
    (the layers in `hooked`, with why: capture_path.py) would be recorded
    into a graph and replayed with stale indices instead of running eagerly.
    Captures after the forward run outside any graph: no constraint."""
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


# CUDA backends whose metadata builders take the runs of a one-step boundary
# recompute as rows (tests/unit/v1/worker/test_query_runs_triton_attn.py).
CUDA_QUERY_RUN_BACKENDS = ("FlashAttentionImpl", "TritonAttentionImpl")


def check_query_runs(
    one_step: bool,
    layers: dict[str, Any],
    compilation_config: Any,
    platform: Any,
    speculative_config: Any = None,
    max_num_seqs: int | None = None,
) -> str | None:
    """Refuse at start-up, by name, what a one-step boundary recompute (query
    runs, recompute_step.py) on CUDA cannot run on: an attention backend other
    than FLASH_ATTN / TRITON_ATTN, speculative decoding, or a CUDA-graph mode
    that replays full graphs for mixed batches (FULL). `layers`: the attention
    layers by name. Returns what the start-up line says on CUDA (None
    elsewhere).

    NOTE (read in vLLM's CudagraphDispatcher, 0.23 and 0.32; tested with it in
    tests/unit/v1/worker/test_query_runs_dispatch.py): full graphs are keyed
    by uniform-decode batches under FULL_AND_PIECEWISE (vLLM's default) and
    FULL_DECODE_ONLY, and a step with runs has a request with >= 2 scheduled
    tokens, so it dispatches PIECEWISE (FULL_DECODE_ONLY: eager), or eager above
    the largest capture size; the model runner refuses a full-graph dispatch of
    such a step all the same (query_runs.check_runs_dispatch). Under FULL every
    batch up to the largest capture size replays a full graph."""
    if not one_step or not platform.is_cuda():
        return None
    how = (
        "--chunk-recompute-tokens in one step (CHUNK_CACHE_RECOMPUTE_ONE_STEP=1) on "
        "CUDA"
    )
    if speculative_config is not None:
        # NOTE: a runs step of query length 1 + k could be classed as a uniform
        # decode batch (full graph), and draft tokens are scheduled per request.
        raise ValueError(
            f"{how} does not support speculative decoding (--speculative-config): "
            "draft tokens are scheduled per request and a step of 1 + k tokens per "
            "request may replay a full CUDA graph; unset CHUNK_CACHE_RECOMPUTE_ONE_STEP "
            "for one step per chunk head"
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
        return f"every head and the question in one step on {named}, eager (no CUDA graphs)"
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


# Scheduler classes that replace schedule() but call vLLM's own under some
# configs (qualified class name -> predicate on the VllmConfig), registered
# by a platform's glue (chunk_cache_npu: vllm-ascend's BalanceScheduler).
_DELEGATING_SCHEDULERS: dict[str, Callable[[Any], bool]] = {}


def register_delegating_scheduler(
    qualname: str, runs_vllm_schedule: Callable[[Any], bool]
) -> None:
    """`qualname`'s schedule() calls the next one in its MRO (super()) when
    `runs_vllm_schedule(vllm_config)` is true."""
    _DELEGATING_SCHEDULERS[qualname] = runs_vllm_schedule


def _vllm_scheduler(cls: type) -> type | None:
    """VLLM's own Scheduler class among `cls`'s bases. NOTE: found in the MRO,
    never as `vllm.v1.core.sched.scheduler.Scheduler`, which a plugin may
    rebind (vllm-ascend's patch_balance_schedule binds its BalanceScheduler)."""
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
    """The scheduler class must be vLLM's or derive from it (the connector
    calls of its schedule(): get_num_new_matched_tokens, allocation,
    build_connector_meta). The children of chunked requests are added by
    EngineCore before every schedule() (patch 0006), whatever class runs.
    Boundary recompute needs more: vLLM's own schedule(), which asks the
    connector for prefill gaps (patch 0012). One that replaces it (e.g.
    vllm-ascend's SchedulerDynamicBatch, ProfilingChunkScheduler, or its
    BalanceScheduler with balance scheduling on) would compute the stretches
    the cache should load, with another attention: refused at start-up."""
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
