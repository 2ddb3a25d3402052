"""planner.cli.steps.DeviceCopy: the batch's host-to-device copy `planner train` and `planner bench` issue.

On CUDA it copies on a side stream; these tests hold what every device
shares: the values, the channels_last conversion, and batches already on the device passed through untouched."""

from __future__ import annotations

import torch

from planner.cli.steps import DeviceCopy


def test_cpu_copy_keeps_values_and_converts_to_channels_last() -> None:
    x, y = torch.randn(4, 3, 8, 8), torch.arange(4)
    xd, yd = DeviceCopy(torch.device("cpu"), channels_last=True)(x, y)
    assert torch.equal(xd, x) and torch.equal(yd, y)
    assert xd.is_contiguous(memory_format=torch.channels_last)
    assert not x.is_contiguous(memory_format=torch.channels_last)  # the loader's tensor is left as it was


def test_no_side_stream_off_cuda_and_non_image_batches_keep_their_layout() -> None:
    copy = DeviceCopy(torch.device("cpu"), channels_last=True)
    assert copy.stream is None
    tokens, y = torch.randint(0, 100, (2, 16)), torch.randint(0, 100, (2, 16))
    xd, yd = copy(tokens, y)
    assert xd is tokens and yd is y  # already on the device: nothing copied



def test_pinned_pool_stats_only_on_cuda() -> None:
    from planner.cli.steps import pinned_pool_stats

    assert pinned_pool_stats(torch.device("cpu")) is None
    st = pinned_pool_stats(torch.device("cuda"))
    if not torch.cuda.is_available():
        assert st is None  # a CPU-only machine has no pinned pool to read
    else:
        assert st is not None and set(st) == {"allocs", "alloc_ms", "pool_mb"}
