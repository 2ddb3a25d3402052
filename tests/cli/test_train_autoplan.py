"""The one auto-plan pipeline (planner.cli.autoplan) behind `planner train --auto` and `planner bench`, on one CPU
rank without a process group: profile -> quality gate -> solve -> loader check."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from planner.cli.autoplan import AutoPlanOptions, auto_plan
from planner.cli.train_config import TrainConfig
from planner.errors import ValidationError
from planner.profile import Profile
from profiler.workloads.specs import build_workload

ENV: Any = SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"), is_main=True, distributed=False)


def test_a_run_without_a_dataloader_is_planned_without_one(tmp_path: Path) -> None:
    """--data-on-device trains on batches made on the device: the profile measures no loader, the loader check does
    not run, and the plan and profile are written as solved, the plan marked with its workload and writer."""
    cfg = TrainConfig(model="mlp", data_on_device=True)
    workload = build_workload("mlp", "fake", num_samples=256)
    opts = AutoPlanOptions(global_batch=16, quick=True, plan_out=str(tmp_path / "plan.json"),
                           profile_out=str(tmp_path / "profile.json"), written_by="planner train --auto")
    auto = auto_plan(cfg, ENV, workload, opts)
    assert not auto.profile.has_loader and auto.loader_check is None
    assert auto.plan.global_batch == 16 and auto.profile_s > 0
    written = json.loads((tmp_path / "plan.json").read_text())
    assert written["meta"]["written_by"] == "planner train --auto" and written["meta"]["workload"]["model"] == "mlp"
    assert Profile.load(str(tmp_path / "profile.json")).fingerprint() == auto.profile.fingerprint()
    assert written["solver"]["profile_fingerprint"] == auto.profile.fingerprint()


def test_a_run_with_a_dataloader_is_checked_and_its_notes_go_where_asked() -> None:
    """The DataLoader is profiled and the plan's loader timed (0.2 s); what the check found goes to ``say`` on rank
    0 (`planner bench` passes stderr), and the record says whether the split moved.  No writer: no mark."""
    notes: list[str] = []
    cfg = TrainConfig(model="mlp", loader_check_s=0.2)
    workload = build_workload("mlp", "fake", num_samples=256)
    auto = auto_plan(cfg, ENV, workload, AutoPlanOptions(global_batch=16, quick=True), say=notes.append)
    assert auto.profile.has_loader and auto.loader_check is not None
    assert auto.loader_check["seconds"] == 0.2 and len(auto.loader_check["measured_s_per_sample"]) == 1
    assert notes and all(n.startswith("loader check") for n in notes)
    assert "written_by" not in auto.plan.meta


def test_the_solve_options_follow_the_run() -> None:
    """FSDP2 plans the same micro-step count on every rank; a BatchNorm model at least 2 a rank; a worker cap only
    when given."""
    bn = build_workload("cifar_cnn", "fake", image_size=16, num_samples=64)
    opts = AutoPlanOptions(global_batch=64).solve_options(TrainConfig(model="cifar_cnn", fsdp=True), bn)
    assert opts.mode == "fsdp" and opts.min_batch == 2 and opts.max_workers_per_rank is None
    mlp = build_workload("mlp", "fake", num_samples=64)
    opts = AutoPlanOptions(global_batch=64, max_workers_per_rank=3).solve_options(TrainConfig(), mlp)
    assert opts.mode == "ddp" and opts.min_batch == 1 and opts.max_workers_per_rank == 3
    with pytest.raises(ValidationError, match="global_batch"):
        AutoPlanOptions(global_batch=0)


def test_train_and_bench_share_the_pipeline() -> None:
    """Neither command keeps a copy of the steps: both reach planner.cli.autoplan.auto_plan."""
    import inspect

    from planner.cli import bench, cmd_train, train

    for module in (cmd_train, bench):
        assert "auto_plan(" in inspect.getsource(module)
    for module in (bench, train):
        source = inspect.getsource(module)
        assert "profile_this_rank" not in source and "keep_equal_within_noise" not in source
