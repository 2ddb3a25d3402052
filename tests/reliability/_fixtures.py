"""Model and dataset factories for the reliability tests (``--model tests.reliability._fixtures:model``).

float64 and a fixed dataset make a run bit-reproducible on CPU, so "resumed == uninterrupted" can be checked with
``torch.equal`` on the parameters. The other factories produce one failure each on purpose (an empty dataset, a
rank-dependent length, a rank that dies mid-step).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

NUM_FEATURES = 8
NUM_CLASSES = 4
DATASET_LEN = 100
# Step (counted from 1, per process) at which `dying_model` kills rank DIE_RANK.
DIE_AT_STEP = 3
DIE_RANK = 1


class TensorPairs(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """A fixed float64 dataset: x ~ N(0, 1) and y from a fixed generator (identical in every process)."""

    def __init__(self, n: int, seed: int = 1234) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, NUM_FEATURES, generator=g, dtype=torch.float64)
        self.y = torch.randint(0, NUM_CLASSES, (n,), generator=g)
        self.classes = list(range(NUM_CLASSES))

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def model(num_classes: int = NUM_CLASSES) -> nn.Module:
    return nn.Sequential(nn.Linear(NUM_FEATURES, 16), nn.Tanh(), nn.Linear(16, num_classes)).double()


def dataset() -> TensorPairs:
    return TensorPairs(DATASET_LEN)


def empty_dataset() -> TensorPairs:
    return TensorPairs(0)


def dataset_len_by_rank() -> TensorPairs:
    """One sample more on every rank above 0: ranks disagree on the dataset length."""
    return TensorPairs(DATASET_LEN + int(os.environ.get("RANK", "0")))


class _Dying(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.calls = 0

    def forward(self, x: torch.Tensor) -> Any:
        self.calls += 1
        if self.calls == DIE_AT_STEP and int(os.environ.get("RANK", "0")) == DIE_RANK:
            os._exit(1)  # no cleanup, no exception: what a segfault or an OOM kill looks like to the peers
        return self.inner(x)


def dying_model(num_classes: int = NUM_CLASSES) -> nn.Module:
    return _Dying(model(num_classes))


class _Slow(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> Any:
        # Stretches a run so a test can kill it mid-epoch; the numbers computed do not depend on it.
        time.sleep(float(os.environ.get("RELIABILITY_STEP_SLEEP_S", "0")))
        return self.inner(x)


def slow_model(num_classes: int = NUM_CLASSES) -> nn.Module:
    return _Slow(model(num_classes))


def not_a_model() -> str:
    return "I am not a torch.nn.Module"


# Dataset factories that return something else than a dataset (each was a TypeError traceback).
def none_dataset() -> None:
    return None


def int_dataset() -> int:
    return 7


def list_of_ints_dataset() -> list[int]:
    return [1, 2, 3]


class _Failing(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.calls = 0

    def forward(self, x: torch.Tensor) -> Any:
        self.calls += 1
        if self.calls == DIE_AT_STEP:
            raise RuntimeError(f"injected failure at forward call {DIE_AT_STEP}")
        return self.inner(x)


def failing_model(num_classes: int = NUM_CLASSES) -> nn.Module:
    """Raises in the forward of its 3rd step: an internal error in the middle of a run."""
    return _Failing(model(num_classes))


def long_dataset() -> TensorPairs:
    """2000 samples: epochs of 100 steps at global batch 20, long enough to stop a run in the middle of one."""
    return TensorPairs(2000)
