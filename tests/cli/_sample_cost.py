"""A model whose forward pass costs a fixed sleep per sample: its step time is the sleep, not the host's CPU.

``planner train --model tests.cli._sample_cost:sleeping_net --dataset tests.cli._sample_cost:tensor_images``
trains a one-layer classifier whose forward sleeps ``SLEEP_PER_SAMPLE_S`` for every sample of the batch, on
images made once as tensors (the loader's workers only index them).  On the shared 2-core box beside a CPU hog a small conv
model's step read anywhere from 100 to 180 ms (about 10 ms idle), so rank 1 emulated 3x slower -- three passes of
that model -- could read slower in the epoch before the slowdown than after it.  A sleep takes as long on a loaded
host as on an idle one, so three passes of this model take three times one pass, whatever else the host runs:
the speed difference a test asserts on is the emulation's, not the scheduler's.  The tensors keep the loader
out of it: torchvision's FakeData-like images (PIL, resized crops) made such a step loader-bound beside the hog
(1.1 s a step against 0.16 s of compute), and both ranks alike.
"""

from __future__ import annotations

import time

import torch
from torch import nn

SLEEP_PER_SAMPLE_S = 0.004
"""4 ms a sample: 128 ms for a batch of 32, above the 50-80 ms a loaded box's scheduling adds to such a step."""
IN_FEATURES = 3 * 16 * 16
"""The inputs of ``--image-size 16`` (3 x 16 x 16)."""


class SleepingNet(nn.Module):
    """Flatten, one linear layer (16 x 16 RGB inputs); the forward sleeps ``SLEEP_PER_SAMPLE_S`` x the batch size first."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.fc = nn.Linear(IN_FEATURES, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(SLEEP_PER_SAMPLE_S * x.shape[0])
        return self.fc(x.flatten(1))


def sleeping_net(num_classes: int = 10) -> nn.Module:
    return SleepingNet(num_classes)


class TensorImages(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    """``size`` random 3 x 16 x 16 images and labels of 10 classes, made once from a fixed seed."""

    def __init__(self, size: int = 2048) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(size, 3, 16, 16, generator=g)
        self.y = torch.randint(0, 10, (size,), generator=g).tolist()

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.x[i], self.y[i]


def tensor_images() -> TensorImages:
    return TensorImages()
