# SPDX-License-Identifier: Apache-2.0
"""The query runs' host-to-device copies (issue 60): reused host buffers, a new device
tensor per copy, no alias of the buffer. On the CPU the CUDA path's code (`staged`) runs
with pin=False (pinning needs a CUDA driver); `to_device` skips the copy where the
tensor is already on the device."""

import torch
from vllm.v1.worker.host_staging import HostStaging


def test_staged_copies_go_through_one_reused_buffer_per_name():
    staging = HostStaging("cpu", pin=False)
    first = staging.staged("positions", torch.tensor([3, -7, 0], dtype=torch.int64))
    buffer = staging._buffers["positions"]
    second = staging.staged("positions", torch.tensor([9, 9], dtype=torch.int64))
    # The same host buffer, written again; the first copy is its own tensor.
    assert staging._buffers["positions"].data_ptr() == buffer.data_ptr()
    assert first.tolist() == [3, -7, 0] and second.tolist() == [9, 9]
    assert (
        first.data_ptr() != buffer.data_ptr() and second.data_ptr() != buffer.data_ptr()
    )
    # Another name, another buffer (a step's copies do not overwrite each other).
    lens = staging.staged(
        "seq_lens", torch.tensor([[41, 7], [15, 22]], dtype=torch.int32)
    )
    assert lens.shape == (2, 2) and lens.dtype == torch.int32
    assert lens.tolist() == [[41, 7], [15, 22]]
    assert staging._buffers["seq_lens"].data_ptr() != buffer.data_ptr()
    assert not buffer.is_pinned()


def test_a_larger_step_grows_the_buffer_and_a_smaller_one_reuses_it():
    staging = HostStaging("cpu", pin=False)
    staging.staged("runs", torch.arange(10))
    small = staging._buffers["runs"]
    big = staging.staged("runs", torch.arange(1000))
    assert big.tolist() == list(range(1000))
    grown = staging._buffers["runs"]
    assert grown.numel() >= 1000 and grown.data_ptr() != small.data_ptr()
    assert staging.staged("runs", torch.arange(5)).tolist() == list(range(5))
    assert staging._buffers["runs"].data_ptr() == grown.data_ptr()


def test_on_the_host_device_nothing_is_copied_and_cuda_pins():
    staging = HostStaging(torch.device("cpu"))
    src = torch.tensor([1, 2, 3])
    assert staging.to_device("x", src) is src and not staging._buffers
    assert not staging.pin
    # A CUDA device pins its buffers (the same code; not executed here).
    assert HostStaging("cuda:0").pin
