# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`maybe_transfer_kv_layer` hands the layer's post-RoPE key/value to
`KVConnectorBase_V1.save_kv_layer` as keyword arguments, found by name."""

from typing import Any

import pytest
import torch

from vllm.model_executor.layers.attention import attention, kv_transfer_utils


class RecordingConnector:
    """The consumer: keeps what `save_kv_layer` was given."""

    def __init__(self) -> None:
        self.saved: list[dict[str, Any]] = []

    def has_connector_metadata(self) -> bool:
        return True

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name, kv_cache, attn_metadata, **kwargs) -> None:
        self.saved.append({"layer_name": layer_name, **kwargs})


@pytest.fixture
def connector(monkeypatch: pytest.MonkeyPatch) -> RecordingConnector:
    recording = RecordingConnector()
    kv_cache = torch.zeros(1)
    monkeypatch.setattr(kv_transfer_utils, "has_kv_transfer_group", lambda: True)
    monkeypatch.setattr(kv_transfer_utils, "is_v1_kv_transfer_group", lambda: True)
    monkeypatch.setattr(kv_transfer_utils, "get_kv_transfer_group", lambda: recording)
    monkeypatch.setattr(
        attention,
        "get_attention_context",
        lambda layer_name: (object(), None, kv_cache, None),
    )
    return recording


def test_key_and_value_reach_save_kv_layer_by_position_and_by_name(connector):
    # NOTE: vLLM's attention ops take layer_name by position; key and value
    # may come either way.
    @kv_transfer_utils.maybe_transfer_kv_layer
    def forward(layer_name, query, key=None, value=None):
        return query

    query, key, value = (torch.full((2, 1, 4), float(i)) for i in range(3))
    forward("model.layers.0.attn", query, key, value)
    forward("model.layers.1.attn", query, value=value, key=key)

    assert [s["layer_name"] for s in connector.saved] == [
        "model.layers.0.attn",
        "model.layers.1.attn",
    ]
    for saved in connector.saved:
        assert saved["key"] is key
        assert saved["value"] is value


def test_a_function_without_key_or_value_passes_none(connector):
    @kv_transfer_utils.maybe_transfer_kv_layer
    def forward(query, output, layer_name):
        return output

    forward(torch.zeros(1), None, "model.layers.0.attn")

    assert connector.saved == [
        {"layer_name": "model.layers.0.attn", "key": None, "value": None}
    ]
