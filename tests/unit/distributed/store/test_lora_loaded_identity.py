"""Issue 50, finding 6: the store names a LoRA adapter by the weights the workers
loaded, not by its files. A real scheduler half (adapter, manager, StoreClient) and a
real worker store path (StoreTransfers) whose model carries a LoRA manager; the
adapter's files are loaded into `LoRAModel`s the way a worker holds them. The oracle
is what was loaded: two entries computed with the same loaded weights carry one
identity, entries computed with other weights another."""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.scheduler_adapter import (
    ChunkCacheSchedulerAdapter,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.connection import (
    SharedStore,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.messages import (
    StoreStep,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.transfers import (
    StoreTransfers,
)
from vllm.lora.lora_model import LoRAModel
from vllm.lora.lora_weights import LoRALayerWeights
from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.v1.core.chunk_store_probe import StoreAnswer, StoreLookup
from vllm.v1.request import Request, RequestStatus

from tests.unit.distributed.store.test_store_transfers import (
    LateScatterStore,
    drain_puts,
    rank,
    small_pool,
    wait_identity,
)
from tests.unit.distributed.test_chunk_cache_scheduler_adapter import (
    finish,
    make_config,
)

WEIGHTS = "adapter_model.safetensors"


def write_adapter(path, seed: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(
        json.dumps(
            {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "peft_type": "LORA"}
        )
    )
    g = torch.Generator().manual_seed(seed)
    save_file(
        {
            "base_model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(
                4, 64, generator=g
            ),
            "base_model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(
                64, 4, generator=g
            ),
        },
        str(path / WEIGHTS),
    )


def load_adapter(path, lora_id: int) -> LoRAModel:
    """The files read into a LoRAModel, as a worker's loader does when it loads."""
    t = load_file(str(path / WEIGHTS))
    name = "model.layers.0.self_attn.q_proj"
    a = t[f"base_model.{name}.lora_A.weight"]
    b = t[f"base_model.{name}.lora_B.weight"]
    return LoRAModel(lora_id, 4, {name: LoRALayerWeights(name, 4, 8, a, b)})


class LoraManager:
    """Stands in for vLLM's LoRAModelManager: `_add_adapter` registers a loaded
    adapter under its id (a load, or a reload after an eviction)."""

    def __init__(self):
        self.registered: dict[int, LoRAModel] = {}

    def _add_adapter(self, lora: LoRAModel) -> None:
        self.registered[lora.id] = lora


class Model(nn.Linear):
    def __init__(self):
        super().__init__(1, 1)
        self.lora_manager = LoraManager()


class AlwaysMiss:
    def lookup(self, segment_ids, context_ids, namespace):
        return StoreLookup(StoreAnswer.MISS)


def test_the_store_names_an_adapter_by_what_the_worker_loaded(tmp_path):
    store = LateScatterStore()
    store.stuck_first_get = False
    model = Model()
    shared = SharedStore("mooncake://127.0.0.1:1?arena=1MB&local_client=none")
    shared.use(store)
    worker = StoreTransfers(
        rank(), shared, model, small_pool(), "f32", fingerprint=lambda m: "w"
    )
    wait_identity(worker)
    adapter = ChunkCacheSchedulerAdapter(
        *make_config(
            num_kv_blocks=64,
            store="mooncake://127.0.0.1:1?lookup_timeout=600&local_client=none",
        )
    )
    adapter.manager.store_probe = AlwaysMiss()
    path = tmp_path / "sql"
    write_adapter(path, seed=1)

    def report():
        adapter.on_store_report(worker.take_report())

    def put_identity(rid: str, first: int, lora_id: int) -> str:
        """A request whose document is new; its child computed and finished: the
        adapter identity its store entry is written under."""
        r = Request(
            rid,
            list(range(first, first + 10)),
            SamplingParams(max_tokens=2),
            None,
            chunk_layout=[3, 5, 2],
        )
        r.lora_request = LoRARequest("sql", lora_id, str(path))
        adapter.on_new_request(r)
        adapter.get_num_new_matched_tokens(r, 0)
        for child in adapter.take_internal_requests():
            finish(adapter, child, RequestStatus.FINISHED_LENGTH_CAPPED)
        (put_a, put_b) = adapter.store.take_step(epoch=0).puts
        assert put_a.entry.lora == put_b.entry.lora
        finish(adapter, r, RequestStatus.FINISHED_STOPPED)
        return put_a.entry.lora

    model.lora_manager._add_adapter(load_adapter(path, 1))  # the worker loads id 1
    report()
    v1 = put_identity("a", 100, 1)
    assert v1.startswith("sql@")

    # Rewritten in place under the same path and id: the worker keeps id 1's
    # weights (vLLM loads an id once), so the entry is v1's KV and must say so.
    write_adapter(tmp_path / "other", seed=2)
    shutil.copy(tmp_path / "other" / WEIGHTS, path / WEIGHTS)
    assert put_identity("b", 200, 1) == v1, "keyed by the files, not by what was loaded"

    # A copy that keeps size and mtime (cp -p) over the same path, loaded as id 2:
    # other weights, so another identity.
    before = os.stat(path / WEIGHTS)
    write_adapter(tmp_path / "third", seed=3)
    third = tmp_path / "third" / WEIGHTS
    assert os.stat(third).st_size == before.st_size
    os.utime(third, ns=(before.st_atime_ns, before.st_mtime_ns))
    shutil.copy2(third, path / WEIGHTS)
    assert os.stat(path / WEIGHTS).st_mtime_ns == before.st_mtime_ns
    model.lora_manager._add_adapter(load_adapter(path, 2))
    report()
    v3 = put_identity("c", 300, 2)
    assert v3 != v1 and v3 != put_identity("d", 400, 1), "a stale digest of the files"

    # A put queued under v1 after the worker reloaded id 1 with other weights (an
    # eviction, then a load of the rewritten files) is not written.
    step = StoreStep(epoch=0)
    r = Request(
        "e",
        list(range(500, 510)),
        SamplingParams(max_tokens=2),
        None,
        chunk_layout=[3, 5, 2],
    )
    r.lora_request = LoRARequest("sql", 1, str(path))
    adapter.on_new_request(r)
    adapter.get_num_new_matched_tokens(r, 0)
    for child in adapter.take_internal_requests():
        finish(adapter, child, RequestStatus.FINISHED_LENGTH_CAPPED)
    step = adapter.store.take_step(epoch=0)
    assert {p.entry.lora for p in step.puts} == {v1}
    model.lora_manager._add_adapter(load_adapter(path, 1))
    written = len(store.values)
    worker.on_step(step)
    drain_puts(worker)
    assert len(store.values) == written and worker.counters["store_puts_skipped"] == 2
    adapter.store.close()
    worker.close(timeout_s=1.0)
