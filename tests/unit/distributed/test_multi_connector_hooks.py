# SPDX-License-Identifier: Apache-2.0
"""vLLM's MultiConnector forwards the connector hooks the series adds (patch 0019):
register_model to every sub-connector, internal and failed requests gathered from every
one, a prefill gap from the first that has one. Real MultiConnector, real VllmConfig;
the sub-connectors are this module's own classes, loaded by vLLM's factory through
kv_connector_module_path. Without the overrides each hook was the base class's no-op
default (upstream's test_multi_connector_overrides_all_base_methods failed on it)."""

from __future__ import annotations

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    PrefillGap,
)


class _Hooked(KVConnectorBase_V1):
    """A sub-connector that answers every hook from its class's `answers`."""

    answers: dict = {}

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.models: list = []

    # The abstract methods: this connector moves no KV.
    def start_load_kv(self, forward_context, **kwargs): ...
    def wait_for_layer_load(self, layer_name): ...
    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs): ...
    def wait_for_save(self): ...
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens): ...
    def build_connector_meta(self, scheduler_output):
        return KVConnectorMetadata()

    # The series' hooks.
    def register_model(self, model):
        self.models.append(model)

    def take_internal_requests(self):
        return list(self.answers["internal"])

    def take_failed_requests(self):
        return dict(self.answers["failed"])

    def get_prefill_gap(self, request, num_computed_tokens):
        return self.answers["gap"]


class FirstHooked(_Hooked):
    answers = {"internal": ["child-a"], "failed": {"r1": "first's reason"}, "gap": None}


class SecondHooked(_Hooked):
    answers = {
        "internal": ["child-b", "child-c"],
        "failed": {"r1": "second's reason", "r2": "only the second"},
        "gap": PrefillGap(num_external_tokens=16, max_new_tokens=4),
    }


def _multi(role: KVConnectorRole):
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    config = VllmConfig()
    config.scheduler_config.disable_hybrid_kv_cache_manager = True
    config.kv_transfer_config = KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        kv_connector_extra_config={
            "connectors": [
                {
                    "kv_connector": name,
                    "kv_role": "kv_both",
                    "kv_connector_module_path": __name__,
                }
                for name in ("FirstHooked", "SecondHooked")
            ]
        },
    )
    return KVConnectorFactory.create_connector(config, role, None)


def test_multi_connector_forwards_the_series_hooks():
    multi = _multi(KVConnectorRole.SCHEDULER)
    first, second = multi._connectors
    assert (type(first), type(second)) == (FirstHooked, SecondHooked)

    # Internal requests from every sub-connector, in connector order.
    assert multi.take_internal_requests() == ["child-a", "child-b", "child-c"]
    # Failed requests from every one; a request two of them fail keeps the first reason.
    assert multi.take_failed_requests() == {
        "r1": "first's reason",
        "r2": "only the second",
    }
    # The first sub-connector with a gap owns the stretch.
    assert multi.get_prefill_gap(object(), 0) == PrefillGap(16, 4)


def test_multi_connector_hands_the_model_to_every_sub_connector():
    multi = _multi(KVConnectorRole.WORKER)
    model = object()
    multi.register_model(model)
    assert [c.models for c in multi._connectors] == [[model], [model]]


def test_no_sub_connector_with_a_gap_is_no_gap():
    multi = _multi(KVConnectorRole.SCHEDULER)
    multi._connectors[1].answers = {**SecondHooked.answers, "gap": None}
    assert multi.get_prefill_gap(object(), 0) is None


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_the_chunk_cache_connector_without_the_flag_is_refused(role):
    # Named in a --kv-transfer-config (here inside a MultiConnector) without
    # --enable-chunk-cache, the scheduler would never call its hooks: refused by name.
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    config = VllmConfig()
    config.scheduler_config.disable_hybrid_kv_cache_manager = True
    config.kv_transfer_config = KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        kv_connector_extra_config={
            "connectors": [
                {"kv_connector": "ChunkCacheConnector", "kv_role": "kv_both"}
            ]
        },
    )
    with pytest.raises(
        ValueError, match="ChunkCacheConnector is turned on with --enable-chunk-cache"
    ):
        KVConnectorFactory.create_connector(config, role, None)
