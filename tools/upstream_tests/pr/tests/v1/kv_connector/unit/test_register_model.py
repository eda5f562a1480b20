# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`KVConnectorBase_V1.register_model`: the model runner hands the loaded
model to the connector right before `register_kv_caches`."""

from unittest.mock import MagicMock, call

import pytest
import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiConnector,
)
from vllm.v1.worker.gpu import kv_connector as runner_kv_connector


def test_the_default_does_nothing():
    connector = MagicMock(spec_set=KVConnectorBase_V1)
    assert KVConnectorBase_V1.register_model(connector, torch.nn.Linear(1, 1)) is None
    assert connector.mock_calls == []


def test_multi_connector_hands_the_model_to_every_connector():
    connector = object.__new__(MultiConnector)
    first = MagicMock(spec_set=KVConnectorBase_V1)
    second = MagicMock(spec_set=KVConnectorBase_V1)
    connector._connectors = [first, second]
    model = torch.nn.Linear(1, 1)

    connector.register_model(model)

    first.register_model.assert_called_once_with(model)
    second.register_model.assert_called_once_with(model)


def test_the_runner_registers_the_model_before_the_kv_caches(
    monkeypatch: pytest.MonkeyPatch,
):
    connector = MagicMock(spec_set=KVConnectorBase_V1)
    monkeypatch.setattr(runner_kv_connector, "has_kv_transfer_group", lambda: True)
    monkeypatch.setattr(runner_kv_connector, "get_kv_transfer_group", lambda: connector)
    model = torch.nn.Linear(1, 1)
    kv_caches = {"model.layers.0.attn": torch.zeros(1)}

    runner_kv_connector.get_kv_connector(MagicMock(), kv_caches, model)

    assert connector.mock_calls[:2] == [
        call.register_model(model),
        call.register_kv_caches(kv_caches),
    ]
