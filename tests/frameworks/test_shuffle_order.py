"""The framework adapters keep the order the user's loader asked for: a script with ``shuffle=False`` stays in the
dataset's order on a plan, one with ``shuffle=True`` stays shuffled, and where an adapter cannot see the loader it
replaces (Accelerate) the choice is required.  One process, no launch: the planned loaders are built and drawn."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, WeightedRandomSampler

from planner.errors import ValidationError
from tests.frameworks._common import DictData, write_plan

N = 16
ORDER = list(range(N))


def order_of(loader: Any) -> list[int]:
    """The sample indices the loader yields, in order (DictData's x[0] is not the index: use the sampler's)."""
    return [i for batch in loader.batch_sampler for i in batch]


def test_lightning_follows_the_training_loaders_order(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    from runtime.adapters.lightning import LightningPlan, loader_shuffles

    data = DictData(N)
    plan = write_plan(tmp_path / "plan.json", [4])
    assert loader_shuffles(DataLoader(data, batch_size=4)) is False  # DataLoader's default: SequentialSampler
    assert loader_shuffles(DataLoader(data, batch_size=4, shuffle=True)) is True
    # What Lightning hands the strategy under use_distributed_sampler=True: its DistributedSampler, carrying shuffle=
    for shuffle in (False, True):
        injected = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, num_replicas=1, rank=0,
                                                                             shuffle=shuffle))
        assert loader_shuffles(injected) is shuffle
    weighted = DataLoader(data, batch_size=4, sampler=WeightedRandomSampler([1.0] * N, N))
    with pytest.raises(ValidationError, match=r"draws from a WeightedRandomSampler.*LightningPlan\(\.\.\., "
                                              r"shuffle=True\) or shuffle=False"):
        loader_shuffles(weighted)

    kept = LightningPlan(plan).planned_loader(DataLoader(data, batch_size=4), torch.device("cpu"), None)
    assert order_of(kept) == ORDER  # shuffle=False in the script: the plan keeps the dataset's order
    shuffled = LightningPlan(plan).planned_loader(DataLoader(data, batch_size=4, shuffle=True), torch.device("cpu"),
                                                  None)
    assert sorted(order_of(shuffled)) == ORDER and order_of(shuffled) != ORDER
    forced = LightningPlan(plan, shuffle=True).planned_loader(weighted, torch.device("cpu"), None)
    assert sorted(order_of(forced)) == ORDER  # the user said which order: no question asked


def test_accelerate_requires_the_order_and_keeps_it(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    from runtime.adapters.accelerate import planned_dataloader

    plan = write_plan(tmp_path / "plan.json", [4])
    accelerator = SimpleNamespace(device=torch.device("cpu"), device_placement=False, non_blocking=False)
    with pytest.raises(ValidationError, match=r"pass shuffle=True or shuffle=False, as the DataLoader it replaces "
                                              r"had it \(DataLoader's default is False\)") as e:
        planned_dataloader(accelerator, plan, DictData(N))
    assert "\n" not in str(e.value)
    kept = planned_dataloader(accelerator, plan, DictData(N), shuffle=False)
    assert order_of(kept) == ORDER
    shuffled = planned_dataloader(accelerator, plan, DictData(N), shuffle=True)
    assert sorted(order_of(shuffled)) == ORDER and order_of(shuffled) != ORDER


def test_hf_follows_the_training_arguments_sampling_strategy() -> None:
    pytest.importorskip("transformers")
    from transformers import TrainingArguments

    from runtime.adapters.hf import trainer_shuffles

    assert trainer_shuffles(TrainingArguments(output_dir="unused", report_to=[])) is True  # the Trainer's default
    assert trainer_shuffles(TrainingArguments(output_dir="unused", report_to=[],
                                              train_sampling_strategy="sequential")) is False
    assert trainer_shuffles(SimpleNamespace(group_by_length=False)) is True  # a transformers without the strategy
    with pytest.raises(ValidationError, match=r"train_sampling_strategy 'group_by_length' groups samples by length"):
        trainer_shuffles(SimpleNamespace(group_by_length=True))
