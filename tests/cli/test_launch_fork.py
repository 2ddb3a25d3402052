"""planner.cli.launch.spawn: a spawned rank's DataLoader workers fork, as under torchrun (a spawned process would
otherwise start every worker as a fresh interpreter: ~10 s a loader on a GPU host)."""

from __future__ import annotations

import multiprocessing
import sys

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from tests._dist import run_distributed


def _check(rank: int, world_size: int) -> None:
    assert multiprocessing.get_start_method() == "fork", multiprocessing.get_start_method()
    loader = DataLoader(TensorDataset(torch.arange(8.0)), batch_size=4, num_workers=1)
    assert loader.multiprocessing_context is None  # the default context: fork, set by the launcher
    assert sum(float(x.sum()) for (x,) in loader) == 28.0  # a worker ran and delivered every batch


@pytest.mark.distributed
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork is the launcher's choice on Linux only")
def test_a_spawned_ranks_loader_workers_fork() -> None:
    run_distributed(_check, 2, timeout_s=60)
