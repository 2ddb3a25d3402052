"""A dataset whose every sample costs a fixed sleep in the loader worker: a loader-bound rank on any host.

``--dataset benchmarks._slow_loader:slow_images`` gives 3 x 32 x 32 tensors made once from a fixed seed; each
``__getitem__`` sleeps ``SLEEP_PER_SAMPLE_S`` first, so one worker hands over at most 1 / SLEEP_PER_SAMPLE_S
samples a second whatever else the host runs (a sleep is not slowed by other processes), and a rank capped at W
workers at most W times that.
"""

from __future__ import annotations

import time

import torch

SLEEP_PER_SAMPLE_S = 0.003
"""3 ms a sample: a batch of 32 takes one worker ~96 ms, several times mlp's step at 32 on a CPU core."""


class SlowImages(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    """``size`` random 3 x 32 x 32 images and labels of 10 classes; each item sleeps SLEEP_PER_SAMPLE_S."""

    def __init__(self, size: int = 2048) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(size, 3, 32, 32, generator=g)
        self.y = torch.randint(0, 10, (size,), generator=g).tolist()

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        time.sleep(SLEEP_PER_SAMPLE_S)
        return self.x[i], self.y[i]


def slow_images() -> SlowImages:
    return SlowImages()
